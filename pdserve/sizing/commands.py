"""`pdserve plan | calibrate | simulate` as commands of the `pdserve` CLI (cli.py calls add_sizing_commands)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable


def add_sizing_commands(sub: argparse._SubParsersAction) -> None:
    """`plan` (memory arithmetic), `calibrate` (a measured step-time profile), `simulate` (a
    discrete-event cluster simulation); bad input is a message and exit status 2."""
    from pdserve.sizing import calibrate, plan_command, simulate_command

    for module in (plan_command, calibrate, simulate_command):
        module.add_parser(sub)
    for name in ("plan", "calibrate", "simulate"):
        parser = sub.choices[name]
        parser.set_defaults(func=guarded(name, parser.get_default("func")))


def guarded(name: str, run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """`run`, with bad input (ValueError, OSError, RuntimeError) a message on stderr and exit status 2."""
    def guarded_run(ns: argparse.Namespace) -> int:
        try:
            return int(run(ns))
        except (ValueError, OSError, RuntimeError) as exc:
            print(f"pdserve {name}: {exc}", file=sys.stderr)
            return 2

    return guarded_run
