"""Publishing analysis results: arrays and key numbers stored (:mod:`analysis.results.storage`), scalars to
TensorBoard, and each figure drawn once, as an image that goes to TensorBoard and to a PNG file.

The training-time callback (``analysis/frontends/callbacks.py``) stores and logs at once and draws in a background
thread; offline analysis (``analysis/frontends/runner.py``) does all three in turn.
"""

from __future__ import annotations

from pathlib import Path

from analysis.engine.figures import render, write_png
from analysis.engine.measure import registry
from analysis.results import storage
from analysis.results.storage import part_label

SCALAR_PREFIX = "analysis/"  # one TensorBoard group for every analysis scalar, beside train/, eval/ and time/


def label_figure(fig, label: str | None):
    """Prefix ``label: `` to the figure's title (its suptitle, else every titled panel, else a new suptitle)."""
    if not label:
        return fig
    sup = getattr(fig, "_suptitle", None)
    titled = [ax for ax in fig.axes if ax.get_title()]
    if sup is not None and sup.get_text():
        sup.set_text(f"{label}: {sup.get_text()}")
    elif titled:
        for ax in titled:
            ax.set_title(f"{label}: {ax.get_title()}")
    else:
        fig.suptitle(label)
    return fig


def make_figures(res: dict, step: int | None = None, part: str | None = None) -> dict:
    """{tag: figure} of every measure; for a part other than the default, tags ``<part>/...`` and titles labelled."""
    reg = registry()
    label = part_label(part)
    figs = {}
    for name, r in res.items():
        if name in reg:
            figs.update(reg[name].figures(r, step))
    if label:
        figs = {f"{label}/{tag}": label_figure(fig, label) for tag, fig in figs.items()}
    return figs


def figure_file(tag: str) -> str:
    """The PNG file name of a figure's tag (``norm_ratio/lines`` -> ``norm_ratio_lines.png``; storage.py's layout)."""
    return f"{tag.replace('/', '_')}.png"


def log_results(res: dict, writer, step: int, part: str | None = None) -> None:
    """TensorBoard scalars of every measure under ``analysis/`` (e.g. ``analysis/cka/mean_offdiag``; another part
    than the default under ``analysis/<part>/``), so the training and eval curves are not spread among dozens of
    analysis groups; through the raw SummaryWriter."""
    if writer is None:
        return
    reg = registry()
    label = part_label(part)
    prefix = SCALAR_PREFIX + (f"{label}/" if label else "")
    for name, r in res.items():
        if name in reg:
            for tag, v in reg[name].scalars(r).items():
                writer.add_scalar(prefix + tag, v, step)


def publish(
    res: dict,
    out_dir: Path,
    writer=None,
    step: int | None = None,
    figures: bool = True,
    keys: dict | None = None,
    figure_dir: Path | None = None,
    png: bool = True,
    part: str | None = None,
    titled: bool = True,
) -> Path:
    """Write arrays + summary.json (+ cache keys) to ``out_dir``, log scalars, and draw each figure ONCE, as an
    image that goes to TensorBoard and (``png``) to ``figure_dir`` (default ``out_dir``); ``part``: the network the
    results are of, labelling tags and titles unless it is the default one; ``titled``: whether figure titles name
    the step (not for a model from elsewhere, whose one "step" is not a training step)."""
    storage.write_results(res, out_dir, step, keys)
    log_results(res, writer, step, part)
    if figures:
        publish_figures(res, Path(figure_dir or out_dir), writer, step, png, part, titled)
    return Path(out_dir)


def publish_figures(
    res: dict,
    figure_dir: Path,
    writer=None,
    step: int | None = None,
    png: bool = True,
    part: str | None = None,
    titled: bool = True,
) -> None:
    """Draw each measure's figures ONCE, as images that go to TensorBoard and (``png``) to ``figure_dir``. Uses no
    pyplot state (analysis/engine/figures.py), so it may run in a background thread."""
    if not png and writer is None:
        return
    if png:
        Path(figure_dir).mkdir(parents=True, exist_ok=True)
    label = part_label(part)
    for name, fig in make_figures(res, step if titled else None, part).items():
        rgb = render(fig)
        if writer is not None:
            writer.add_image(SCALAR_PREFIX + name, rgb, step, dataformats="HWC")
        if png:  # the file name without the part: the part's own folder says it
            stem = name[len(label) + 1 :] if label else name
            write_png(rgb, Path(figure_dir) / figure_file(stem))
    if writer is not None:  # drawn after the checkpoint's flush (in the background): a kill must not lose them
        writer.flush()
