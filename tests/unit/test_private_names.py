"""The product's uses of Celery's and kombu's private names, each listed where it is used.

A private name is an underscore-prefixed attribute, method, function or module global that
Celery or kombu define (read from the installed packages), or a module global of theirs the
product replaces (``kombu.transport.redis.time``). A kombu or Celery release may rename or
drop any of them without notice, so every module that uses one lists it in a block that
opens with ``Private kombu/Celery names`` (``owner: name, name`` lines under it, the
versions they were read from in its first line); ``pyproject.toml``'s pin points here, and
this test holds the lists to the code:

- every private name a module uses (read from its syntax tree: :class:`Uses`) is in its
  list, and every name listed is used;
- every name listed is still defined by the installed kombu or Celery;
- only the product's kombu and Celery glue uses any: ``producer/client`` (the producer),
  ``workers/consumer`` (the worker), and ``shared/ha.py``, the Sentinel publish (``WAIT``
  after each ``LPUSH``) and transport pin both sides use (``shared`` is the one place both
  may import: ``tests/unit/test_import_graph.py``).

What counts as a use:

- in a class that derives from one of theirs (or a mixin a product class combines with one
  of theirs): a method that overrides, or a ``self._name`` / ``super()._name`` that reads or
  sets, a private name of those classes (their MRO, as installed);
- anywhere: ``obj._name`` or a string ``"_name"`` (``getattr``, a keyword) naming a private
  name Celery or kombu define, unless the module, or a product module it imports, defines
  that name for itself;
- a private name imported from them; an assignment to an attribute of one of their modules
  (or to an item of one).

It reads syntax, not types: a global of theirs changed through another name (``aliases =
kombu.transport.TRANSPORT_ALIASES; aliases[k] = v``) is not seen, nor a private name of
theirs read from an object of theirs where the module also defines that name for itself.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("producer", "workers", "shared")
LIBRARIES = ("celery", "kombu")
LISTED = (*LIBRARIES, "redis")  # a list may name redis-py's private names too (its owners')
OWNERS = ("producer/client/", "workers/consumer/", "shared/ha.py")  # module docstring
HEADER = "Private kombu/Celery names"
_PRIVATE = re.compile(r"^_[A-Za-z0-9]\w*$")


def _private(name: str) -> bool:
    return bool(_PRIVATE.match(name)) and not name.endswith("__")


def _theirs(dotted: str) -> bool:
    return dotted.split(".")[0] in LIBRARIES


def _defined(node: ast.AST) -> Iterator[str]:
    """The names ``node`` defines (or binds: parameters, keywords, imports)."""
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        yield node.name
    elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
        yield node.attr
    elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
        yield node.id
    elif isinstance(node, ast.arg | ast.keyword) and node.arg:
        yield node.arg
    elif isinstance(node, ast.alias):
        yield node.asname or node.name.split(".")[-1]


@cache
def package_names(package: str) -> frozenset[str]:
    """Every private name the source of ``package`` (``celery``, ``kombu``, ``redis``)
    defines or binds."""
    init = importlib.import_module(package).__file__
    assert init is not None
    out: set[str] = set()
    for path in Path(init).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            out.update(n for n in _defined(node) if _private(n))
    return frozenset(out)


@cache
def library_names() -> frozenset[str]:
    """Every private name Celery's and kombu's source defines or binds."""
    return package_names("celery") | package_names("kombu")


@cache
def class_names(dotted: str) -> frozenset[str]:
    """The private names Celery's or kombu's class ``dotted`` has: defined in the body of a
    class of its MRO from Celery or kombu, or set on ``self`` in its methods."""
    module, _, attr = dotted.rpartition(".")
    cls = getattr(importlib.import_module(module), attr)
    out: set[str] = set()
    for k in inspect.getmro(cls):
        if not _theirs(k.__module__):
            continue
        out.update(n for n in vars(k) if _private(n))
        try:
            source = textwrap.dedent(inspect.getsource(k))
        except OSError:  # made at run time (no class statement): its attributes above
            continue
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                out.update(n for n in _defined(node) if _private(n))
    return frozenset(out)


@dataclass
class Module:
    """One product module: its tree, what its imported names stand for (dotted), its
    classes (by name)."""

    name: str
    path: Path
    tree: ast.Module
    aliases: dict[str, str] = field(default_factory=dict)
    classes: dict[str, ast.ClassDef] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    self.aliases[a.asname or a.name.split(".")[0]] = (
                        a.name if a.asname else a.name.split(".")[0]
                    )
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for a in node.names:
                    self.aliases[a.asname or a.name] = f"{node.module}.{a.name}"
            elif isinstance(node, ast.ClassDef):
                self.classes[node.name] = node

    def resolve(self, expr: ast.expr) -> str | None:
        """The dotted name ``expr`` (``a.b.C``) stands for, ``None`` if not a name."""
        parts: list[str] = []
        while isinstance(expr, ast.Attribute):
            parts.insert(0, expr.attr)
            expr = expr.value
        if not isinstance(expr, ast.Name):
            return None
        root = self.aliases.get(expr.id)
        if root is None:
            root = f"{self.name}.{expr.id}" if expr.id in self.classes else None
        return ".".join([root, *parts]) if root else None


def _modules() -> dict[str, Module]:
    out = {}
    for root in ROOTS:
        for path in sorted((REPO / root).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = Module(name, path, ast.parse(path.read_text(encoding="utf-8")))
    return out


class Product:
    """The product's modules, and which of their classes stand on Celery's or kombu's."""

    def __init__(self, modules: dict[str, Module]) -> None:
        self.modules = modules
        self._bases: dict[str, frozenset[str]] = {}
        self.mixed: dict[str, set[str]] = {}  # mixin -> their classes it is combined with
        for m in modules.values():
            for name, node in m.classes.items():
                theirs = self.library_bases(f"{m.name}.{name}")
                for b in node.bases:
                    base = m.resolve(b)
                    if theirs and base and not _theirs(base):
                        self.mixed.setdefault(base, set()).update(theirs)

    def library_bases(self, qual: str) -> frozenset[str]:
        """The Celery or kombu classes the class ``qual`` derives from."""
        if _theirs(qual):
            return frozenset({qual})
        if qual in self._bases:
            return self._bases[qual]
        self._bases[qual] = frozenset()  # a cycle adds nothing
        module, _, name = qual.rpartition(".")
        m = self.modules.get(module)
        node = m.classes.get(name) if m else None
        found: set[str] = set()
        if m is not None and node is not None:
            for b in node.bases:
                base = m.resolve(b)
                if base:
                    found |= self.library_bases(base)
        self._bases[qual] = frozenset(found)
        return self._bases[qual]

    def names_of(self, qual: str) -> frozenset[str]:
        """The private names the class ``qual`` has from Celery or kombu."""
        theirs = self.library_bases(qual) | self.mixed.get(qual, set())
        return frozenset().union(*(class_names(t) for t in theirs))

    @cache  # noqa: B019  # one Product per test session
    def own(self, module: str) -> frozenset[str]:
        """Private names ``module`` and the product modules it imports define for
        themselves: functions, classes, globals, methods and ``self`` attributes of classes
        not standing on Celery's or kombu's (where they do, the names those have excepted)."""
        m = self.modules[module]
        out = set(self._defines(module))
        for dotted in m.aliases.values():
            while dotted and dotted not in self.modules:
                dotted = dotted.rpartition(".")[0]
            if dotted and dotted != module:
                out |= self._defines(dotted)
        return frozenset(out)

    @cache  # noqa: B019
    def _defines(self, module: str) -> frozenset[str]:
        m = self.modules[module]
        inherited: dict[int, frozenset[str]] = {}
        for node in ast.walk(m.tree):
            if isinstance(node, ast.ClassDef):
                names = self.names_of(f"{m.name}.{node.name}")
                for sub in ast.walk(node):
                    inherited.setdefault(id(sub), names)
        out: set[str] = set()
        for node in ast.walk(m.tree):
            if isinstance(node, ast.Attribute) and not _on_self(node.value):
                continue  # set on another object: not a definition of this module's
            names = inherited.get(id(node), frozenset())
            out.update(n for n in _defined(node) if _private(n) and n not in names)
        return frozenset(out)


@cache
def product() -> Product:
    return Product(_modules())


class Uses(ast.NodeVisitor):
    """The private names (``_name``) and replaced module globals (``kombu.x.name``) one
    module uses (module docstring)."""

    def __init__(self, m: Module, p: Product) -> None:
        self.m, self.p = m, p
        self.names: set[str] = set()
        self.patched: set[str] = set()
        self.inherited: list[frozenset[str]] = []  # per enclosing class
        for node in ast.walk(m.tree):
            if isinstance(node, ast.ImportFrom) and node.module and _theirs(node.module):
                self.names.update(a.name for a in node.names if _private(a.name))

    def _foreign(self, name: str) -> bool:
        return _private(name) and name in library_names() and name not in self.p.own(self.m.name)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        names = self.p.names_of(f"{self.m.name}.{node.name}")
        self.inherited.append(names)
        self.names.update(
            item.name
            for item in node.body
            if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and item.name in names
        )
        self.generic_visit(node)
        self.inherited.pop()

    def visit_Attribute(self, node: ast.Attribute) -> None:
        value = node.value
        on_self = _on_self(value)
        inherited = on_self and bool(self.inherited) and node.attr in self.inherited[-1]
        if inherited or (not on_self and self._foreign(node.attr)):
            self.names.add(node.attr)
        if isinstance(node.ctx, ast.Store | ast.Del):
            self._patch(value, node.attr)
        self.generic_visit(node)

    def visit_Subscript(self, node: ast.Subscript) -> None:
        if isinstance(node.ctx, ast.Store | ast.Del) and isinstance(node.value, ast.Attribute):
            self._patch(node.value.value, node.value.attr)
        self.generic_visit(node)

    def _patch(self, owner: ast.expr, attr: str) -> None:
        if isinstance(owner, ast.Name):
            dotted = self.m.aliases.get(owner.id)
            if dotted and _theirs(dotted) and inspect.ismodule(_load(dotted)):
                self.patched.add(f"{dotted}.{attr}")

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, str) and self._foreign(node.value):
            self.names.add(node.value)


def _on_self(value: ast.expr) -> bool:
    """Whether ``value`` is ``self``, ``cls`` or ``super()``."""
    if isinstance(value, ast.Name):
        return value.id in ("self", "cls")
    call = isinstance(value, ast.Call) and isinstance(value.func, ast.Name)
    return call and value.func.id == "super"  # type: ignore[union-attr]


def _load(dotted: str) -> object:
    """The object ``dotted`` names (a module, or an attribute of one)."""
    try:
        return importlib.import_module(dotted)
    except ImportError:
        module, _, attr = dotted.rpartition(".")
        return getattr(importlib.import_module(module), attr)


def used(m: Module) -> set[str]:
    """The private names (``_name``) and replaced globals (``kombu.x.name``) ``m`` uses."""
    uses = Uses(m, product())
    uses.visit(m.tree)
    return uses.names | uses.patched


def listed(m: Module) -> dict[str, str]:
    """``m``'s list: ``{key: owner.name}``, the key the private name (``_name``), or a
    replaced global's full name; empty without a list. Its lines are ``owner: name, ...``
    (an indented line goes on with the owner above; a note in parentheses is no name)."""
    text = m.path.read_text(encoding="utf-8")
    start = text.find(HEADER)
    if start < 0:
        return {}
    out: dict[str, str] = {}
    owner = ""
    for line in text[start:].splitlines()[1:]:
        line = line.strip().removeprefix("#").strip()
        if not line or line == '"""':
            break
        head = re.match(r"([\w.]+):(.*)", line)
        if head and head.group(1).split(".")[0] in LISTED:
            owner, line = head.group(1), head.group(2)
        assert owner, f"{m.path}: not an 'owner: names' line: {line!r}"
        for name in re.findall(r"\w+", re.sub(r"\([^)]*\)", "", line)):
            out[name if _private(name) else f"{owner}.{name}"] = f"{owner}.{name}"
    assert out, f"{m.path}: its {HEADER} block lists nothing"
    return out


def _rel(m: Module) -> str:
    return m.path.relative_to(REPO).as_posix()


def test_the_reader_finds_private_names() -> None:
    source = (
        "from kombu.transport import redis as r\n"
        "import kombu.transport as t\n"
        "class C(r.Channel):\n"
        "    def _put(self, q, m):\n"
        "        self._mine = 1\n"
        "        return self._q_for_pri(q, 0)\n"
        "class Own:\n"
        "    def __init__(self): self._lock = None\n"
        "    def _put(self): return self._lock\n"
        "def f(x):\n"
        "    r.time = x\n"
        "    t.TRANSPORT_ALIASES['s'] = x\n"
        "    return getattr(x, '_channels', None), x._state, x._lock\n"
    )
    m = Module("example", Path("example.py"), ast.parse(source))
    p = Product({"example": m})
    uses = Uses(m, p)
    uses.visit(m.tree)
    assert uses.names == {"_put", "_q_for_pri", "_channels", "_state"}  # _lock: Own's
    assert uses.patched == {"kombu.transport.redis.time", "kombu.transport.TRANSPORT_ALIASES"}


def test_every_use_is_listed_and_every_listed_name_used() -> None:
    unlisted, stale = [], []
    for m in product().modules.values():
        found, lst = used(m), listed(m)
        unlisted += [f"{_rel(m)}: {n}" for n in sorted(found - lst.keys())]
        stale += [f"{_rel(m)}: {lst[n]}" for n in sorted(lst.keys() - found)]
    assert unlisted == []
    assert stale == []


def test_only_the_glue_uses_private_names() -> None:
    users = [_rel(m) for m in product().modules.values() if used(m)]
    assert "workers/consumer/channel.py" in users  # the reader reads
    assert [u for u in users if not u.startswith(OWNERS)] == []


def test_the_listed_names_exist_in_the_installed_versions() -> None:
    missing = []
    for m in product().modules.values():
        for key, full in listed(m).items():
            if _private(key):
                ok = key in package_names(full.split(".")[0])
            else:
                module, _, attr = full.rpartition(".")
                ok = hasattr(importlib.import_module(module), attr)
            if not ok:
                missing.append(f"{_rel(m)}: {full}")
    assert missing == []
