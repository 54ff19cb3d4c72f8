"""One coercion engine for the values users write: recipe keys (``train/recipe.py``, every section, intervention and
objective) and measure options (``analysis/engine/measure.py``, from a recipe, ``--opt`` or Python).

A value is checked against the type annotation of its dataclass field, the same way wherever it comes from:

- ``bool``, ``int`` (not a bool), ``str``, ``dict``: as they are; ``float``: an int or float, or a string that
  reads as a finite number (YAML 1.1, which ``--opt`` values are parsed with, reads ``1e-3`` as a string);
- ``Literal[...]``: one of the choices (YAML 1.1 reads ``true`` / ``on`` / ``yes`` as a bool: it matches the
  choice spelled that way, e.g. ``data.in_memory: true``);
- ``X | None``: null, or X (with X's own message); ``X | Y``: the first that fits;
- ``list[X]``: a list, each item an X (one mapping where a list of sections is expected is a list of one);
- ``tuple[X, ...]``: a list, or one X, as a tuple of X;
- a dataclass (a recipe section): a mapping, built by the caller's ``build``; the dataclass may define
  ``from_recipe(value)`` to accept a shorthand (a callback given by its name alone).

A value that does not fit raises ``error`` (the caller's one-sentence error class: RecipeError, MeasureError) with
``<noun> '<key>' must be <what the type allows>, got <value>.``; a type the engine does not know is a bug in the
schema (TypeError), not in the user's input.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from collections.abc import Callable
from typing import Any, Literal, Union

# type -> accepted Python types
_SCALARS: dict[type, tuple[type, ...]] = {bool: (bool,), int: (int,), float: (int, float), str: (str,), dict: (dict,)}
_NAMES = {
    bool: ("true or false", "true/false values"),
    int: ("an integer", "integers"),
    float: ("a number", "numbers"),
    str: ("a string", "strings"),
    dict: ("a mapping", "mappings"),
}
_YAML_BOOL_WORDS = {False: {"no", "off", "false"}, True: {"yes", "on", "true"}}  # YAML 1.1 reads these as booleans
_NUMBER = re.compile(r"^[-+]?(?:\d[\d_]*)?(?:\.\d*)?(?:[eE][-+]?\d+)?$")

Build = Callable[[type, dict, str], Any]


def did_you_mean(word: str, choices, prefix: str = "") -> str:
    """`` (did you mean PREFIX+X?)`` for the closest of ``choices`` to a mistyped ``word`` (difflib), or ``''``: the
    one hint for a mistyped recipe key, measure, option or flag."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {prefix}{close[0]}?)" if close else ""


def type_name(tp, plural: bool = False) -> str:
    """What values of ``tp`` look like, in words ("an integer", "a list of numbers", "one of 'cls', 'gap'")."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (Union, types.UnionType):
        return " or ".join(type_name(a, plural) for a in args)
    if origin in (list, tuple):
        return f"{'lists' if plural else 'a list'} of {type_name(args[0], plural=True)}" if args else "a list"
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "mappings" if plural else "a mapping"
    return _NAMES[tp][plural] if tp in _NAMES else getattr(tp, "__name__", str(tp))


def shown(value) -> str:
    """``repr(value)``, shortened to 80 characters (a 5000-digit override is named by its length)."""
    s = repr(value)
    return s if len(s) <= 80 else f"{s[:60]}... ({len(s)} characters)"


class _Spec(typing.NamedTuple):
    noun: str
    error: type[Exception]
    build: Build | None

    def at(self, key: str) -> str:
        return f"{self.noun} '{key}'"


_MISS = object()  # a rule's "does not fit": the engine then raises the one sentence


def _union(value, tp, key, spec):
    args = typing.get_args(tp)
    if value is None and type(None) in args:
        return None
    real = [a for a in args if a is not type(None)]
    if len(real) == 1:  # Optional[X]: X's own, more precise message
        return _coerce(value, real[0], key, spec)
    for a in real:
        try:
            return _coerce(value, a, key, spec)
        except spec.error:
            pass
    return _MISS


def _literal(value, tp, key, spec):
    args = typing.get_args(tp)
    if isinstance(value, bool):
        value = next((a for a in args if str(a).lower() in _YAML_BOOL_WORDS[value]), value)
    return value if value in args and not isinstance(value, bool) else _MISS


def _list(value, tp, key, spec):
    item = (typing.get_args(tp) or (Any,))[0]
    if isinstance(value, dict) and dataclasses.is_dataclass(item):
        value = [value]  # one mapping where a list of them is expected
    if not isinstance(value, list):
        return _MISS
    return [_coerce(v, item, f"{key}[{i}]", spec) for i, v in enumerate(value)]


def _tuple(value, tp, key, spec):
    items = value if isinstance(value, (list, tuple)) else [value]
    args = typing.get_args(tp)
    if len(args) == 2 and args[1] is Ellipsis:
        return tuple(_coerce(v, args[0], f"{key}[{i}]", spec) for i, v in enumerate(items))
    return tuple(items)


def _section(value, tp, key, spec):
    value = tp.from_recipe(value) if hasattr(tp, "from_recipe") else value
    return spec.build(tp, value, key) if isinstance(value, dict) and spec.build is not None else _MISS


def _scalar(value, tp, key, spec):
    if tp is float and isinstance(value, str) and _NUMBER.match(value.strip()) and any(c.isdigit() for c in value):
        number = float(value)
        value = number if math.isfinite(number) else value
    if isinstance(value, _SCALARS[tp]) and (tp is bool or not isinstance(value, bool)):
        return float(value) if tp is float else value
    return _MISS


def _rule(tp):
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return _union
    if origin is Literal:
        return _literal
    if origin is list or tp is list:
        return _list
    if origin is tuple or tp is tuple:
        return _tuple
    if dataclasses.is_dataclass(tp):
        return _section
    if tp in _SCALARS:
        return _scalar
    if tp is Any:
        return lambda value, *_: value
    return None


def _coerce(value, tp, key: str, spec: _Spec):
    rule = _rule(tp)
    if rule is None:
        raise TypeError(f"unsupported schema type {tp} for {key}")  # a bug in the schema, not in the input
    out = rule(value, tp, key, spec)
    if out is _MISS:
        raise spec.error(f"{spec.at(key)} must be {type_name(tp)}, got {shown(value)}.")
    return out


def coerce(value, tp, key: str, error: type[Exception], noun: str = "key", build: Build | None = None):
    """``value`` checked against the annotation ``tp`` and converted (see the module docstring); ``key`` names it
    in the error (``noun 'key'``: ``key 'train.steps'``, ``option 'knn.k'``); ``build(cls, mapping, key)`` builds a
    nested dataclass. Raises ``error`` with one sentence when the value does not fit."""
    return _coerce(value, tp, key, _Spec(noun, error, build))
