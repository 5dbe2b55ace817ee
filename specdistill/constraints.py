"""Constraints carried by config dataclass fields, and the one check derived from them.

Knows nothing about Hydra, models or tensors. A field states its legal values where it is defined:

    num_layers: int = bounded(2, ">= 1")                  # ranges: ">= 1", "> 0", "<= 8", "[0, 1]", "(0, 1]", "[0, 1)"
    coverage: Optional[float] = bounded(0.9, "(0, 1]")    # Optional[...]: null is legal too
    betas: list[float] = bounded(range="[0, 1)", default_factory=lambda: [0.9, 0.95])  # each element checked
    off_trajectory: str = one_of("branch", ("branch", "drop"))

`rules(cls)` reads them back (nested config dataclasses included, by dotted key); `Rule.errors` names every bad
value with its key, the legal range and the default. validation.py checks a composed config against the schema's
rules before anything loads; dataclasses built in code (objectives, EvalConfig) call `check_fields` on themselves.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import re
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

_NUMBER = r"([-+]?(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?)"
_BOUND = re.compile(rf"^(>=|>|<=|<)\s*{_NUMBER}$")
_INTERVAL = re.compile(rf"^([\[(])\s*{_NUMBER}\s*,\s*{_NUMBER}\s*([\])])$")


@dataclass(frozen=True)
class Range:
    lo: Optional[float] = None  # None: unbounded
    hi: Optional[float] = None
    lo_open: bool = False  # True: lo itself is not allowed (lr > 0)
    hi_open: bool = False

    @classmethod
    def parse(cls, text: str) -> "Range":
        """'>= 1' | '> 0' | '<= 8' | '< 1' | '[0, 1]' | '(0, 1]' | '[0, 1)' | '(0, 1)' -> Range."""
        s = text.strip()
        if m := _BOUND.match(s):
            op, v = m.group(1), float(m.group(2))
            return cls(lo=v, lo_open=op == ">") if op.startswith(">") else cls(hi=v, hi_open=op == "<")
        if m := _INTERVAL.match(s):
            return cls(float(m.group(2)), float(m.group(3)), lo_open=m.group(1) == "(", hi_open=m.group(4) == ")")
        raise ValueError(f"range {text!r}: write '>= 1', '> 0', '<= 8', '[0, 1]', '(0, 1]' or '[0, 1)'")

    def why_not(self, v) -> Optional[str]:
        """None when `v` is a number inside the range, else what it must be."""
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return f"must be a number (got {v!r})"
        if isinstance(v, float) and math.isnan(v):
            return "must be a number (got nan)"
        if ((self.lo is not None and (v < self.lo or (self.lo_open and v == self.lo)))
                or (self.hi is not None and (v > self.hi or (self.hi_open and v == self.hi)))):
            return self.describe()
        return None

    def describe(self) -> str:
        parts = []
        if self.lo is not None:
            parts.append(f"{'>' if self.lo_open else '>='} {self.lo:g}")
        if self.hi is not None:
            parts.append(f"{'<' if self.hi_open else '<='} {self.hi:g}")
        return "must be " + " and ".join(parts)


def bounded(default: Any = dataclasses.MISSING, range: str = "", *, default_factory: Any = dataclasses.MISSING):
    """A dataclass field whose value (each element, for a list) must lie in `range` (Range.parse's syntax)."""
    return dataclasses.field(default=default, default_factory=default_factory, metadata={"range": Range.parse(range)})


def one_of(default: Any, choices: tuple) -> Any:
    """A dataclass field whose value must be one of `choices`."""
    return dataclasses.field(default=default, metadata={"choices": tuple(choices)})


@dataclass(frozen=True)
class Rule:
    """The constraint of one field: a range or a set of choices, whether null is legal, and its default (the hint)."""
    range: Optional[Range] = None
    choices: Optional[tuple] = None
    nullable: bool = False
    default: Any = None

    def errors(self, key: str, value: Any) -> list[str]:
        """One line per bad value (`key[i]` for a list element), naming the key, what it must be and the default."""
        listed = isinstance(value, Sequence) and not isinstance(value, str)
        items = list(enumerate(value)) if listed else [(None, value)]
        out = []
        for i, v in items:
            why = self._why_not(v)
            if why:
                hint = f" (the default is {key}={self.default!r})" if self.default is not None else ""
                out.append(f"{key}{'' if i is None else f'[{i}]'}={v!r} {why}{hint}")
        return out

    def _why_not(self, v) -> Optional[str]:
        if v is None:
            return None if self.nullable else "must be set (got null)"
        if self.choices is not None and v not in self.choices:
            return f"must be one of {self.choices}"
        why = self.range.why_not(v) if self.range is not None else None
        return why and why + (" (or null)" if self.nullable else "")


def _nullable(hint) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in typing.get_args(hint)


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


@functools.cache
def rules(cls: type) -> dict[str, Rule]:
    """Dotted key -> Rule for every constrained field of the dataclass `cls`, nested config dataclasses included
    (`draft.moe.coverage`)."""
    hints = typing.get_type_hints(cls)
    out: dict[str, Rule] = {}
    for f in dataclasses.fields(cls):
        nested = f.default_factory if f.default_factory is not dataclasses.MISSING else None
        if isinstance(nested, type) and dataclasses.is_dataclass(nested):
            out.update({f"{f.name}.{k}": r for k, r in rules(nested).items()})
        elif "range" in f.metadata or "choices" in f.metadata:
            default = _default(f)
            out[f.name] = Rule(f.metadata.get("range"), f.metadata.get("choices"), _nullable(hints[f.name]),
                               None if default is dataclasses.MISSING or str(default) == "???" else default)
    return out


def field_errors(obj: Any, prefix: str = "", cls: Optional[type] = None) -> list[str]:
    """Every value of `obj` (an instance of the dataclass `cls`, by default its own type) outside its field's
    constraint, keys as `<prefix>.<field>` (or `<field>` without a prefix)."""
    errors = []
    for key, rule in rules(cls or type(obj)).items():
        value = obj
        for part in key.split("."):
            value = getattr(value, part)
        errors.extend(rule.errors(f"{prefix}.{key}" if prefix else key, value))
    return errors


def check_fields(obj: Any, prefix: str) -> None:
    """Raise ValueError listing every value of `obj` outside its field's constraint (see field_errors)."""
    errors = field_errors(obj, prefix)
    if errors:
        raise ValueError(f"bad {prefix} settings: " + "; ".join(errors))
