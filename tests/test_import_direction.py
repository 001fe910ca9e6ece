"""Dependencies point one way (model/tokenizer <- engine <- serving <- disagg <- ops <- bench <- sizing <- cli,
an arrow reads "is imported by"): no module of pdserve imports one of a higher layer. Every import
statement counts, at any depth: inside functions and under `if TYPE_CHECKING:` too, since a lazy
import is still a dependency.

Layers, low to high:
    0  model/, tokenizer/, and three leaf modules every layer may use: envs.py (the environment, read
       in one place), logs.py (log format, request ids) and addresses.py (URLs, HOST:PORT, pool
       members as flags write them); they import nothing of pdserve
    1  engine/, and the top-level modules about it: config.py (EngineArgs and `knob`; the configs
       of higher layers are in their own packages: disagg/config.py, serving/config.py),
       config_flags.py (CLI flags from configs) and pdserve/__init__.py (the `LLM` API, re-exported
       from engine/)
    2  serving/
    3  disagg/
    4  ops/
    5  bench/ (which measures through ops/ too: `pdserve up`, the supervisor)
    6  sizing/ (the planner and simulator, built on bench's workloads, records and measurements)
    7  cli.py
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import NamedTuple

PACKAGE_DIR = Path(__file__).resolve().parent.parent / "pdserve"
LAYERS: dict[str, int] = {
    "model": 0, "tokenizer": 0, "envs": 0, "logs": 0, "addresses": 0,
    "engine": 1, "config": 1, "config_flags": 1, "__init__": 1,
    "serving": 2,
    "disagg": 3,
    "ops": 4,
    "bench": 5,
    "sizing": 6,
    "cli": 7,
}


class Upward(NamedTuple):
    path: str
    line: int
    imported: str
    from_layer: int
    to_layer: int

    def __str__(self) -> str:
        return f"{self.path}:{self.line} imports {self.imported} (layer {self.from_layer} -> {self.to_layer})"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int:
    """The layer of `pdserve.X...`; the package itself is its __init__."""
    parts = module.split(".")
    key = parts[1] if len(parts) > 1 else "__init__"
    if key not in LAYERS:
        raise AssertionError(f"{module} is in no layer: add {key!r} to LAYERS (and to this module's docstring)")
    return LAYERS[key]


def _is_submodule(module: str) -> bool:
    relative = Path(*module.split(".")[1:])
    return (PACKAGE_DIR / relative).with_suffix(".py").is_file() or (PACKAGE_DIR / relative / "__init__.py").is_file()


def imported_modules(source: str, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, module) of every pdserve module that `module`'s source imports; `from pdserve.x import
    y` counts as pdserve.x.y when y is a module, else as pdserve.x."""
    package = module if is_package else module.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.append((node.lineno, candidate if base.startswith("pdserve") and _is_submodule(candidate)
                              else base))
    return [(line, name) for line, name in found if name == "pdserve" or name.startswith("pdserve.")]


def upward_in(source: str, module: str, label: str, is_package: bool = False) -> list[Upward]:
    own = layer_of(module)
    return [Upward(label, line, imported, own, layer_of(imported))
            for line, imported in imported_modules(source, module, is_package) if layer_of(imported) > own]


def upward_imports(paths: list[Path]) -> list[Upward]:
    return [upward for path in paths
            for upward in upward_in(path.read_text(), module_name(path), str(path.relative_to(PACKAGE_DIR.parent)),
                                    is_package=path.name == "__init__.py")]


def _modules() -> list[Path]:
    return sorted(PACKAGE_DIR.rglob("*.py"))


def test_every_module_has_a_layer() -> None:
    for path in _modules():
        layer_of(module_name(path))


def test_the_checker_sees_every_kind_of_import() -> None:
    """Lazy, TYPE_CHECKING and relative imports all count; a name imported from a module is that module."""
    source = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pdserve.serving import app\n"
              "def f():\n    import pdserve.disagg.router.core\n    from ..cli import main\n"
              "from pdserve.config import EngineArgs\nfrom . import scheduler\n")
    upward = upward_in(source, "pdserve.engine.probe", "probe.py")
    assert [(u.line, u.imported, u.to_layer) for u in upward] == [
        (3, "pdserve.serving.app", 2), (5, "pdserve.disagg.router.core", 3), (6, "pdserve.cli", 7)]
    assert str(upward[0]) == "probe.py:3 imports pdserve.serving.app (layer 1 -> 2)"
    assert (8, "pdserve.engine.scheduler") in imported_modules(source, "pdserve.engine.probe")


def test_imports_point_down() -> None:
    upward = upward_imports(_modules())
    assert not upward, "imports against the layer order:\n" + "\n".join(map(str, upward))


def import_graph(paths: list[Path]) -> dict[str, set[str]]:
    """Module -> the pdserve modules it imports (every import statement, as above)."""
    graph: dict[str, set[str]] = {}
    for path in paths:
        module = module_name(path)
        graph[module] = {name for _, name in imported_modules(path.read_text(), module, path.name == "__init__.py")
                         if name != module}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected sets of more than one module (each holds a circle of imports)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:  # NOTE: Tarjan's algorithm; the graph is ~200 modules deep at most
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in sorted(graph[module] & graph.keys()):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            members = []
            while (top := stack.pop()) != module:
                members.append(top)
            if members:
                found.append(sorted([module, *members]))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_the_circle_finder_finds_circles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}, "f": set()}
    assert circles(graph) == [["a", "b", "c"]]


def test_no_circle_between_modules() -> None:
    found = circles(import_graph(_modules()))
    assert not found, "modules that import each other (through others):\n" + "\n".join(map(" <-> ".join, found))


def test_every_module_imports() -> None:
    """Each module loads on its own: a name imported only for type checking but used at run time
    (a module-level alias, a base class) fails here, not in a worker process at start-up."""
    import importlib

    for path in _modules():
        if path.name != "__main__.py":
            importlib.import_module(module_name(path))


def disagg_side(module: str) -> str | None:
    """'router' or 'worker' for a module of disagg/router/ or disagg/worker/, 'shared' for the rest
    of disagg/ (its top-level modules, transport/, queue/), None outside disagg/."""
    parts = module.split(".")
    if parts[:2] != ["pdserve", "disagg"]:
        return None
    return parts[2] if len(parts) > 2 and parts[2] in ("router", "worker") else "shared"


def across_sides(graph: dict[str, set[str]]) -> list[str]:
    """Imports inside disagg/ that do not point one way: shared -> router/worker, router <-> worker."""
    allowed = {"shared": {"shared"}, "router": {"shared", "router"}, "worker": {"shared", "worker"}}
    return [f"{module} imports {imported}" for module, imports in sorted(graph.items())
            if (side := disagg_side(module)) is not None
            for imported in sorted(imports)
            if (other := disagg_side(imported)) is not None and other not in allowed[side]]


def test_the_side_checker_sees_each_direction() -> None:
    graph = {"pdserve.disagg.router.core": {"pdserve.disagg.worker.app", "pdserve.disagg.control"},
             "pdserve.disagg.queue.base": {"pdserve.disagg.router.pool"},
             "pdserve.disagg.worker.app": {"pdserve.disagg.transport.tcp", "pdserve.serving.app"}}
    assert across_sides(graph) == ["pdserve.disagg.queue.base imports pdserve.disagg.router.pool",
                                   "pdserve.disagg.router.core imports pdserve.disagg.worker.app"]


def test_router_and_worker_import_only_what_they_share() -> None:
    found = across_sides(import_graph(_modules()))
    assert not found, "imports across disagg's router/, worker/ and what they share:\n" + "\n".join(found)


def test_disagg_top_level_stays_small() -> None:
    """What both sides share stays a short list; a module of one side goes into router/ or worker/."""
    top = sorted(path.name for path in (PACKAGE_DIR / "disagg").glob("*.py"))
    assert len(top) <= 15, top
