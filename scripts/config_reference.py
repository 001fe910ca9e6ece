"""Writes docs/CONFIGURATION.md, the configuration reference, from the CLI's own parser: every flag
of `pdserve serve`, `router`, `up` and `balancer`, grouped as the parser groups them (one group per
config dataclass: EngineArgs, WorkerConfig, ApiConfig, RouterConfig, AutoscaleConfig, and the
nested ones), with its type, default and help text, which come from the dataclasses' `knob`s.

    python scripts/config_reference.py           rewrite docs/CONFIGURATION.md
    python scripts/config_reference.py --check   exit 1 when the page is stale (tests/test_docs.py)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pdserve.cli import build_parser

PAGE = Path(__file__).resolve().parent.parent / "docs" / "CONFIGURATION.md"
COMMANDS = ("serve", "router", "up", "balancer")
HEADER = """# Configuration reference

Every flag of the serving commands, generated from the configuration dataclasses
(`pdserve/config.py`, `pdserve/serving/config.py`, `pdserve/disagg/config.py`,
`pdserve/ops/autoscale.py`) by `python scripts/config_reference.py`; a test fails when this page
and the code disagree. `pdserve <command> --help` prints the same text.

A boolean flag `--x` has its opposite `--no-x`. A flag that takes several values (`N+`) may also be
repeated.
"""


def _cell(text: object) -> str:
    return (str(text).replace("\\", "\\\\").replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")
            .replace("\n", " "))


def _flag(action: argparse.Action) -> str:
    flags = [s for s in action.option_strings if s.startswith("--")] or action.option_strings
    names = ", ".join(f"`{s}`" for s in flags)
    if action.nargs in ("+", "*"):
        names += " N+"
    return names


def _default(action: argparse.Action) -> str:
    if action.required:
        return "required"
    if action.default in (None, argparse.SUPPRESS) or action.default == ():
        return ""
    if isinstance(action.default, (tuple, list)):
        return " ".join(f"`{v}`" for v in action.default)
    return f"`{action.default}`"


def _help(action: argparse.Action) -> str:
    text = action.help if action.help not in (None, argparse.SUPPRESS) else ""
    if action.choices and not isinstance(action, argparse.BooleanOptionalAction):
        text = f"{text} (one of: {', '.join(map(str, action.choices))})".strip()
    return _cell(text)


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("the CLI has no subcommands")


def render() -> str:
    parts = [HEADER]
    commands = _subparsers(build_parser())
    for name in COMMANDS:
        command = commands[name]
        parts.append(f"\n## `pdserve {name}`\n")
        if command.description:
            parts.append(f"\n{_cell(command.description)}\n")
        for group in command._action_groups:
            actions = [a for a in group._group_actions if a.option_strings and a.help != argparse.SUPPRESS
                       and not isinstance(a, argparse._HelpAction)]
            if not actions:
                continue
            title = group.title if group.title not in ("options", "optional arguments") else "other"
            parts.append(f"\n### {name}: {title}\n\n")
            if group.description:
                parts.append(f"{_cell(group.description)}\n\n")
            parts.append("| flag | default | what it does |\n|---|---|---|\n")
            parts.extend(f"| {_flag(a)} | {_default(a)} | {_help(a)} |\n" for a in actions)
    return "".join(parts)


def main(argv: list[str] | None = None) -> int:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--check", action="store_true", help="exit 1 when docs/CONFIGURATION.md is stale")
    ns = args.parse_args(argv)
    text = render()
    if ns.check:
        if not PAGE.is_file() or PAGE.read_text() != text:
            print(f"{PAGE} is stale: run python scripts/config_reference.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
