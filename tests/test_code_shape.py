"""Issue 33's size rules, kept: in pdserve/, no file over 450 lines and no function over 50 (from
its `def` line to its last, nested functions counted in their parent too). Parameter counts and
complexity are ruff's (PLR0913, C901 in pyproject.toml); import direction and circles are
test_import_direction.py's."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent.parent / "pdserve"
MAX_FILE_LINES = 450
MAX_FUNCTION_LINES = 50


def too_long(source: str, label: str) -> list[str]:
    found = []
    lines = len(source.splitlines())
    if lines > MAX_FILE_LINES:
        found.append(f"{label}: {lines} lines (at most {MAX_FILE_LINES})")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                found.append(f"{label}:{node.lineno} {node.name}: {length} lines (at most {MAX_FUNCTION_LINES})")
    return found


def test_the_check_finds_a_long_function_and_a_long_file() -> None:
    body = "\n".join(f"    x{n} = {n}" for n in range(MAX_FUNCTION_LINES))
    assert too_long(f"def f() -> None:\n{body}\n", "probe.py") == ["probe.py:1 f: 51 lines (at most 50)"]
    assert too_long("x = 1\n" * (MAX_FILE_LINES + 1), "probe.py") == ["probe.py: 451 lines (at most 450)"]
    fifty = "\n".join(body.splitlines()[:-1])
    assert too_long(f"def f() -> None:\n{fifty}\n" + "x = 1\n" * (MAX_FILE_LINES - MAX_FUNCTION_LINES), "p.py") == []


def test_no_file_or_function_of_pdserve_is_too_long() -> None:
    found = [problem for path in sorted(PACKAGE_DIR.rglob("*.py"))
             for problem in too_long(path.read_text(), str(path.relative_to(PACKAGE_DIR.parent)))]
    assert not found, "\n".join(found)
