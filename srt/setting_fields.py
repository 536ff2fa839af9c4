"""Settings fields: each carries its help and what it accepts (a type, choices, a range), so
the same check runs for `Engine(**kwargs)` and for the command line, whose flags are generated
from the fields (server_flags.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any, ClassVar


def setting(default: Any, help: str, *, choices: tuple[Any, ...] | None = None, refusal: str | None = None,
            min: float | None = None, max: float | None = None, above: float | None = None,
            below: float | None = None, env: str | None = None) -> Any:
    """A settings field: its default, one line of help for --help (which adds the default), and
    what it accepts: `choices` (`refusal` says what follows a value outside them), a closed range
    [min, max] or an open one (above, below). `env`: an environment variable the command line
    falls back to (the help says so)."""
    meta = {"help": help, "choices": choices, "refusal": refusal, "min": min, "max": max, "above": above,
            "below": below, "env": env}
    return field(default=default, metadata=meta)


def kind_of(f: dataclasses.Field) -> type:
    """The field's value type from its annotation ("int | None" -> int; "tuple[str, ...]": a
    list of strings, several values after its flag)."""
    return {"int": int, "float": float, "bool": bool, "str": str,
            "tuple[str, ...]": tuple}[str(f.type).split(" |")[0]]


def check_value(f: dataclasses.Field, value: Any) -> Any:
    """`value` for field `f`, checked against its type, choices and range; raises ValueError
    with the reason (without the field's name, which the caller adds)."""
    if value is None:
        if f.default is not None:
            raise ValueError("must not be null")
        return None
    kind, meta = kind_of(f), f.metadata
    if kind is tuple:
        if isinstance(value, str):
            value = value.split()
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
            raise ValueError("must be a list of strings")
        return tuple(value)
    if kind is bool:
        if not isinstance(value, bool):
            raise ValueError("must be true or false")
        return value
    if kind in (int, float):
        integral = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not integral):
            raise ValueError(f"must be {'an integer' if kind is int else 'a number'}")
        value = kind(value)
        if meta["min"] is not None and value < meta["min"]:
            raise ValueError(f"must be >= {meta['min']}" if meta["max"] is None
                             else f"must be between {meta['min']} and {meta['max']}")
        if meta["max"] is not None and value > meta["max"]:
            raise ValueError(f"must be between {meta['min']} and {meta['max']}" if meta["min"] is not None
                             else f"must be <= {meta['max']}")
        if meta["above"] is not None and value <= meta["above"]:
            raise ValueError(f"must be > {meta['above']}" if meta["below"] is None
                             else f"must be between {meta['above']} and {meta['below']} (exclusive)")
        if meta["below"] is not None and value >= meta["below"]:
            raise ValueError(f"must be < {meta['below']}" if meta["above"] is None
                             else f"must be between {meta['above']} and {meta['below']} (exclusive)")
        return value
    if not isinstance(value, str):
        raise ValueError("must be a string")
    if meta["choices"] is not None and value not in meta["choices"]:
        if meta["refusal"]:
            raise ValueError(f"{value!r} {meta['refusal']}")
        raise ValueError(f"must be one of {', '.join(meta['choices'])} (got {value!r})")
    return value


class Section:
    """A group of settings. Subclasses are frozen dataclasses of `setting(...)` fields; each
    value is checked as the section is made, then the section's own cross-field checks run."""

    ALIASES: ClassVar[dict[str, dict[str, str]]] = {}  # field -> accepted spelling -> canonical value

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            try:
                object.__setattr__(self, f.name, self.accept(f, getattr(self, f.name)))
            except ValueError as e:
                raise ValueError(f"{f.name}: {e}") from None
        self.check()

    @classmethod
    def accept(cls, f: dataclasses.Field, value: Any) -> Any:
        """`value` for field `f`, its accepted spellings normalised, checked (ValueError)."""
        if isinstance(value, str) and f.name in cls.ALIASES:
            value = cls.ALIASES[f.name].get(value.lower(), value)
        return check_value(f, value)

    @classmethod
    def parse(cls, f: dataclasses.Field, text: str) -> Any:
        """A command-line value for field `f` (a string) as its type, checked (ValueError)."""
        kind = kind_of(f)
        if kind in (int, float):
            try:
                value = kind(text)
            except ValueError:
                raise ValueError(f"must be {'an integer' if kind is int else 'a number'} (got {text!r})") from None
            return cls.accept(f, value)
        return cls.accept(f, text)

    def check(self) -> None:
        """Checks between fields of the section; raises ValueError naming the field."""
