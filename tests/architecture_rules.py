"""Read the library's source (AST only, nothing imported) and report breaches of the house rules.

Used by ``tests/test_architecture.py`` on the real tree and on a planted tree that shows every
problem the rules exist for. Each ``*_violations`` function returns ``{key: detail}``: the key
names the breach stably (an allow-list entry matches it), the detail says where it is.

    tree = scan(repo_root)                       # the gspo_megatron/ package under repo_root
    floors, allowed = read_floors(repo_root / "docs" / "architecture.md")
    floor_violations(tree, floors, allowed)      # {"trainer -> model": "gspo_megatron/...:22"}
    room_violations(tree, *read_rooms(doc))      # {"rollout/sglang -> rollout/standin": ...}
    cycle_violations(scan_entry_points(repo_root))   # circles among tools/ and benchmarks/
"""

from __future__ import annotations

import ast
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Set, Tuple

LIB = "gspo_megatron"
MEGATRON = ("megatron", "transformer_engine", "apex")
SGLANG = ("sglang",)
MAX_BODY_LINES = 55
HELPER_DECORATORS = {"dataclass", "contextmanager", "property", "staticmethod", "classmethod"}


@dataclass
class Module:
    """One library module: where it is, its syntax tree, and what it imports (with line)."""

    name: str
    path: Path
    tree: ast.Module
    library: Dict[str, int] = field(default_factory=dict)
    third_party: Dict[str, int] = field(default_factory=dict)

    @property
    def package(self) -> str:
        """``learner`` for ``gspo_megatron.learner.batch``; '' for the top-level ``__init__``."""
        parts = self.name.split(".")
        return parts[1] if len(parts) > 1 else ""

    @property
    def room(self) -> str:
        """``rollout/sglang`` for ``gspo_megatron/rollout/sglang/engine.py``, ``rollout`` for
        ``gspo_megatron/rollout/types.py``: the folder under the library that holds the module."""
        return "/".join(self.path.parts[1:-1])

    def where(self, line: int) -> str:
        return f"{self.path.as_posix()}:{line}"


def scan(root: Path) -> Dict[str, Module]:
    """Every module under ``root / gspo_megatron`` with its resolved imports."""
    modules = {}
    for path in sorted((root / LIB).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = Module(name, path.relative_to(root), ast.parse(path.read_text()))
    for mod in modules.values():
        _resolve_imports(mod, modules)
    return modules


def _resolve_imports(mod: Module, modules: Dict[str, Module]) -> None:
    def add_library(target: str, line: int) -> None:
        while target not in modules and "." in target:
            target = target.rsplit(".", 1)[0]
        if target in modules and target != mod.name:
            mod.library.setdefault(target, line)

    imports_by_name = _calls_import_module(mod.tree)
    for node in ast.walk(mod.tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(mod, node)
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                     for a in node.names]
        elif imports_by_name and isinstance(node, ast.Constant) and node.value in modules:
            names = [node.value]  # a module this one imports by name (not a `python -m` line)
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            if top == LIB:
                add_library(name, node.lineno)
            elif top not in sys.stdlib_module_names and top != "__future__":
                mod.third_party.setdefault(top, node.lineno)


def _calls_import_module(tree: ast.Module) -> bool:
    """Whether the module imports by name (``importlib.import_module`` / ``__import__``)."""
    return any(isinstance(n, ast.Call) and (
        (isinstance(n.func, ast.Attribute) and n.func.attr == "import_module")
        or (isinstance(n.func, ast.Name) and n.func.id in ("import_module", "__import__")))
        for n in ast.walk(tree))


def _absolute(mod: Module, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = mod.name.split(".")
    if not mod.path.name == "__init__.py":
        base = base[:-1]
    base = base[:len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


ENTRY_POINT_DIRS = ("tools", "benchmarks", "pipelines")


def scan_entry_points(root: Path, dirs: Iterable[str] = ENTRY_POINT_DIRS) -> Dict[str, Module]:
    """The modules of the entry-point folders under ``root``, each with the ones it imports.

    ``from benchmarks import x`` names ``benchmarks.x``; so does ``import x`` (or ``from x import
    y``) in a file of ``benchmarks/``: a script run by path has its own folder on ``sys.path``."""
    modules = {}
    for path in (p for d in dirs for p in sorted((root / d).rglob("*.py"))):
        parts = path.relative_to(root).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = Module(name, path.relative_to(root), ast.parse(path.read_text()))

    def resolve(name: str, folder: str):
        for candidate in (name, f"{folder}.{name}"):
            while candidate not in modules and "." in candidate:
                candidate = candidate.rsplit(".", 1)[0]
            if candidate in modules:
                return candidate
        return None

    for mod in modules.values():
        folder = ".".join(mod.path.parent.parts)
        for node in ast.walk(mod.tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(mod, node)
                names = [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for target in (resolve(n, folder) for n in names):
                if target is not None and target != mod.name:
                    mod.library.setdefault(target, node.lineno)
    return modules


def _table_rows(doc: Path) -> List[List[str]]:
    """The architecture table's rows: ``[floor, folder, one job, may import]``."""
    rows = []
    for line in doc.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].isdigit():
            rows.append(cells)
    return rows


def read_floors(doc: Path) -> Tuple[Dict[str, int], Dict[str, Set[str]]]:
    """``(floor of each package, packages each may import)`` from the architecture table."""
    floors, allowed = {}, {}
    for floor, folder, _, may_import in _table_rows(doc):
        if re.fullmatch(r"`\w+/`", folder):
            package = folder.strip("`/")
            floors[package] = int(floor)
            allowed[package] = set(re.findall(r"`(\w+)`", may_import))
    return floors, allowed


def read_rooms(doc: Path) -> Tuple[Dict[str, Set[str]], Dict[str, Set[str]]]:
    """``(sibling rooms each room may import, files each package with rooms keeps at its top)``.

    A room is a subpackage with a row of its own (`` `rollout/sglang/` ``); its "may import"
    cell names sibling rooms (`` `rollout/embedded/` ``). The top's files are the ``x.py`` that
    its package's row names."""
    rows = {folder.strip("`/"): (job, may_import) for _, folder, job, may_import in _table_rows(doc)
            if re.fullmatch(r"`\w+/(\w+/)?`", folder)}
    rooms = {name: set(re.findall(r"`(\w+/\w+)/`", may)) for name, (_, may) in rows.items()
             if "/" in name}
    tops = {package: set(re.findall(r"`(\w+\.py)`", rows[package][0]))
            for package in {r.split("/")[0] for r in rooms} if package in rows}
    return rooms, tops


def package_edges(tree: Dict[str, Module]) -> Dict[Tuple[str, str], str]:
    """``(importer, imported) -> first place`` over packages."""
    edges = {}
    for mod in tree.values():
        for target, line in mod.library.items():
            other = tree[target].package
            if mod.package and other and other != mod.package:
                edges.setdefault((mod.package, other), mod.where(line))
    return edges


def floor_violations(tree, floors, allowed) -> Dict[str, str]:
    """Package imports the table does not list, and listed imports that do not go down."""
    out = {}
    for package in sorted({m.package for m in tree.values() if m.package} ^ set(floors)):
        out[f"{package}/ has no row"] = "docs/architecture.md and gspo_megatron/ disagree"
    for (src, dst), where in package_edges(tree).items():
        if dst not in allowed.get(src, set()):
            out[f"{src} -> {dst}"] = where
    for src, targets in allowed.items():
        for dst in targets:
            if floors.get(dst, 1 << 30) >= floors[src]:
                out[f"{src} may import {dst}, not below it"] = "docs/architecture.md"
    return out


def room_violations(tree, rooms: Dict[str, Set[str]], tops: Dict[str, Set[str]]) -> Dict[str, str]:
    """Rooms (subpackages) and table rows that disagree, a package's top holding other files than
    its row names, and a room importing a sibling room its row does not list."""
    out = {}
    on_disk = {m.room for m in tree.values() if m.room.count("/") == 1}
    for room in sorted(on_disk ^ set(rooms)):
        out[f"{room}/ has no row" if room in on_disk else f"{room}/ has a row, no folder"] = \
            "docs/architecture.md and gspo_megatron/ disagree"
    for package in sorted({r.split("/")[0] for r in on_disk | set(rooms)}):
        at_top = {m.path.name for m in tree.values()
                  if m.room == package and m.path.name != "__init__.py"}
        for name in sorted(at_top ^ tops.get(package, set())):
            problem = ("at the top, not named in its row" if name in at_top
                       else "in its row, not at the top")
            out[f"{package}/{name} {problem}"] = f"docs/architecture.md, {LIB}/{package}/"
    for mod in tree.values():
        for target, line in mod.library.items():
            other = tree[target].room
            if mod.room in rooms and other in rooms and other != mod.room \
                    and other not in rooms[mod.room]:
                out[f"{mod.room} -> {other}"] = mod.where(line)
    return out


def stand_in_violations(tree, stand_in: str, rooms: Iterable[str]) -> Dict[str, str]:
    """``rooms`` (production code) reaching the test double's room ``stand_in`` through any chain
    of imports, or naming one of its modules in a string (a ``python -m`` command line)."""
    named = re.compile(re.escape(f"{LIB}/{stand_in}").replace("/", "[./]") + r"(?!\w)")
    out = {}
    for room in rooms:
        for start in sorted(n for n, m in tree.items() if m.room == room):
            chain = _chain(tree, start, lambda n: tree[n].room == stand_in)
            if chain:
                out.setdefault(f"{room} reaches {stand_in}", " -> ".join(chain))
            strings = [s for s in module_strings(tree[start]) if named.search(s)]
            if strings:
                out.setdefault(f"{room} names {stand_in}", f"{tree[start].path}: {strings[0]!r}")
    return out


def entry_point_import_violations(tree) -> Dict[str, str]:
    """Library modules importing an entry-point folder (tools/, benchmarks/, pipelines/, tests/)."""
    return {f"{mod.package} -> {top}/": mod.where(line) for mod in tree.values()
            for top, line in mod.third_party.items() if top in ENTRY_POINT_DIRS + ("tests",)}


def cycle_violations(tree: Dict[str, Module]) -> Dict[str, str]:
    """Modules that import each other, directly or around a longer circle."""
    graph = {name: set(mod.library) for name, mod in tree.items()}
    out = {}
    for component in _strongly_connected(graph):
        if len(component) > 1:
            out["circle: " + " <-> ".join(sorted(component))] = tree[min(component)].path.as_posix()
    return out


def _strongly_connected(graph: Dict[str, Set[str]]) -> List[Set[str]]:
    """Tarjan's algorithm, iterative (the graph is small, but recursion limits are not)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[Set[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                found.append(component)
    return found


def reach_violations(tree, package: str, forbidden: Iterable[str]) -> Dict[str, str]:
    """``package`` reaching a forbidden third-party package through any chain of imports."""
    out = {}
    forbidden = set(forbidden)
    for start in sorted(n for n, m in tree.items() if m.package == package):
        chain = _chain(tree, start, lambda n: bool(forbidden & set(tree[n].third_party)))
        if chain:
            top = tree[chain[-1]].third_party
            hit = next(t for t in forbidden if t in top)
            out.setdefault(f"{package} reaches {hit}", " -> ".join(chain) + f" -> {hit}")
    return out


def _chain(tree, start: str, found: Callable[[str], bool]) -> List[str]:
    """The shortest chain of imports from ``start`` to a module where ``found`` holds; [] if none."""
    paths, seen = [[start]], {start}
    while paths:  # breadth first: the shortest chain is the clearest message
        path = paths.pop(0)
        if found(path[-1]):
            return path
        for nxt in sorted(tree[path[-1]].library):
            if nxt not in seen:
                seen.add(nxt)
                paths.append(path + [nxt])
    return []


def third_party_violations(tree, tops: Iterable[str], packages: Set[str]) -> Dict[str, str]:
    """Direct imports of ``tops`` outside ``packages``."""
    return {f"{top} imported by {mod.package}/": mod.where(line)
            for mod in tree.values() for top, line in mod.third_party.items()
            if top in tops and mod.package not in packages}


def algorithms_violations(tree) -> Dict[str, str]:
    """``algorithms/`` importing anything but torch (and the standard library)."""
    return {f"algorithms imports {top}": mod.where(line)
            for mod in tree.values() if mod.package == "algorithms"
            for top, line in mod.third_party.items() if top != "torch"}


def _references(paths: Iterable[Path]) -> Set[str]:
    names = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Name):
                names.add(node.id)
            elif isinstance(node, ast.Attribute):
                names.add(node.attr)
    return names


def unused_definition_violations(tree, users: Iterable[Path], entry_points: str) -> Dict[str, str]:
    """Public top-level functions and classes nothing but tests refers to.

    ``users`` are the files whose references count (library, tools, pipelines, benchmarks);
    ``entry_points`` the text naming console scripts (``module:function``). A definition under a
    registering decorator (``@register_policy_loss("gspo")``) is used by its registry."""
    used = _references(users)
    out = {}
    for mod in tree.values():
        for node in mod.tree.body:
            if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) or node.name.startswith("_"):
                continue
            if any(_decorator_name(d) not in HELPER_DECORATORS for d in node.decorator_list):
                continue
            if node.name not in used and f":{node.name}" not in entry_points:
                out[f"{mod.name}.{node.name}"] = mod.where(node.lineno)
    return out


def _decorator_name(node: ast.expr) -> str:
    target = node.func if isinstance(node, ast.Call) else node
    return target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")


def module_strings(mod: Module) -> List[str]:
    """The module's string constants but docstrings: command lines such as
    ``python -m gspo_megatron.rollout.standin.server`` name the modules they run."""
    docstrings = {id(n.body[0].value) for n in ast.walk(mod.tree)
                  if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef))
                  and ast.get_docstring(n) is not None}
    return [n.value for n in ast.walk(mod.tree) if isinstance(n, ast.Constant)
            and isinstance(n.value, str) and id(n) not in docstrings]


def library_strings(tree) -> str:
    """Every string constant of the library but docstrings (:func:`module_strings`)."""
    return "\n".join(s for mod in tree.values() for s in module_strings(mod))


def orphan_module_violations(tree, product_texts: str) -> Dict[str, str]:
    """Library modules that no library module imports and no entry point names.

    ``product_texts``: what can start a module (scripts, pyproject, :func:`library_strings`);
    ``python -m package`` runs the package's ``__main__``."""
    imported = {t for mod in tree.values() for t in mod.library}

    def named(name: str) -> bool:
        name = name[:-len(".__main__")] if name.endswith(".__main__") else name
        return re.search(re.escape(name) + r"(?![\w.])", product_texts) is not None

    return {name: mod.path.as_posix() for name, mod in tree.items()
            if not mod.path.name == "__init__.py" and name not in imported and not named(name)}


def call_lines(mod: Module, name: str) -> List[int]:
    """Lines calling ``name(...)`` (or ``cls(...)`` inside ``class name``)."""
    lines = [n.lineno for n in ast.walk(mod.tree) if isinstance(n, ast.Call)
             and isinstance(n.func, ast.Name) and n.func.id == name]
    for cls in ast.walk(mod.tree):
        if isinstance(cls, ast.ClassDef) and cls.name == name:
            lines += [n.lineno for n in ast.walk(cls) if isinstance(n, ast.Call)
                      and isinstance(n.func, ast.Name) and n.func.id == "cls"]
    return sorted(lines)


def one_place_violations(tree, what: str, lines_of) -> Dict[str, str]:
    """``what`` done in more than one module: each of them, keyed by module."""
    places = {name: lines for name, mod in tree.items() if (lines := lines_of(mod))}
    if len(places) <= 1:
        return {}
    return {f"{what} in {name}": tree[name].where(lines[0]) for name, lines in places.items()}


def bucket_loop_lines(mod: Module) -> List[int]:
    """Lines counting a bucket (``stats.num_buckets += 1`` or ``stats.add_bucket(...)``): the body
    of a bucket loop. The counter's own ``add_bucket`` method is the counter, not a loop."""
    counter = {id(n) for f in ast.walk(mod.tree) if isinstance(f, ast.FunctionDef)
               and f.name == "add_bucket" for n in ast.walk(f)}
    return [n.lineno for n in ast.walk(mod.tree) if id(n) not in counter and (
        (isinstance(n, ast.AugAssign) and isinstance(n.target, ast.Attribute)
         and n.target.attr == "num_buckets")
        or (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and n.func.attr == "add_bucket"))]


def loss_violations(tree) -> Dict[str, str]:
    """A ``LossOutput`` built outside ``algorithms/``: a loss the registry does not know."""
    return {f"LossOutput built in {name}": mod.where(lines[0]) for name, mod in tree.items()
            if mod.package != "algorithms" and (lines := call_lines(mod, "LossOutput"))}


def build_violations(tree, module: str = f"{LIB}.trainer.build") -> Dict[str, str]:
    """Top-level definitions of ``trainer/build.py`` other than ``TrainerParts`` and ``build_*``."""
    mod = tree.get(module)
    if mod is None:
        return {}
    return {f"{module} defines {n.name}": mod.where(n.lineno) for n in mod.tree.body
            if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and not n.name.startswith("_")
            and n.name != "TrainerParts" and not n.name.startswith("build_")}


def long_function_violations(tree, limit: int = MAX_BODY_LINES) -> Dict[str, str]:
    """Functions whose body, docstring excluded, is longer than ``limit`` lines."""
    out = {}
    for mod in tree.values():
        for node in ast.walk(mod.tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = node.body[1:] if ast.get_docstring(node) is not None else node.body
                length = node.end_lineno - body[0].lineno + 1 if body else 0
                if length > limit:
                    out[f"{mod.name}.{node.name}"] = f"{mod.where(node.lineno)} ({length} lines)"
    return out


def unread_config_field_violations(tree, schema: str = f"{LIB}.config.schema") -> Dict[str, str]:
    """Fields of the config schema that no other module reads (``cfg.x.field`` or ``"x.field"``)."""
    reads: Set[str] = set()
    for name, mod in tree.items():
        if name == schema:
            continue
        for node in ast.walk(mod.tree):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                reads.add(node.attr)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and re.fullmatch(r"\w+(\.\w+)+", node.value):  # a dotted key, not prose
                reads.update(node.value.split("."))
    out = {}
    for cls in tree[schema].tree.body:
        if isinstance(cls, ast.ClassDef):
            for item in cls.body:
                if isinstance(item, ast.AnnAssign) and item.target.id not in reads:
                    out[f"{cls.name}.{item.target.id}"] = tree[schema].where(item.lineno)
    return out
