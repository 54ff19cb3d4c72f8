"""A study's results bundle: the compact numbers its report reads, committed so that anyone can re-judge it.

The bundle is exactly the files the report stage reads (or writes, for a report-time result it caches) under the
study's root, minus weights: per run its ``recipe.yaml``, every checkpoint's ``meta.json``, and the analysis results
the report opened (``summary.json``, ``cache.json``, the ``<measure>.npz`` arrays), the study's cached report-time
results (``registers_control.json``, ``walmer/controls.json``, ``baselines/cka_floors.npz``, cross-run CKA, ...),
``study_times.json``, the figures the report shows (a drawing written at report time and not shown is left out) and
whatever else a paper plug-in opens (``result.json``, TensorBoard event files). Which files those are is not listed
anywhere: while :func:`write_report <analysis.studies.study_report.write_report>` runs from the runs, a Python audit
hook (PEP 578, events ``open`` and ``os.rename``) records every file opened under the root, so a plug-in that reads one
more file puts it in the bundle without saying so. Weights, optimizer and random states (:data:`WEIGHTS`) are never
copied: a number the report needs from a model must be a cached report-time result, and the analysis code reads those
without the model or the images (the data fingerprints come from the manifest; analysis/frontends/runner.py reads a
checkpoint without weights from its cache).

Layout, beside the report it regenerates and named after it (``<report folder>/bundles/<report name>/``:
``docs/bundles/reproduction/`` for ``docs/reproduction.md``, so two reports in one folder keep two bundles): the files
at their paths relative to the study's root, and ``manifest.json``: the study, its file, the report, the git commit and
date it was written at, the data fingerprint of every run (so cached report-time results are found without the
images) and every file's size and sha256.

A report from a bundle (``./launch.sh study FILE --stage report`` when no run of the study is there, or
``--from-bundle [DIR]``) checks every file against the manifest, then reads a scratch copy of the bundle as the
study's root: the bundle itself is never written, the audit hook refuses any write there but a drawing (a report-time
cache must be a hit), and a report that needs a file the bundle lacks stops with one sentence naming it.

A report that is no study uses the same functions with an object that looks like one (``root``, ``report``,
``committed``, ``name``, ``path``, ``runs`` = {} and a ``bundle`` slot, plus ``rerun``: the command that writes it from
its runs, and ``reread``: the option that reads the bundle): the real-ViT report (analysis/studies/real_vit/report.py
``Target``), whose root is one external model's analysis folder and whose manifest also records the weights'
identity and the images' fingerprint (``write``'s ``extra``), which key its cached results.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from analysis.results.storage import shown
from train.checkpoint import sha256_file

MANIFEST = "manifest.json"
# never in a bundle: a checkpoint's weights, optimizer and random states (train/checkpoint.py), any other weight file
WEIGHTS = (".safetensors", ".pt", ".pth", ".bin", ".pkl", ".ckpt")
# what a report draws from its numbers under the root (a plug-in's figures, a comparison's page): kept in the bundle
# only when the report shows them (reads them), a report from a bundle may write these (into its scratch copy), and
# nothing else
DRAWN = (".png", ".svg", ".pdf", ".md", ".html", ".txt")


class BundleError(Exception):
    """A bundle that cannot regenerate its report (one sentence naming the file and what to do)."""


class _Watch:
    """The files opened under ``root``: recorded (``guard`` False), or, on a bundle, reads of missing files noted and
    writes refused (``guard`` True)."""

    def __init__(self, root: Path, guard: bool):
        self.root = str(Path(root).resolve()) + os.sep
        self.guard = guard
        self.read: set[str] = set()
        self.written: set[str] = set()
        self.missing: list[str] = []
        self.refused: list[str] = []

    def under(self, path) -> str | None:
        if path is None or isinstance(path, int):
            return None
        p = os.path.abspath(os.fsdecode(path))
        return p if p.startswith(self.root) else None

    def event(self, event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = (*args, None, None, None)[:3]
            p = self.under(path)
            if p is None or os.path.isdir(p):  # a folder: flock'd, or an anonymous temporary file (O_TMPFILE) in it
                return
            writes = any(c in (mode or "") for c in "wax+") or bool(
                (flags or 0) & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND)
            )
            if not writes:
                if self.guard and not os.path.exists(p):
                    self.missing.append(p)
                elif not self.guard:
                    self.read.add(p)
            else:
                self.wrote(p)
        elif event == "os.rename" and len(args) > 1:
            p = self.under(args[1])
            if p is not None:
                self.wrote(p)

    def wrote(self, p: str) -> None:
        """A file written under the root: recorded; on a bundle, refused unless a drawing (:data:`DRAWN`), since any
        other file written is a result the report computes, which the bundle should have held cached."""
        if self.guard and not p.endswith(DRAWN):
            self.refused.append(p)
            raise PermissionError(f"a report from a results bundle computes no result: it would write {p}")
        self.written.add(p)


_WATCH: _Watch | None = None  # the one active watch (a report at a time), else None: the hook does nothing
_HOOKED = False


def _hook(event: str, args: tuple) -> None:
    w = _WATCH
    if w is not None and event in ("open", "os.rename"):
        w.event(event, args)


@contextlib.contextmanager
def watching(root: Path, guard: bool = False):
    """Record the files opened under ``root`` while the block runs (``guard``: refuse writes there instead)."""
    global _WATCH, _HOOKED
    if not _HOOKED:  # an audit hook cannot be removed: installed once, idle outside a watch
        sys.addaudithook(_hook)
        _HOOKED = True
    w = _WATCH = _Watch(root, guard)
    try:
        yield w
    finally:
        _WATCH = None


@contextlib.contextmanager
def unwatched():
    """Record nothing while the block runs: a report-time result computed from other files, which the report then
    reads back (the result is what the bundle needs, not what it was computed from)."""
    global _WATCH
    w, _WATCH = _WATCH, None
    try:
        yield
    finally:
        _WATCH = w


def location(study, reading: bool = False) -> Path:
    """The study's bundle folder: beside the report this invocation writes (``<report folder>/bundles/<report
    name>/``); when ``reading`` and none is there, beside the study file's committed report (``docs/bundles/<its
    name>/``)."""
    report = study.report or study.root / "report.md"
    here = report.parent / "bundles" / report.stem
    if reading and not (here / MANIFEST).is_file() and study.committed is not None:
        return study.committed.parent / "bundles" / study.committed.stem
    return here


def has_runs(study) -> bool:
    """Whether any run folder of the study exists (a report then reads the runs, not a bundle)."""
    return any(r.run_dir.is_dir() for r in study.runs.values())


def _files(study, w: _Watch, outputs: list[Path]) -> list[Path]:
    """The files the report read or cached under the root, every run's recipe.yaml and every checkpoint's meta.json,
    minus weights and the report's own outputs (the report, its twin, its figures, bundles)."""
    from train.checkpoint import META

    root = study.root.resolve()
    found = {Path(p) for p in w.read | {p for p in w.written if not p.endswith(DRAWN)}}  # drawings: those shown
    found.add(root / "study_times.json")  # the analysis's and this report's wall time, written after the report
    for r in study.runs.values():
        found.add(r.run_dir.resolve() / "recipe.yaml")
        ck = r.run_dir / "checkpoints"
        found |= {m.resolve() for m in ck.glob(f"*/{META}")} if ck.is_dir() else set()
    outs = [o.resolve() for o in outputs]
    return sorted(
        p
        for p in found
        if p.is_file()
        and p.is_relative_to(root)
        and not p.name.endswith(WEIGHTS)
        and not p.name.startswith(".")  # temporary files of atomic writes
        and not any(p == o or p.is_relative_to(o) for o in outs)
    )


def _commit(outputs: list[Path] = ()) -> tuple[str, bool]:
    """The repository's commit and whether its tracked files other than ``outputs`` (the report just written, its
    twin, figures and bundles) differ from it ("unknown" outside a git checkout)."""
    from analysis.studies.study import ROOT

    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True)  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown", False
    outs = [Path(o).resolve() for o in outputs]
    changed = [(ROOT / line[3:].split(" -> ")[-1].strip('"')).resolve() for line in dirty.stdout.splitlines() if line]
    return head.stdout.strip(), any(not any(p == o or p.is_relative_to(o) for o in outs) for p in changed)


def write(study, w: _Watch, report: Path, fig_dir: Path, extra: dict | None = None) -> tuple[Path, dict]:
    """Write the bundle of the report just written from the runs (replacing an older one); its folder and manifest.
    ``extra``: more the report needs to know without its runs (a report over one external model: the weights'
    identity and the images' fingerprint its cached results are keyed by), recorded in the manifest."""
    from analysis.sources.models import FINGERPRINTS

    dest = location(study)
    root = study.root.resolve()
    outputs = [report, report.with_suffix(".json"), fig_dir, dest, report.parent / "bundles"]
    files = _files(study, w, outputs)
    if dest.exists():
        shutil.rmtree(dest)
    listing = {}
    for f in files:
        rel = f.relative_to(root).as_posix()
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, dest / rel)
        listing[rel] = {"bytes": f.stat().st_size, "sha256": sha256_file(f)}
    commit, dirty = _commit(outputs)
    runs = {r.run_dir.resolve(): r.name for r in study.runs.values()}
    manifest = {
        "study": study.name,
        "study_file": shown(study.path),
        "report": shown(report),
        "commit": commit,
        "dirty": dirty,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "fingerprints": {runs[Path(k)]: v[1] for k, v in sorted(FINGERPRINTS.items()) if Path(k) in runs},
        **(extra or {}),
        "bytes": sum(v["bytes"] for v in listing.values()),
        "files": listing,
    }
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return dest, manifest


def open_bundle(study, folder: Path):
    """``study`` reading the bundle in ``folder`` as its root (its report goes where it would have gone), with the
    manifest as ``study.bundle``; BundleError when the bundle is missing, incomplete or changed since written."""
    from analysis.sources.models import FINGERPRINTS
    from train.recipe import RecipeError, load_recipe

    folder = Path(folder).resolve()
    f = folder / MANIFEST
    if not f.is_file():
        raise BundleError(
            f"{folder} is no results bundle (no {MANIFEST}): run the study's report from its runs to write one, or "
            "pass the folder of one (docs/bundles/<report name>)."
        )
    manifest = json.loads(f.read_text())
    for rel, entry in manifest["files"].items():
        p = folder / rel
        if not p.is_file():
            raise BundleError(
                f"the results bundle {folder} lacks {rel}, which its manifest lists: restore it (git checkout), or "
                "rerun the study's report from its runs to write the bundle again."
            )
        if p.stat().st_size != entry["bytes"] or sha256_file(p) != entry["sha256"]:
            raise BundleError(
                f"{p} differs from what the bundle's manifest records: restore it (git checkout), or rerun the "
                "study's report from its runs to write the bundle again."
            )
    # the report reads a scratch copy: the bundle itself is never written, and the figures a plug-in draws again under
    # the root (DRAWN) go there
    scratch = tempfile.TemporaryDirectory(prefix=f"bundle-{study.name}-")
    root = Path(scratch.name) / "root"
    shutil.copytree(folder, root, ignore=shutil.ignore_patterns(MANIFEST))
    out = copy.copy(study)
    out.runs = {n: copy.copy(r) for n, r in study.runs.items()}
    out.root = root
    for r in out.runs.values():
        r.run_dir = root / r.name
    out.bundle = {**manifest, "folder": folder, "scratch": scratch}
    for name, fp in manifest.get("fingerprints", {}).items():
        try:
            data = repr(load_recipe(root / name / "recipe.yaml").data)
        except RecipeError:
            continue
        FINGERPRINTS[str((root / name).resolve())] = (data, fp)
    return out


def provenance(study) -> str:
    """How the report was made, for its first paragraph: from the saved runs, or from the bundle (its commit, date)."""
    b = study.bundle
    if not b:
        return "from the saved runs"
    commit = b["commit"][:10] + (" with uncommitted changes" if b.get("dirty") else "")
    return (
        f"with `{study.reread}` from the results bundle {shown(b['folder'])} alone (written from the saved runs at "
        f"commit {commit} on {b['date']}; no run folder read)"
    )


def failure(study, w: _Watch, e: Exception) -> BundleError:
    """The one sentence of a report from a bundle that stopped: the file the bundle lacks (or the result it would
    compute), else where it stopped (most likely a report-time result computed from weights or images, which a bundle
    holds only cached), and what to do."""
    root = study.root.resolve()
    if w.missing:
        what = f"lacks {Path(w.missing[0]).relative_to(root)}, which the report opens"
    elif w.refused:
        what = f"has no cached {Path(w.refused[0]).relative_to(root)}, which the report would compute and write"
    else:
        why = (str(e).replace(str(root) + os.sep, "").splitlines() or [type(e).__name__])[0].rstrip(".")
        what = f"does not hold what the report reads (it stopped at: {why})"
    return BundleError(
        f"the results bundle {shown(study.bundle['folder'])} {what}: rerun the report from its runs "
        f"({study.rerun}) to write a complete bundle."
    )
