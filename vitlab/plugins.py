"""One registry helper for every kind of plug-in: interventions, objectives and papers (one module each), measures,
callbacks and model families (one class each).

It lives in ``vitlab/``, below the three packages that use it (dependencies point one way: ``interventions/`` <-
``train/`` <- ``analysis/``; ``vitlab/`` imports none of them when loaded). A plug-in is found by its name, in this
order:

1. registered in this process (:meth:`Registry.add`, or the :meth:`Registry.register` decorator);
2. a module of the registry's package (``package``): every module not starting with ``_`` is imported on the first
   lookup; with ``module_plugin`` the module itself is the plug-in, named after its file, when the predicate accepts
   it (``interventions/no_skip.py`` is ``no_skip``), else its classes register themselves on import;
3. an entry point of the registry's ``group`` in an installed package (``name = "package.module:Class"``), loaded
   when first named;
4. ``package.module:Class`` given as the name itself, for a plug-in in the user's own code (with ``accepts``, the
   object must pass it).

Every failed lookup is one sentence raised as the caller's error class (RecipeError, MeasureError, ...).
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
import sys
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any


@functools.lru_cache(maxsize=64)
def _group_entry_points(group: str, path: tuple[str, ...]) -> dict:
    """{name: entry point} of an entry-point group, read once per ``sys.path`` (importlib.metadata reads every
    installed distribution on each call; docs/scaling.md has what that cost the suite). A package installed into the
    running process's path is seen by a new process (a changed ``sys.path`` reads again)."""
    return {ep.name: ep for ep in entry_points(group=group)}


class Registry:
    """Named plug-ins of one ``kind`` ("measure", "callback", ...; the word the error sentences use)."""

    def __init__(
        self,
        kind: str,
        package: str | None = None,
        group: str | None = None,
        module_plugin: Callable[[Any], bool] | None = None,
        accepts: Callable[[Any], str | None] | None = None,
        near: Callable[[str, list[str]], str] | None = None,
        folders: bool = False,
    ):
        self.kind, self.package, self.group = kind, package, group
        self.folders = folders  # only the package's subpackages are plug-ins (one folder each): its modules are not
        self.module_plugin = module_plugin
        self.accepts = accepts  # one sentence when an imported object is not a plug-in of this kind, else None
        # the closest name to a mistyped one, " (did you mean X?)" or "" (train.coerce.did_you_mean, given by the
        # registry's owner: this package imports nothing of train/)
        self.near = near
        self.known: dict[str, Any] = {}  # name -> plug-in, as found so far
        self._discovered = False
        self._found: set[str] = set()  # names found by discovery or entry points (forgotten by refresh)

    # ---------------------------------------------------------------- registering

    def add(self, name: str, obj: Any) -> Any:
        """Register ``obj`` under ``name``; a second, different object under a taken name is a bug (ValueError)."""
        old = self.known.get(name)
        if not name or (old is not None and getattr(old, "__qualname__", old) != getattr(obj, "__qualname__", obj)):
            raise ValueError(f"{self.kind} name {name!r} is empty or taken")
        self.known[name] = obj
        return obj

    def register(self, name: str) -> Callable:
        """Class decorator: register the class under ``name``."""
        return lambda obj: self.add(name, obj)

    # ---------------------------------------------------------------- finding

    def discover(self) -> Registry:
        """Import the package's modules (once; see the module docstring)."""
        if self._discovered or self.package is None:
            self._discovered = True
            return self
        self._discovered = True
        pkg = importlib.import_module(self.package)
        for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda i: i.name):
            if info.name.startswith("_") or (self.folders and not info.ispkg):
                continue
            mod = importlib.import_module(f"{self.package}.{info.name}")
            if self.module_plugin is not None and self.module_plugin(mod):
                self.known[info.name] = mod
                self._found.add(info.name)
        return self

    def refresh(self) -> Registry:
        """Forget what was found (the package's folders are looked at again on the next lookup)."""
        self.known = {k: v for k, v in self.known.items() if k not in self._found}
        self._found.clear()
        self._discovered = False
        return self

    def _entry_points(self) -> dict:
        return _group_entry_points(self.group, tuple(sys.path)) if self.group else {}

    def items(self, load: bool = True) -> dict[str, Any]:
        """Every plug-in known now, {name: object}, entry points loaded (with ``load``) or left out."""
        self.discover()
        if load:
            for name, ep in self._entry_points().items():
                if name not in self.known:
                    self._import_entry(name, ep)
        return self.known

    def names(self) -> list[str]:
        """Every name a lookup accepts without importing anything new (entry points by name)."""
        return sorted(set(self.discover().known) | set(self._entry_points()))

    def __contains__(self, name: str) -> bool:
        return name in self.discover().known or name in self._entry_points()

    def could_name(self, name: str) -> bool:
        """Whether ``name`` names a plug-in: a known name, or ``package.module:Class`` (imported when looked up)."""
        return name in self or (":" in name and all(name.partition(":")[::2]))

    def _import_entry(self, name: str, ep) -> Any:
        obj = ep.load()
        if not any(o is obj for o in self.known.values()):  # a class that registered itself on import keeps its name
            self.known[name] = obj
            self._found.add(name)
        return obj

    def get(self, name: str, error: type[Exception]) -> Any:
        """The plug-in named ``name``; ``error`` with one sentence when there is none or it cannot be imported."""
        self.discover()
        if name in self.known:
            return self.known[name]
        eps = self._entry_points()
        if name in eps:
            return self._import_entry(name, eps[name])
        if ":" not in name:
            raise error(
                f"unknown {self.kind} '{name}'{self.near(name, self.names()) if self.near else ''}: choose from "
                f"{', '.join(self.names())} (or give package.module:Class)."
            )
        mod, _, attr = name.partition(":")
        try:
            obj = getattr(importlib.import_module(mod), attr)
        except (ImportError, AttributeError) as e:
            raise error(
                f"{self.kind} '{name}' cannot be imported ({e}): give an importable package.module:Class."
            ) from None
        problem = self.accepts(obj) if self.accepts is not None else None
        if problem:
            raise error(f"'{name}' is not {problem}.")
        return obj


def deferred(module: str, part: str) -> Callable[[str], Any]:
    """A plug-in module's ``__getattr__`` (PEP 562) that finds the names it does not define in the module ``part``,
    imported when one is first asked for. Discovery imports every plug-in module to read its recipe schema
    (``Config``, ``check``), so a plug-in whose code needs torch or timm keeps that code in ``part`` and stays
    importable without them: a bad recipe is refused in well under a second, not after seconds of imports."""

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):  # the import system's probes (__path__, ...) must not load the part
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        found = importlib.import_module(part)
        if not hasattr(found, name):
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        return getattr(found, name)

    return __getattr__
