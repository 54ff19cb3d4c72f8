"""Each paper's study as a plug-in: one folder per paper, found by its name.

A paper is a subpackage of this package (or a module published under the ``vitlab.studies`` entry-point group by another
package) that defines ``PAPER``, an :class:`analysis.studies.claims.Paper`: its claims (each declared once, its text
beside the code that computes it), the sections its report shows before the claims, and the defaults a study file of
that paper gets. Nothing outside the folder names the paper: ``./launch.sh study FILE`` finds it by the study file's
``paper:`` key (or its ``study:`` name), and adding a paper is adding a folder.
"""

from __future__ import annotations

import difflib

from analysis.studies.claims import Paper
from vitlab.plugins import Registry

__all__ = ["Paper", "paper", "paper_for", "papers"]

GROUP = "vitlab.studies"


def _is_paper(mod) -> bool:
    p = getattr(mod, "PAPER", None)
    if not isinstance(p, Paper):
        raise TypeError(f"study plug-in {mod.__name__} defines no PAPER (an analysis.studies.claims.Paper)")
    return True


PAPERS = Registry("paper", __name__, group=GROUP, module_plugin=_is_paper, folders=True)


def papers(refresh: bool = False) -> dict[str, Paper]:
    """Every paper plug-in: the subpackages of analysis/studies/ and the ``vitlab.studies`` entry points, by their
    ``PAPER.name``."""
    found: dict[str, Paper] = {}
    for name, obj in (PAPERS.refresh() if refresh else PAPERS).items().items():
        p = obj if isinstance(obj, Paper) else getattr(obj, "PAPER", None)
        if not isinstance(p, Paper):
            raise TypeError(f"study plug-in {name} defines no PAPER (an analysis.studies.claims.Paper)")
        if p.name in found:
            raise ValueError(f"two study plug-ins are called {p.name!r} ({name} and another); names must be unique")
        found[p.name] = p
    return found


def paper(name: str) -> Paper:
    """The plug-in of paper ``name``; KeyError naming the papers there are (and the nearest one)."""
    ps = papers()
    if name not in ps:
        near = difflib.get_close_matches(name, ps, n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise KeyError(f"no study plug-in is called {name!r}{hint}; the papers are {', '.join(sorted(ps))}")
    return ps[name]


def paper_for(study, configs: dict) -> Paper | None:
    """The paper that judges ``study``: its ``paper`` key, else its name when a paper has it, else the first paper
    whose ``applies`` accepts its configurations, else None."""
    ps = papers()
    name = getattr(study, "paper", None)
    if name:
        return paper(name)
    if study.name in ps:
        return ps[study.name]
    for p in ps.values():
        if p.applies(configs):
            return p
    return None
