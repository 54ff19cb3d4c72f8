"""What the data lacks for a measure, said by each front end in its own words.

A precondition (:func:`analysis.engine.measure.labels_problem`, a measure's
:meth:`~analysis.engine.measure.Measure.problem`,
:func:`analysis.estimators.probing.probe_split_problem`, :func:`analysis.engine.suite.batch_problem`) returns a
structured problem that names the missing piece: :class:`Missing` (class labels of the analysis images, probe-train
images, or their
labels), :class:`TooFewShots` (too few probe-train images per class for a probe's shots) or :class:`BatchSizes` (a
last minibatch too small for minibatch CKA). :func:`sentence` turns one into the user's one sentence with the fix in
the vocabulary of the front end that was used: ``VOCAB[front]``, one small map per front end, here and nowhere else:

- ``recipe``: the training-time callback (recipe keys: ``data.probe_train_size``, the callback's options);
- ``run``: ``python -m analysis RUN`` and ``compare`` on run folders (the run's images are fixed: ``--opt``);
- ``model``: ``python -m analysis --model ... --recipe`` on a recipe's data (``--set``, ``--opt``);
- ``images``: ``python -m analysis --model ... --images DIR`` (``--images``, ``--probe-images``, ``--opt``);
- ``api`` / ``api_folder``: :func:`analysis.frontends.api.analyze` with tensors (``labels=``, ``probe_images=``,
  ``probe_labels=``, ``options=``) or with a folder of images.

A measure from elsewhere may still return a plain string; it is shown as it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

PIECES = ("labels", "probe_images", "probe_labels")  # the order they are named in


@dataclass(frozen=True)
class Missing:
    """Labels a measure reads that the data lacks: ``pieces`` from :data:`PIECES` ("labels": the analysis images
    have none or some unknown; "probe_images": there are no probe-train images; "probe_labels": the probe-train
    images have none or some unknown)."""

    pieces: tuple[str, ...]

    def __str__(self) -> str:
        return sentence(self, "recipe", [])


@dataclass(frozen=True)
class TooFewShots:
    """A few-shot probe's ``shots`` per class drawn from half of the probe-train images, whose rarest class has
    ``rarest`` images (``num_classes`` classes)."""

    measure: str
    option: str
    shots: int
    rarest: int
    num_classes: int

    def __str__(self) -> str:
        return sentence(self, "recipe", [self.measure])


@dataclass(frozen=True)
class BatchSizes:
    """``n_images`` analysis images in minibatches of ``batch_size`` leave a last minibatch of 1-3 images (or there
    are fewer than 4 images, or the minibatch is below 4)."""

    n_images: int
    batch_size: int

    @property
    def suggestion(self) -> int | None:
        """The largest minibatch size up to the one given that leaves no last minibatch of 1-3 images."""
        if self.n_images < 4:
            return None
        top = min(max(self.batch_size, 4), self.n_images)
        return next(b for b in range(top, 3, -1) if self.n_images % b == 0 or self.n_images % b >= 4)

    def __str__(self) -> str:
        return sentence(self, "recipe", [])


Problem = Missing | TooFewShots | BatchSizes | str

# Each front end's words. labels / probe / probe_labels: how to give what is missing; probe_images: what the
# probe-train images are called; more: how to give more of them ({per_class}, {total}; None: they are fixed);
# shots: how to lower a probe's shots ({measure}, {option}, {value}); batch: how to change the minibatch ({value}).
VOCAB: dict[str, dict[str, str | None]] = {
    "recipe": {
        "measures": "the callback's measures",
        "labels": "use data whose images have class labels (data.label_column)",
        "probe": "set data.probe_train_size above 0",
        "probe_labels": "use data whose images have class labels (data.label_column)",
        "probe_images": "probe-train images (data.probe_train_size)",
        "more": "raise data.probe_train_size to at least {total}",
        "shots": "lower the option {measure}.{option} to {value}",
        "batch": "change data.analysis_size or the callback's batch_size (e.g. batch_size: {value})",
    },
    "run": {
        "measures": "--measures",
        "labels": "analyse a run trained on labelled data",
        "probe": "analyse a run whose recipe has probe-train images (data.probe_train_size above 0)",
        "probe_labels": "analyse a run trained on labelled data",
        "probe_images": "probe-train images of the run (its recipe's data.probe_train_size)",
        "more": None,
        "shots": "lower the shots with --opt {measure}.{option}={value}",
        "batch": "pass another --batch-size (e.g. --batch-size {value})",
    },
    "model": {
        "measures": "--measures",
        "labels": "use data whose images have class labels (--set data.label_column=NAME)",
        "probe": "add probe-train images with --set data.probe_train_size=N",
        "probe_labels": "use data whose images have class labels (--set data.label_column=NAME)",
        "probe_images": "probe-train images (data.probe_train_size)",
        "more": "pass --set data.probe_train_size={total}",
        "shots": "lower the shots with --opt {measure}.{option}={value}",
        "batch": "pass another --batch-size (e.g. --batch-size {value})",
    },
    "images": {
        "measures": "--measures",
        "labels": "put the images of --images in one subfolder per class (DIR/<class>/...)",
        "probe": "give labelled images to train on with --probe-images DIR2 (the same class subfolders)",
        "probe_labels": "put the images of --probe-images in the same class subfolders",
        "probe_images": "--probe-images",
        "more": "give --probe-images at least {per_class} images per class",
        "shots": "lower the shots with --opt {measure}.{option}={value}",
        "batch": "pass another --batch-size (e.g. --batch-size {value})",
    },
    "api": {
        "measures": "measures=",
        "labels": "pass labels= for the images",
        "probe": "pass probe_images= and probe_labels= (a tensor [N, C, H, W] and its labels)",
        "probe_labels": "pass probe_labels= for the probe_images",
        "probe_images": "probe_images",
        "more": "pass probe_images= / probe_labels= with at least {per_class} images per class",
        "shots": "lower the shots with options={{'{measure}': {{'{option}': {value}}}}}",
        "batch": "pass another batch_size= (e.g. batch_size={value})",
    },
    "api_folder": {
        "measures": "measures=",
        "labels": "give images= a folder with one subfolder per class (DIR/<class>/...)",
        "probe": "pass probe_images= a folder of other images with the same class subfolders",
        "probe_labels": "give probe_images= the same class subfolders",
        "probe_images": "probe_images",
        "more": "pass a probe_images= folder with at least {per_class} images per class",
        "shots": "lower the shots with options={{'{measure}': {{'{option}': {value}}}}}",
        "batch": "pass another batch_size= (e.g. batch_size={value})",
    },
}

_WHAT = {
    "labels": "the images to analyse have no class labels",
    "probe_images": "there are no {probe_images} to train on",
    "probe_labels": "the {probe_images} have no class labels",
}


def _names(names: Sequence[str]) -> tuple[str, str, bool]:
    """('measure a' or 'measures a, b' (none: 'this measure'), 'it' or 'them', plural)."""
    if not names:
        return "this measure", "it", False
    plural = len(names) > 1
    return f"measure{'s' if plural else ''} {', '.join(names)}", "them" if plural else "it", plural


def sentence(problem: Problem, front: str, names: Sequence[str], skipped: bool = False) -> str:
    """The one sentence for ``problem`` of the measures ``names`` in the words of ``front`` (a key of
    :data:`VOCAB`): what is missing and how to give it, or else to leave the measures out. ``skipped``: the reason
    after "skipped <names>: " (subject "it"/"they", no "leave it out")."""
    v = VOCAB[front]
    subject, obj, plural = _names(names)
    if skipped:
        subject = "they" if plural else "it"
    leave = "" if skipped else f"leave {obj} out of {v['measures']}"
    if isinstance(problem, str):
        return problem if skipped else f"{subject}: {problem}"
    if isinstance(problem, BatchSizes):
        return _batch(problem, v)
    if isinstance(problem, TooFewShots):
        p = problem
        value = p.rarest // 2
        fixes = [
            f.format(
                total=2 * p.shots * p.num_classes,
                per_class=2 * p.shots,
                measure=p.measure,
                option=p.option,
                value=value,
            )
            for f in (v["more"], v["shots"] if value >= 1 else None)
            if f
        ]
        fix = " or ".join(fixes)
        tail = f"{fix}, or {leave}" if fix and leave else fix or leave or "it cannot run on these images"
        return (
            f"{subject} {'draw' if plural else 'draws'} {p.shots} shots per class from half of the "
            f"{v['probe_images']}, whose rarest class has {p.rarest} image{'' if p.rarest == 1 else 's'}: {tail}."
        )
    pieces = [x for x in PIECES if x in problem.pieces]
    what = "; ".join(_WHAT[x].format(probe_images=v["probe_images"]) for x in pieces)
    fixes = []
    for x in pieces:
        f = v["probe" if x == "probe_images" else x]
        if f not in fixes:
            fixes.append(f)
    fix = " and ".join(fixes)
    return (
        f"{subject} {'read' if plural else 'reads'} class labels, and {what}: {fix}{f', or {leave}' if leave else ''}."
    )


def _batch(p: BatchSizes, v: dict) -> str:
    if p.n_images < 4:
        return f"there are {p.n_images} analysis images; minibatch CKA needs at least 4: give more images."
    if p.batch_size < 4:
        head = f"the analysis batch size is {p.batch_size}; minibatch CKA needs at least 4"
    else:
        head = (
            f"{p.n_images} analysis images in minibatches of {p.batch_size} leave a last minibatch of "
            f"{p.n_images % p.batch_size or p.n_images} images; minibatch CKA needs at least 4"
        )
    return f"{head}: {v['batch'].format(value=p.suggestion)}."


def first(problems: dict[str, Problem], front: str) -> str | None:
    """One sentence for the first of ``problems`` ({measure: problem}, in the order requested), naming every measure
    with the same problem (e.g. all that read labels the images lack); None when there is none."""
    if not problems:
        return None
    name, p = next(iter(problems.items()))
    same = [m for m, q in problems.items() if q == p] if not isinstance(p, str) else [name]
    return sentence(p, front, same)


def skip_lines(problems: dict[str, Problem], front: str) -> list[str]:
    """ "skipped <measures>: <reason>" for each group of measures with the same problem (``--measures all``)."""
    groups: dict = {}
    for m, p in problems.items():
        groups.setdefault(p if not isinstance(p, str) else (m, p), []).append(m)
    return [
        f"skipped {', '.join(ms)}: {sentence(k if not isinstance(k, tuple) else k[1], front, ms, skipped=True)}"
        for k, ms in groups.items()
    ]
