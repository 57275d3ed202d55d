"""Every object owns its state: a class uses (reads, or writes outside ``__init__``) only the
attributes that it or a real base class defines.  Defined means assigned on ``self`` in the
``__init__`` (or a dataclass's ``__post_init__``) of the class or of a base of ours, or a
class-level value (a method, a property, a constant; a bare annotation only in a dataclass,
NamedTuple or TypedDict, where it makes a field).  A class is a mixin when it uses attributes
that only the classes mixing it in define: the rule forbids exactly that, so a class can no
longer be spread over files to keep each one short (issue 57).

A base from another library (``nn.Module``, ``Exception``, ``threading.Thread``) defines
what this file cannot see, so a class with one is checked only for what it creates outside
``__init__``.  Read from the source with ``ast``; ``python -m tests.test_ownership`` lists
the uses."""

from __future__ import annotations

import ast
import pathlib
from typing import Iterator, Optional

from tests.test_layout import PACKAGES, ROOT

INITS = ("__init__", "__post_init__", "__new__")
FIELD_BASES = {"NamedTuple", "TypedDict", "Enum", "IntEnum", "StrEnum", "Flag"}
NEUTRAL_BASES = {"object", "ABC", "Generic", "Protocol"}


class ClassInfo:
    def __init__(self, node: ast.ClassDef, path: pathlib.Path) -> None:
        self.node, self.path, self.name = node, path, node.name
        self.bases = [ast.unparse(b).split("[")[0].split(".")[-1] for b in node.bases]
        fields = any(b in FIELD_BASES for b in self.bases) or any(
            "dataclass" in ast.unparse(d) for d in node.decorator_list)
        self.defined_in_init: set[str] = set()
        self.class_level: set[str] = set()
        for stmt in node.body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.class_level.add(stmt.name)
            elif isinstance(stmt, ast.Assign):
                self.class_level |= {n.id for t in stmt.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
            elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                if stmt.value is not None or fields:
                    self.class_level.add(stmt.target.id)
        for fn in self.methods():
            if fn.name in INITS:
                self.defined_in_init |= set(_self_writes(fn))

    def methods(self) -> Iterator[ast.FunctionDef]:
        for stmt in self.node.body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield stmt


def _self_name(fn: ast.FunctionDef) -> Optional[str]:
    args = fn.args.posonlyargs + fn.args.args
    if not args or any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.decorator_list):
        return None
    if any(isinstance(d, ast.Name) and d.id == "classmethod" for d in fn.decorator_list):
        return None
    return args[0].arg


def _self_writes(fn: ast.FunctionDef) -> Iterator[str]:
    """Attributes assigned on self in ``fn`` (and ``object.__setattr__(self, "name", ...)``)."""
    me = _self_name(fn)
    for node in ast.walk(fn):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                and isinstance(node.value, ast.Name) and node.value.id == me:
            yield node.attr
        elif isinstance(node, ast.Call) and ast.unparse(node.func) == "object.__setattr__" and len(node.args) >= 2 \
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
            yield node.args[1].value


def _self_uses(fn: ast.FunctionDef) -> Iterator[tuple[str, int]]:
    """Attributes ``fn`` reads on self, and those it writes when it is not an ``__init__``."""
    me = _self_name(fn)
    if me is None:
        return
    for node in ast.walk(fn):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == me:
            if isinstance(node.ctx, ast.Load) or fn.name not in INITS:
                yield node.attr, node.lineno


def _classes() -> dict[str, list[ClassInfo]]:
    out: dict[str, list[ClassInfo]] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.ClassDef):
                    out.setdefault(node.name, []).append(ClassInfo(node, path))
    return out


CLASSES = _classes()


def _lineage(info: ClassInfo, seen=None) -> tuple[list[ClassInfo], bool]:
    """The class and its bases of ours, and whether a base is another library's."""
    seen = seen if seen is not None else set()
    chain, foreign = [info], False
    seen.add(id(info))
    for base in info.bases:
        if base in NEUTRAL_BASES or base in FIELD_BASES:
            continue
        candidates = CLASSES.get(base)
        if not candidates:
            foreign = True
            continue
        parent = next((c for c in candidates if c.path == info.path), candidates[0])
        if id(parent) in seen:
            continue
        more, far = _lineage(parent, seen)
        chain += more
        foreign |= far
    return chain, foreign


def undefined_uses() -> list[str]:
    """``path:line Class.attr`` for every use of an attribute no class of the lineage defines."""
    bad = []
    for infos in CLASSES.values():
        for info in infos:
            chain, foreign = _lineage(info)
            defined = set().union(*(c.defined_in_init | c.class_level for c in chain))
            for fn in info.methods():
                for attr, line in _self_uses(fn):
                    if attr in defined or attr.startswith("__"):
                        continue
                    if foreign and fn.name in INITS:
                        continue
                    if foreign and not any(attr in set(_self_writes(f)) for c in chain for f in c.methods()):
                        continue  # the other library's base defines it (nn.Module.training, ...)
                    bad.append(f"{info.path.relative_to(ROOT)}:{line} {info.name}.{attr}")
    return sorted(set(bad))


def mixins() -> list[str]:
    """Classes of ours whose subclasses mix them with another base of ours."""
    out = []
    for infos in CLASSES.values():
        for info in infos:
            ours = [b for b in info.bases if b in CLASSES]
            if len(ours) > 1:
                out.append(f"{info.path.relative_to(ROOT)}:{info.node.lineno} {info.name}({', '.join(info.bases)})")
    return out


def test_every_class_uses_only_what_it_defines():
    bad = undefined_uses()
    assert not bad, f"{len(bad)} uses of attributes no class of the lineage defines in __init__ " \
                    "or at class level:\n" + "\n".join(bad)


def test_no_mixins():
    assert not mixins(), "classes with two bases of ours:\n" + "\n".join(mixins())


def test_the_rule_sees_a_mixin():
    src = ("class State:\n    def size(self):\n        return len(self.items)\n"
           "class Worker(State):\n    def __init__(self):\n        self.items = []\n"
           "    def setup(self):\n        self.extra = 1\n")
    tree = ast.parse(src)
    infos = {n.name: ClassInfo(n, ROOT / "x.py") for n in tree.body}
    assert "items" not in infos["State"].defined_in_init | infos["State"].class_level
    assert infos["Worker"].defined_in_init == {"items"}
    uses = {a for f in infos["Worker"].methods() for a, _ in _self_uses(f)}
    assert "extra" in uses and "items" not in uses


if __name__ == "__main__":
    found = undefined_uses()
    print("\n".join(found))
    print(f"{len(found)} uses; mixins: {len(mixins())}")
    print("\n".join(mixins()))
