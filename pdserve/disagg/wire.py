"""Typed records <-> JSON for everything that crosses a process boundary. No pickle: a peer can
only ever make us build the dataclasses named here, with fields of the declared types.

Supported field types: str, int, bool, float (finite), bytes (base64 text), tuple[int, ...],
tuple[float, ...], nested records, and `X | None` of these (null). Decoding is strict: exactly the
declared keys, exactly the declared types (a bool is not an int; an int is a float). The one
leniency: a field with a default may be absent (a peer from before the field was added) and takes
its default.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import math
import types
import typing
from typing import Any, TypeVar

R = TypeVar("R")


class WireFormatError(ValueError):
    """A peer sent JSON that does not decode into the expected record."""


def to_json_obj(record: object) -> dict[str, Any]:
    return {name: _encode(getattr(record, name)) for name in _hints(type(record))}


def from_json_obj(cls: type[R], obj: object) -> R:
    hints = _hints(cls)
    if not isinstance(obj, dict) or not _REQUIRED[cls] <= obj.keys() <= hints.keys():
        got = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
        raise WireFormatError(f"{cls.__name__}: expected keys {sorted(hints)}, got {got}")
    fields = {name: _decode(hint, obj[name], f"{cls.__name__}.{name}") for name, hint in hints.items() if name in obj}
    try:
        return cls(**fields)
    except (TypeError, ValueError) as e:  # the record's own checks (__post_init__) refused it
        raise WireFormatError(f"{cls.__name__}: {e}") from e


def dumps(record: object) -> bytes:
    return json.dumps(to_json_obj(record), separators=(",", ":")).encode()


def loads(cls: type[R], data: bytes | str) -> R:
    try:
        obj = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise WireFormatError(f"{cls.__name__}: not JSON ({e})") from e
    return from_json_obj(cls, obj)


_HINTS: dict[type, dict[str, Any]] = {}
_REQUIRED: dict[type, set[str]] = {}  # the fields without a default: never absent


_INT_TUPLES: set[Any] = set()  # the tuple[int, ...] hints met so far (hashable typing objects)


def _hints(cls: type) -> dict[str, Any]:
    """Field name -> resolved type, per record class (resolved once: annotations are strings)."""
    if cls not in _HINTS:
        if not dataclasses.is_dataclass(cls):
            raise TypeError(f"{cls.__name__} is not a dataclass")
        hints = typing.get_type_hints(cls)
        _HINTS[cls] = {f.name: hints[f.name] for f in dataclasses.fields(cls)}
        _REQUIRED[cls] = {f.name for f in dataclasses.fields(cls)
                          if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
        _INT_TUPLES.update(h for h in _HINTS[cls].values() if typing.get_args(h) == (int, Ellipsis))
    return _HINTS[cls]


def _encode(value: object) -> object:
    if isinstance(value, bytes):
        return base64.b64encode(value).decode("ascii")
    if isinstance(value, tuple):
        return list(value)
    if dataclasses.is_dataclass(value):
        return to_json_obj(value)
    return value


def _decode(hint: Any, value: object, where: str) -> object:
    optional = _optional_of(hint)
    if optional is not None:
        return None if value is None else _decode(optional, value, where)
    if hint in (float, bytes, str, int, bool):
        return _decode_scalar(hint, value, where)
    if hint == tuple[float, ...] or hint in _INT_TUPLES:
        return _decode_tuple(hint, value, where)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return from_json_obj(hint, value)
    raise TypeError(f"{where}: unsupported field type {hint!r}")


def _decode_scalar(hint: type, value: object, where: str) -> object:
    if hint is float:
        return _decode_float(value, where)
    if hint is bytes:
        return _decode_bytes(value, where)
    # NOTE: exact type check: json gives bool for true/false, and bool is a subclass of int.
    if type(value) is not hint:
        raise WireFormatError(f"{where}: expected {hint.__name__}, got {type(value).__name__}")
    return value


def _decode_tuple(hint: Any, value: object, where: str) -> tuple[object, ...]:
    """`tuple[float, ...]` or a `tuple[int, ...]` hint."""
    if hint == tuple[float, ...]:
        if not isinstance(value, list):
            raise WireFormatError(f"{where}: expected a list of numbers")
        return tuple(_decode_float(item, where) for item in value)
    # NOTE: set(map(type, ...)) runs in C: a KV header's 256-block list is checked in ~5 us
    if not isinstance(value, list) or not set(map(type, value)) <= {int}:
        raise WireFormatError(f"{where}: expected a list of int")
    return tuple(value)


def _optional_of(hint: Any) -> Any:
    """X for a hint `X | None`, else None."""
    if typing.get_origin(hint) not in (typing.Union, types.UnionType):
        return None
    others = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    if len(others) != 1 or len(typing.get_args(hint)) != 2:
        raise TypeError(f"unsupported union {hint!r}: only X | None")
    return others[0]


def _decode_float(value: object, where: str) -> float:
    # NOTE: json gives an int for a whole number written without a point; bool is not a number here
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise WireFormatError(f"{where}: expected a finite number, got {value!r}")
    return float(value)


def _decode_bytes(value: object, where: str) -> bytes:
    if not isinstance(value, str):
        raise WireFormatError(f"{where}: expected base64 text, got {type(value).__name__}")
    try:
        return base64.b64decode(value, validate=True)
    except binascii.Error as e:
        raise WireFormatError(f"{where}: invalid base64 ({e})") from e
