"""The package layout: rooms import only downward, no import cycles, no oversized modules.

Imports are read from the source (``ast``), counting those inside functions, so a lazy
import cannot hide a cycle. Rooms and what each may import are the table in docs/design/layout.md.
"""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Source folder -> import name (ops/ and mesh/ install as shardprop.ops / shardprop.mesh).
FOLDERS = {"shardprop": "shardprop", "ops": "shardprop.ops", "mesh": "shardprop.mesh"}
# Room -> rooms it may import (besides itself). "shardprop" is the package's public API.
ALLOWED = {
    "shardprop.mesh": set(),
    "shardprop.tensor": {"shardprop.mesh"},
    "shardprop.dispatch": {"shardprop.tensor", "shardprop.mesh"},
    "shardprop.ops": {"shardprop.dispatch", "shardprop.tensor", "shardprop.mesh"},
    "shardprop.parallel": {"shardprop.dispatch", "shardprop.tensor", "shardprop.mesh"},
    "shardprop.checkpoint": {"shardprop.dispatch", "shardprop.tensor", "shardprop.mesh"},
    "shardprop.debug": {"shardprop.dispatch", "shardprop.tensor", "shardprop.mesh"},
    "shardprop.demo": {"shardprop", "shardprop.mesh"},
    "shardprop.interop": {"shardprop", "shardprop.mesh"},
    "shardprop.planner": {"shardprop.parallel", "shardprop.dispatch", "shardprop.tensor", "shardprop.mesh"},
}
MAX_LINES = 600


def _import_base(node, mod: str, is_pkg: bool) -> str:
    """The absolute module a ``from ... import`` names, relative imports resolved against ``mod``."""
    base = node.module or ""
    if node.level:
        pkg = mod if is_pkg else mod.rpartition(".")[0]
        for _ in range(node.level - 1):
            pkg = pkg.rpartition(".")[0]
        base = f"{pkg}.{base}" if base else pkg
    return base


def _modules():
    """Import name -> source path of every product module."""
    out = {}
    for folder, name in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([name] + parts)] = path
    return out


def _resolve(name, mods):
    """The longest product module that ``name`` (a dotted import target) names or lies in."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def import_graph():
    """Module -> set of product modules it imports (anywhere in its source)."""
    mods = _modules()
    graph = {}
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _import_base(node, mod, is_pkg)
                # `from pkg import sub` names the submodule when there is one.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for t in targets:
                r = _resolve(t, mods)
                if r is not None and r != mod:
                    deps.add(r)
        graph[mod] = deps
    return graph


def find_cycles(graph):
    """Strongly connected components with more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, comps = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return comps


def room_of(mod):
    """The room a module belongs to: ``shardprop.<room>`` (or the package itself)."""
    for room in sorted(ALLOWED, key=len, reverse=True):
        if mod == room or mod.startswith(room + "."):
            return room
    return "shardprop"


def test_no_import_cycles():
    cycles = find_cycles(import_graph())
    assert not cycles, f"import cycles (imports inside functions count): {cycles}"


def bench_import_graph(folder=ROOT / "bench"):
    """Script -> set of sibling scripts it imports (the benches run with ``bench/`` on ``sys.path``)."""
    names = {p.stem for p in folder.glob("*.py")}
    graph = {}
    for path in sorted(folder.glob("*.py")):
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                deps.add(node.module.split(".")[0])
        graph[path.stem] = (deps & names) - {path.stem}
    return graph


def test_no_import_cycles_in_bench():
    graph = bench_import_graph()
    assert "_launch" in graph["tp"], "the bench import graph misses tp.py's import of _launch"
    cycles = find_cycles(graph)
    assert not cycles, f"import cycles between bench scripts (imports inside functions count): {cycles}"


def test_rooms_import_only_what_the_design_allows():
    bad = []
    for mod, deps in import_graph().items():
        room = room_of(mod)
        if room == "shardprop":  # the package's __init__: the public API gathers everything
            continue
        for d in deps:
            droom = room_of(d)
            if droom != room and droom not in ALLOWED[room]:
                bad.append(f"{mod} imports {d} ({room} may import {sorted(ALLOWED[room]) or 'nothing of shardprop'})")
    assert not bad, "\n".join(bad)


def test_no_module_over_the_size_limit():
    big = {m: n for m, p in _modules().items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not big, f"modules over {MAX_LINES} lines: {big}"


def test_every_room_is_a_package_with_a_docstring():
    for room in ALLOWED:
        folder = ROOT / ("mesh" if room == "shardprop.mesh" else "ops" if room == "shardprop.ops"
                         else "shardprop/" + room.split(".")[1])
        init = folder / "__init__.py"
        assert init.exists(), f"{room} has no __init__.py"
        assert ast.get_docstring(ast.parse(init.read_text())), f"{init} says nothing of what the room holds"


def test_pyproject_lists_every_package():
    # setuptools installs only the listed packages: a subpackage left out imports in an editable
    # install and is missing from a wheel.
    import re
    listed = set(re.findall(r'"(shardprop[\w.]*)"', (ROOT / "pyproject.toml").read_text().split("[tool.setuptools]")[1]
                            .split("[tool.setuptools.package-dir]")[0]))
    found = set()
    for top, name in (("shardprop", "shardprop"), ("mesh", "shardprop.mesh"), ("ops", "shardprop.ops")):
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / top).parts
            found.add(".".join((name,) + rel))
    assert found <= listed, f"packages missing from pyproject.toml: {sorted(found - listed)}"


def test_the_checker_sees_a_cycle_and_a_lazy_import():
    # The checks themselves must be able to fail.
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    graph = import_graph()
    assert "shardprop.tensor.dtensor" in graph["shardprop.tensor.conversions"]
    # a function-level import is counted: dispatcher's _replicate_plain_indices imports tensor.dtensor lazily
    src = (ROOT / "shardprop/dispatch/dispatcher.py").read_text()
    if "    from shardprop.tensor.dtensor import make_spec" in src:
        assert "shardprop.tensor.dtensor" in graph["shardprop.dispatch.dispatcher"]
    assert room_of("shardprop.debug.stats") == "shardprop.debug"


@pytest.mark.parametrize("name", [
    "DTensor", "DTensorSpec", "DeviceMesh", "Partial", "Placement", "Replicate", "Shard", "ShardingError",
    "distribute_tensor", "init_device_mesh", "plan_redistribute", "register_sharding", "unregister_sharding",
    "cache_stats", "print_cache_stats", "clear_cache", "set_cache_size", "set_fallback_to_replicate",
    "explain", "explicit", "check_sharding_rule", "set_decompose_fallback", "parallelize_module",
    "distribute_module", "ColwiseParallel", "RowwiseParallel", "SequenceParallel", "PrepareModuleInput",
    "PrepareModuleOutput", "loss_parallel", "comm_counter", "manual_seed", "replicate_gradients",
    "compute_bucket_assignment_by_size"])
def test_public_names_stay(name):
    import shardprop
    assert hasattr(shardprop, name), f"shardprop.{name} is gone"
    assert name in shardprop.__all__


# ---------------------------------------------------------------- rooms wired in the open
# The one module that may give a class defined elsewhere its methods (DTensor's, listed there).
ASSEMBLY = "shardprop.assembly"
# The one module that may hold `global` statements (at most MAX_GLOBALS): the settings table.
SETTINGS_MODULE = "shardprop.mesh.config"
MAX_GLOBALS = 5
_MUTATORS = {"append", "extend", "insert", "pop", "update", "clear", "remove", "setdefault", "add", "discard",
             "popitem"}


def _imported_product_names(mod, is_pkg, tree, mods):
    """Local name -> dotted product name, for every name this module imports from another product module."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if _resolve(a.name, mods) not in (None, mod):
                    out[a.asname or a.name.split(".")[0]] = a.name
        elif isinstance(node, ast.ImportFrom):
            base = _import_base(node, mod, is_pkg)
            for a in node.names:
                if _resolve(f"{base}.{a.name}", mods) not in (None, mod):
                    out[a.asname or a.name] = f"{base}.{a.name}"
    return out


def _root_name(node):
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def foreign_writes(mod, source, mods, is_pkg=False):
    """Writes in ``source`` into what another product module owns: its attributes (or items under them), a
    class it defines (``Cls.attr = ...``, ``setattr(Cls, ...)``), or a container it holds (``mod.table.update``)."""
    tree = ast.parse(source)
    names = _imported_product_names(mod, is_pkg, tree, mods)
    found = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        for t in [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]:
            if isinstance(t, (ast.Attribute, ast.Subscript)) and _root_name(t) in names:
                found.append(f"{mod}:{node.lineno}: {ast.unparse(t)} = ... ({names[_root_name(t)]})")
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and f.id in ("setattr", "delattr") and node.args \
                    and _root_name(node.args[0]) in names:
                found.append(f"{mod}:{node.lineno}: {ast.unparse(node)}")
            elif isinstance(f, ast.Attribute) and f.attr in _MUTATORS and isinstance(f.value, ast.Attribute) \
                    and _root_name(f.value) in names:
                found.append(f"{mod}:{node.lineno}: {ast.unparse(f)}(...) ({names[_root_name(f.value)]})")
    return found


def global_statements(source):
    """Line numbers of the ``global`` statements in ``source``."""
    return [n.lineno for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Global)]


def environment_reads(source, prefix="SHARDPROP_"):
    """Line numbers where ``source`` reads a ``prefix*`` environment variable (``os.environ``/``getenv``)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Call, ast.Subscript)) and ("environ" in ast.unparse(node) or
                                                           "getenv" in ast.unparse(node)):
            parts = node.args if isinstance(node, ast.Call) else [node.slice]
            if any(isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value.startswith(prefix)
                   for a in parts):
                lines.append(node.lineno)
    return lines


def test_no_module_writes_into_another_modules_attributes():
    mods = _modules()
    bad = []
    for mod, path in mods.items():
        if mod != ASSEMBLY:
            bad += foreign_writes(mod, path.read_text(), mods, path.name == "__init__.py")
    assert not bad, ("modules write into what another module owns (add a registration function there, or "
                     "list it in shardprop/assembly.py):\n" + "\n".join(bad))


def test_global_statements_only_in_the_settings_module():
    counts = {m: len(global_statements(p.read_text())) for m, p in _modules().items()}
    elsewhere = {m: n for m, n in counts.items() if n and m != SETTINGS_MODULE}
    assert not elsewhere, f"`global` outside {SETTINGS_MODULE} (keep state in an object): {elsewhere}"
    assert counts[SETTINGS_MODULE] <= MAX_GLOBALS


def test_shardprop_environment_variables_are_read_in_the_settings_module_only():
    reads = {m: environment_reads(p.read_text()) for m, p in _modules().items() if m != SETTINGS_MODULE}
    assert not {m: r for m, r in reads.items() if r}, reads


def test_the_wiring_checks_can_fail():
    mods = _modules()
    src = ("from shardprop.dispatch import dispatcher as d\nfrom shardprop.tensor.dtensor import DTensor\n"
           "import shardprop.mesh.groups\n"
           "d.recorder = 1\nDTensor.foo = 2\nsetattr(DTensor, 'bar', 3)\nd.SPECIAL[1] = 2\nd.POSITIONWISE.update(())\n"
           "shardprop.mesh.groups._timeout = 4\nx = d.recorder\nlocal = {}\nlocal['a'] = 1\n")
    found = foreign_writes("shardprop.ops.fake", src, mods)
    assert sorted(int(f.split(":")[1]) for f in found) == [4, 5, 6, 7, 8, 9], found
    assert global_statements("x = 1\ndef f():\n    global x\n    x = 2\n") == [3]
    assert environment_reads("import os\na = os.environ.get('SHARDPROP_X', '1')\nb = os.environ['SHARDPROP_Y']\n"
                             "c = os.environ.get('HOME')\n") == [2, 3]


# ---------------------------------------------------------------- one declaration per op
# registry.py keeps everything about an op in its OpEntry (``entries``): a second table keyed by op
# (a rule table, a set of flagged ops, a cache) would have to be kept in step with the entries again.
REGISTRY = ROOT / "shardprop/dispatch/registry.py"
_TABLE_CALLS = {"dict", "set", "frozenset", "defaultdict", "OrderedDict", "WeakKeyDictionary",
                "WeakValueDictionary", "WeakSet", "Counter"}
_CACHE_DECORATORS = {"lru_cache", "cache"}


def _is_table(value) -> bool:
    if isinstance(value, (ast.Dict, ast.Set, ast.DictComp, ast.SetComp)):
        return True
    if isinstance(value, ast.Call):
        f = value.func
        return (f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None) in _TABLE_CALLS
    return False


def tables(source) -> list:
    """Names bound to a dict or set at module or class level in ``source`` (displays, comprehensions,
    ``dict()``/``set()``/``defaultdict()``... calls) and functions behind an ``lru_cache``/``cache``."""
    found = []
    tree = ast.parse(source)
    bodies = [tree.body] + [n.body for n in tree.body if isinstance(n, ast.ClassDef)]
    for body in bodies:
        for node in body:
            if isinstance(node, ast.Assign) and _is_table(node.value):
                found += [ast.unparse(t) for t in node.targets]
            elif isinstance(node, ast.AnnAssign) and node.value is not None and _is_table(node.value):
                found.append(ast.unparse(node.target))
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for d in node.decorator_list:
                d = d.func if isinstance(d, ast.Call) else d
                if (d.id if isinstance(d, ast.Name) else getattr(d, "attr", None)) in _CACHE_DECORATORS:
                    found.append(f"{node.name}()")
    return found


def test_registry_has_no_op_table_besides_the_entries():
    found = tables(REGISTRY.read_text())
    assert found == ["entries"], (
        f"shardprop/dispatch/registry.py holds tables besides `entries`: {[t for t in found if t != 'entries']}; "
        "declare the fact on the op's OpEntry instead (a slot, written by its registration function)")


def test_the_table_check_can_fail():
    src = ("import functools\nfrom typing import Dict\nentries: Dict[object, int] = {}\n_SPECIAL = {}\n"
           "_FLAGS = set()\n_MAY_COPY = {1, 2}\n_BY_OP = {k: 1 for k in ()}\n_listeners = []\nN = 3\n"
           "class C:\n    T = dict()\n@functools.lru_cache(maxsize=8)\ndef f(op):\n    local = {}\n")
    assert tables(src) == ["entries", "_SPECIAL", "_FLAGS", "_MAY_COPY", "_BY_OP", "T", "f()"]


def test_modules_keep_state_in_one_pattern():
    # A module's mutable state is a shardprop.mesh.state.module_state object, not a class of its own.
    import re
    bad = [m for m, p in _modules().items() if re.search(r"^class _State\b", p.read_text(), re.M)]
    assert not bad, f"modules with their own _State class (use shardprop.mesh.state.module_state): {bad}"
