"""Command-line flags generated from the frozen config dataclasses in config.py, so `pdserve serve`,
`router` and `up` (and anything that launches them) share one list of names, defaults and help.

A field `max_queued_requests: int = knob(512, "help")` becomes `--max-queued-requests` (int, default
512, that help). Types map as: `X | None` -> X; `Literal[...]` -> choices; `bool` -> `--x/--no-x`;
`tuple[X, ...]` -> one or more values, the flag repeatable; a field whose type is itself a config dataclass (`queue:
QueueArgs`) contributes that class's flags, unprefixed.

    add_config_args(parser, RouterConfig)          # the flags
    config_from_args(RouterConfig, ns)             # the parsed namespace -> a RouterConfig
    to_argv(config)                                # a RouterConfig -> the flags that rebuild it
"""

from __future__ import annotations

import argparse
import dataclasses
import types
from collections.abc import Collection
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

T = TypeVar("T")


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def _fields(cls: type[Any], only: Collection[str] | None = None,
            exclude: Collection[str] = ()) -> list[tuple[dataclasses.Field[Any], Any]]:
    """(field, resolved type) of `cls`'s fields, optionally selected by name."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    unknown = {*(only or ()), *exclude} - {f.name for f in dataclasses.fields(cls)}
    if unknown:
        raise ValueError(f"{cls.__name__} has no field(s) {sorted(unknown)}")
    hints = get_type_hints(cls)  # NOTE: resolves the string annotations of `from __future__ import annotations`
    return [(f, hints[f.name]) for f in dataclasses.fields(cls)
            if (only is None or f.name in only) and f.name not in exclude]


def _is_config(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _strip_none(tp: Any) -> Any:
    """`X | None` -> X. A union of several types becomes str when str is one of them (e.g.
    `str | int`: sizes like '2GiB' or 1024, which the config parses itself)."""
    if get_origin(tp) not in (Union, types.UnionType):
        return tp
    members = [arg for arg in get_args(tp) if arg is not type(None)]
    if len(members) == 1:
        return members[0]
    if str in members:
        return str
    raise TypeError(f"no flag type for {tp}")


class _Repeatable(argparse.Action):
    """A tuple field's flag: `--decode A B` and `--decode A --decode B` both give (A, B); the first
    use replaces the field's default rather than adding to it."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        current = getattr(namespace, self.dest, None)
        earlier = () if current is None or current is self.default else tuple(current)
        setattr(namespace, self.dest, earlier + tuple(values))


def _argparse_kwargs(tp: Any) -> dict[str, Any]:
    """How argparse reads a value of type `tp` (strings need no `type`)."""
    tp = _strip_none(tp)
    if tp is bool:
        return {"action": argparse.BooleanOptionalAction}
    if get_origin(tp) is Literal:
        choices = get_args(tp)
        return {"choices": choices} if all(isinstance(c, str) for c in choices) else \
            {"choices": choices, "type": type(choices[0])}
    if get_origin(tp) is tuple:
        item = get_args(tp)[0]
        return {"nargs": "+", "action": _Repeatable} | ({} if item is str else {"type": item})
    if tp in (int, float):
        return {"type": tp}
    if tp is str:
        return {}
    raise TypeError(f"no flag type for {tp}")


def add_config_args(parser: argparse.ArgumentParser, cls: type[Any], *, title: str | None = None,
                    only: Collection[str] | None = None, exclude: Collection[str] = (),
                    required: Collection[str] = ()) -> None:
    """One flag per field of `cls` (`only` / `exclude` select fields by name), in an argument group
    titled `title` (default: the class name); a nested config's fields get a group of their own."""
    group = parser.add_argument_group(title or cls.__name__, (cls.__doc__ or "").strip() or None)
    for field, tp in _fields(cls, only, exclude):
        if _is_config(tp):
            add_config_args(parser, tp, title=field.name)
            continue
        kwargs = _argparse_kwargs(tp)
        if field.name in required:
            kwargs["required"] = True
        else:
            kwargs["default"] = _default(field)
        group.add_argument(flag_name(field.name), dest=field.name, help=field.metadata.get("help"), **kwargs)


def _default(field: dataclasses.Field[Any]) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    raise TypeError(f"config field {field.name} has no default: a flag needs one")


def config_from_args(cls: type[T], ns: argparse.Namespace, **overrides: Any) -> T:
    """`cls` built from the namespace attributes named like its fields (nested configs too); a field
    the namespace lacks keeps its default, `overrides` win over both."""
    values: dict[str, Any] = {}
    for field, tp in _fields(cls):
        if field.name in overrides:
            values[field.name] = overrides[field.name]
        elif _is_config(tp):
            values[field.name] = config_from_args(tp, ns)
        elif hasattr(ns, field.name):
            value = getattr(ns, field.name)
            values[field.name] = tuple(value) if isinstance(value, list) else value
    return cls(**values)


def to_argv(config: Any, *, exclude: Collection[str] = ()) -> list[str]:
    """The flags that make `config_from_args` rebuild `config` in another process: every field,
    defaults included, so the child's own defaults never matter. None and () are written as no
    flag at all, which only rebuilds them where they are the field's default."""
    argv: list[str] = []
    for field, tp in _fields(type(config), exclude=exclude):
        value = getattr(config, field.name)
        if _is_config(tp):
            argv += to_argv(value)
        elif value is None or value == ():
            if value != _default(field):
                raise ValueError(f"{field.name}={value!r} cannot be written as a flag (its default is not {value!r})")
        elif isinstance(value, bool):
            argv.append(flag_name(field.name) if value else flag_name("no_" + field.name))
        elif isinstance(value, tuple):
            argv += [flag_name(field.name), *map(str, value)]
        else:
            argv += [flag_name(field.name), str(value)]
    return argv
