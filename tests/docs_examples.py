"""The docs' examples, found and run: the public names, their docstrings, the reference pages' entries.

What counts as public: the ``__all__`` of each module in ``PUBLIC_MODULES`` (the names users import).
How an example runs (the convention ``docs/api/index.md`` documents): each docstring's ``>>>`` lines are one
doctest, run on every rank of the calling rank-pool job, in a fresh namespace holding ``torch``, ``nn``, ``F``,
``dist``, ``shardprop``, every name of ``shardprop.__all__`` and the names of the public module the docstring
belongs to (as its own docs read, e.g. ``get`` in ``shardprop.config``). ``# doctest: +SKIP`` lines are shown
but not run. Rank 0 must print what the example shows, every other rank must run it without an exception; the
settings are restored after each docstring.

Imports of torch and shardprop happen inside functions: rank-pool workers import this module before they set
their environment (``tests/rankpool.py``).
"""
import ast
import doctest
import importlib
import inspect
import io
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
PUBLIC_MODULES = ("shardprop", "shardprop.mesh", "shardprop.config", "shardprop.experimental", "shardprop.launch",
                  "shardprop.mesh.functional_collectives")
# ``NAME # doctest: +SKIP`` flags as doctest reads them; the parser is doctest's own.
_PARSER = doctest.DocTestParser()


def public_names():
    """``[(module name, name, object)]`` for every public name, in ``__all__`` order."""
    out = []
    for mod_name in PUBLIC_MODULES:
        mod = importlib.import_module(mod_name)
        for name in mod.__all__:
            out.append((mod_name, name, getattr(mod, name)))
    return out


def _attribute_doc(mod_name, name, seen=()):
    """The docstring of a module attribute (the string right after its assignment), following re-exports."""
    mod = importlib.import_module(mod_name)
    tree = ast.parse(inspect.getsource(mod))
    body = tree.body
    for i, node in enumerate(body):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            nxt = body[i + 1] if i + 1 < len(body) else None
            if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                return inspect.cleandoc(nxt.value.value)
            return None
        if isinstance(node, ast.ImportFrom) and node.module and any(a.name == name for a in node.names):
            if node.module not in seen:
                return _attribute_doc(node.module, name, seen + (mod_name,))
    return None


def docstring(mod_name, name, obj):
    """The docstring users read for ``mod_name.name``: the object's own, or the attribute's for data."""
    if inspect.isclass(obj) or inspect.isroutine(obj) or inspect.ismodule(obj):
        return inspect.getdoc(obj)
    return _attribute_doc(mod_name, name)


def examples(doc):
    """The doctest examples of a docstring, and how many of them run (not ``+SKIP``)."""
    exs = _PARSER.get_examples(doc or "")
    return exs, sum(1 for e in exs if not e.options.get(doctest.SKIP))


def documented_objects():
    """``{id(object): 'page.md'}`` for what the API pages document with ``::: path`` (a module entry covers its
    ``__all__``, or the ``members:`` list its options give; ``members: false`` none)."""
    out = {}
    for page in sorted((ROOT / "docs" / "api").glob("*.md")):
        lines = page.read_text().split("\n")
        for i, line in enumerate(lines):
            m = re.match(r"^::: ([\w.]+)\s*$", line)
            if not m:
                continue
            obj = _resolve(m.group(1))
            out[id(obj)] = page.name
            if inspect.ismodule(obj):
                members = getattr(obj, "__all__", [])
                for opt in lines[i + 1:i + 8]:
                    if not opt.startswith(" "):
                        break
                    mm = re.match(r"^\s+members:\s*(.*)$", opt)
                    if mm:
                        members = [] if mm.group(1).strip() == "false" else re.findall(r"\w+", mm.group(1))
                for member in members:
                    out[id(getattr(obj, member))] = page.name
    return out


def _resolve(path):
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(path)


def namespace(mod_name):
    """The names an example of ``mod_name`` starts with."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F

    import shardprop
    glob = {"torch": torch, "nn": nn, "F": F, "dist": dist, "shardprop": shardprop}
    glob.update({n: getattr(shardprop, n) for n in shardprop.__all__})
    mod = importlib.import_module(mod_name)
    glob.update({n: getattr(mod, n) for n in getattr(mod, "__all__", ())})
    return glob


class _AnyOutput(doctest.OutputChecker):
    """Ranks other than 0 may print what they like (their shard, nothing); an exception still fails them."""

    def check_output(self, want, got, optionflags):
        return True


def run_docstring(label, doc, mod_name):
    """Run one docstring's examples here; returns ``(failed, tried, report)``.

    Rank 0 (or a process outside a process group) must print what the examples show; the other ranks must run
    them without an exception they do not show.
    """
    import torch.distributed as dist

    from shardprop import config
    test = _PARSER.get_doctest(doc, namespace(mod_name), label, None, 0)
    out = io.StringIO()
    checker = _AnyOutput() if dist.is_initialized() and dist.get_rank() != 0 else None
    runner = doctest.DocTestRunner(checker=checker, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    # An example that changes a setting must not change the next one's world (nor the next test's).
    with config.patch(**{s.name: getattr(config.values, s.name) for s in config.SETTINGS}):
        runner.run(test, out=out.write, clear_globs=True)
    return runner.failures, runner.tries, out.getvalue()


def run_all_docstrings(extra=(), public=True):
    """Rank-pool job: every public docstring's examples (unless not ``public``) and ``extra`` (``(label, doc,
    module)``), on this rank. Returns ``{label: (failed, tried, report)}`` for those with an example that runs.
    """
    items = [(f"{m}.{n}", docstring(m, n, o), m) for m, n, o in public_names()] if public else []
    results = {}
    for label, doc, mod_name in list(items) + list(extra):
        if examples(doc)[1]:
            results[label] = run_docstring(label, doc, mod_name)
    return results


def run_program(path):
    """Rank-pool job: run a complete program of ``docs/examples/`` as ``python PATH`` would; returns its stdout."""
    import contextlib
    import runpy
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        runpy.run_path(str(path), run_name="__main__")
    return out.getvalue()
