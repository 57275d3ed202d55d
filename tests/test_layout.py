"""The layout holds: no import cycles, no import against the layers, no reaching into
another module's internals, small files.  Read from the source with ``ast``; nothing is
imported, so a violation is reported by file and line, not by an import error."""

from __future__ import annotations

import ast
import pathlib
from typing import Iterator, Optional

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("schedules", "actors", "mpmd", "benchmarks")
MAX_LINES = 400

# Within mpmd: which rooms (second name component) each room may import.  The runtime sits
# under the features; features talk to the runtime, not to each other; the facade composes
# them; the CLI may use anything.  models is an ordinary user of the library.
ROOMS = {
    "errors": set(),
    "runtime": {"errors"},
    "training": {"runtime", "errors"},
    "planning": {"runtime", "errors", "moe"},
    "pipefill": {"runtime", "errors"},
    "terapipe": {"runtime", "errors"},
    "profiler": {"runtime", "errors"},
    "moe": set(),  # layers over actors/experts.py, which every room may import directly
    "models": {"terapipe", "moe"},
    "tensor_parallel": {"runtime", "errors", "planning", "models"},  # auto plans know split's and the demo's stages
    "lm": {"runtime", "errors", "training", "planning", "pipeline", "models", "moe"},
    "assemble": {"runtime", "errors", "training", "planning", "terapipe", "profiler", "tensor_parallel"},
    "pipeline": {"runtime", "errors", "training", "pipefill", "profiler", "assemble"},
    "__init__": {"errors", "pipeline", "planning", "pipefill"},
    "__main__": {"cli"},
    "cli": {"*"},
}
# Private names of other libraries that code here may use, by their full dotted text.
FOREIGN_PRIVATE = {"sys._getframe", "os._exit", "torch._C", "torch._C._functions",
                   # fused kernels of the agreed update (actors/update.py), as torch's own optimizers use them
                   "torch._foreach_norm", "torch._foreach_mul_", "torch._amp_foreach_non_finite_check_and_unscale_",
                   # aborting every NCCL communicator of a stuck actor (Note [stuck operations] in actors/transports.py)
                   "dist.distributed_c10d._abort_process_group",
                   # DTensor's RNG tracker, made without its world broadcast (actors/tensor_parallel.py)
                   "_random._rng_tracker",
                   # a ParallelStyle's one method, which a style of our own extends (mpmd/tensor_parallel/builtin.py)
                   "super()._apply"}
NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make"}


# -- reading the source ------------------------------------------------------------------------------
def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _imports(tree: ast.AST) -> Iterator[ast.stmt]:
    """Every import statement, function-local ones included, except under ``if TYPE_CHECKING:``
    (those never run; they are for annotations)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", "")) == "TYPE_CHECKING":
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _ours(name: str) -> Optional[str]:
    """The longest prefix of ``name`` that is one of our modules."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in MODULES:
            return ".".join(parts[:n])
    return None


def _targets(node: ast.stmt, importer: str) -> set[str]:
    """The modules of ours an import statement in ``importer`` loads: what it names, and the
    packages on the way there that are not the importer's own ancestors (their
    ``__init__`` runs too)."""
    if isinstance(node, ast.Import):
        named = {_ours(a.name) for a in node.names}
    else:
        if node.level:
            package = importer.split(".") if _is_package(importer) else importer.split(".")[:-1]
            base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        named = {f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else _ours(base) for a in node.names}
    out = set()
    ancestors = {".".join(importer.split(".")[:n]) for n in range(1, importer.count(".") + 1)}
    for name in named - {None}:
        parts = name.split(".")
        out |= {".".join(parts[:n]) for n in range(1, len(parts) + 1)} - ancestors
    out.discard(importer)
    return out


def _foreign(node: ast.stmt) -> set[str]:
    """Top-level names of the other libraries an import statement loads."""
    if isinstance(node, ast.Import):
        return {a.name.split(".")[0] for a in node.names}
    return {node.module.split(".")[0]} if node.module and not node.level else set()


def _graph() -> dict[str, set[str]]:
    graph = {}
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        graph[name] = set().union(*[_targets(n, name) for n in _imports(tree)])
    return graph


GRAPH = _graph()


def _cycle_from(start: str) -> Optional[list[str]]:
    """A shortest import cycle through ``start``, if there is one."""
    paths, seen = [[start]], {start}
    while paths:
        longer = []
        for path in paths:
            for nxt in sorted(GRAPH[path[-1]]):
                if nxt == start:
                    return path + [start]
                if nxt not in seen:
                    seen.add(nxt)
                    longer.append(path + [nxt])
        paths = longer
    return None


# -- the tests ---------------------------------------------------------------------------------------
def test_the_layout_is_read():
    assert {"schedules.schedule", "actors.worker", "mpmd.runtime.engine", "mpmd.pipeline", "benchmarks.harness"} \
        <= set(MODULES)
    assert "mpmd.runtime.engine" in GRAPH["mpmd.runtime"]
    assert "mpmd.runtime.cluster" in GRAPH["mpmd.runtime.fleet"]  # from . import cluster
    assert {"mpmd.terapipe", "mpmd.terapipe.protocol"} <= GRAPH["mpmd.models.gpt"]  # the package __init__ runs too


def test_no_import_cycles():
    cycles = set()
    for module in GRAPH:
        if cycle := _cycle_from(module):
            ring = cycle[:-1]
            at = ring.index(min(ring))  # one text per cycle, whichever module it was found from
            cycles.add(tuple(ring[at:] + ring[:at] + [ring[at]]))
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in sorted(cycles))


def test_schedules_is_pure_python():
    bad = []
    for name, path in MODULES.items():
        if name.split(".")[0] != "schedules":
            continue
        for node in _imports(ast.parse(path.read_text())):
            hits = (_foreign(node) & {"torch", "ray", "numpy", "msgpack", "actors", "mpmd"})
            bad += [f"{path.relative_to(ROOT)}:{node.lineno} imports {h}" for h in hits]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("package, forbidden", [("schedules", {"actors", "mpmd", "benchmarks"}),
                                                 ("actors", {"mpmd", "benchmarks"})])
def test_no_upward_imports(package, forbidden):
    bad = [f"{m} imports {t}" for m, targets in GRAPH.items() if m.split(".")[0] == package
           for t in targets if t.split(".")[0] in forbidden]
    assert not bad, "\n".join(bad)


def test_the_library_never_imports_the_benchmarks():
    """Note [benchmarks outside the library] (benchmarks/__init__.py): of the library, only
    ``mpmd.cli`` imports ``benchmarks``, and only inside a function (for ``bench`` alone)."""
    bad = [f"{m} imports {t}" for m, targets in GRAPH.items() if m.split(".")[0] in ("schedules", "actors", "mpmd")
           and m != "mpmd.cli" for t in targets if t.split(".")[0] == "benchmarks"]
    tree = ast.parse(MODULES["mpmd.cli"].read_text())
    bad += [f"mpmd/cli/__init__.py:{node.lineno} imports benchmarks when the CLI loads, not when bench runs"
            for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))
            and "benchmarks" in {t.split(".")[0] for t in _targets(node, "mpmd.cli")}]
    assert "benchmarks" in GRAPH["mpmd.cli"]  # the bench command's lazy import is seen
    assert not bad, "\n".join(bad)


def test_mpmd_rooms_import_only_what_their_layer_may():
    bad = []
    for module, targets in GRAPH.items():
        parts = module.split(".")
        if parts[0] != "mpmd":
            continue
        room = parts[1] if len(parts) > 1 else "__init__"
        allowed = ROOMS[room]
        for t in targets:
            tparts = t.split(".")
            if tparts[0] != "mpmd" or len(tparts) == 1 and room == "cli":
                continue
            target_room = tparts[1] if len(tparts) > 1 else "__init__"
            if target_room != room and "*" not in allowed and target_room not in allowed:
                bad.append(f"{module} imports {t} (mpmd/{room} may import {sorted(allowed) or 'nothing of mpmd'})")
    assert not bad, "\n".join(bad)


def _python_files() -> list[pathlib.Path]:
    return sorted(p for d in (*PACKAGES, "tests", "examples") for p in (ROOT / d).rglob("*.py"))


def test_nothing_reaches_into_another_modules_internals():
    """``x._name`` only on ``self``/``cls``; no ``_name`` imported from a module of ours."""
    bad = []
    for path in _python_files():
        for node in ast.walk(ast.parse(path.read_text())):
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                owner = node.value
                if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                    continue
                text = ast.unparse(node)
                if text in FOREIGN_PRIVATE or node.attr in NAMEDTUPLE_API:
                    continue
                bad.append(f"{where}: {text}")
            elif isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] in PACKAGES):
                names = [a.name for a in node.names] + (node.module or "").split(".")
                bad += [f"{where}: imports {n}" for n in names if n.startswith("_") and not n.startswith("__")]
            elif isinstance(node, ast.Import):
                bad += [f"{where}: imports {a.name}" for a in node.names
                        if a.name.split(".")[0] in PACKAGES and any(p.startswith("_") for p in a.name.split("."))]
    assert not bad, "private names used outside their module:\n" + "\n".join(bad)


def test_files_stay_small():
    long = [f"{p.relative_to(ROOT)}: {n} lines" for p in _python_files()
            if (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert not long, f"files over {MAX_LINES} lines:\n" + "\n".join(long)
