"""The docs: every public name has a docstring with an example and an entry in the API reference; the examples
run (docstrings on 4 gloo ranks, the complete programs of ``docs/examples/`` too); the README's links resolve.

The convention the examples follow is ``docs/api/index.md``'s ("The examples"); ``tests/docs_examples.py`` finds
and runs them. ``make docs`` builds the site itself (strictly: a broken link in ``docs/`` fails there).
"""
import pathlib
import re

import pytest

from tests import docs_examples as dx
from tests.rankpool import run_on_ranks

pytestmark = pytest.mark.timeout(400)

ROOT = dx.ROOT
WORLD = 4

# Public names whose examples are all fragments of a larger program (``# doctest: +SKIP``: they name the user's
# model, optimizer or a GPU). The list only shrinks: a name given an example that runs must leave it (the test
# below fails otherwise), and a new public name needs an example that runs.
FRAGMENTS_ONLY = {
    "shardprop.register_sharding",        # defines a custom op (runs once per process); the guide's program runs
    "shardprop.unregister_sharding",      # the running example is shardprop.experimental.register_sharding's
    "shardprop.UnshardHandle",            # handles of a multi-block model's fully_shard
    "shardprop.GradientReductionHandle",
    "shardprop.HFExperts",                # transformers models (tests/test_hf_plans.py runs them)
    "shardprop.parallelize_hf",
    "shardprop.calibrate",                # spawns its own ranks and times collectives for seconds (release tier runs it)
}


@pytest.fixture(scope="module")
def names():
    return dx.public_names()


def test_public_names_are_found(names):
    # The walk itself: it must see the names users import first (a broken walk would pass everything below).
    found = {f"{m}.{n}" for m, n, _ in names}
    for expected in ("shardprop.DTensor", "shardprop.fully_shard", "shardprop.mesh.all_gather",
                     "shardprop.config.patch", "shardprop.launch.main"):
        assert expected in found
    assert len(found) > 100


def test_every_public_name_has_a_docstring_with_an_example(names):
    bad = []
    for mod_name, name, obj in names:
        doc = dx.docstring(mod_name, name, obj)
        if not doc:
            bad.append(f"{mod_name}.{name}: no docstring")
        elif not dx.examples(doc)[0]:
            bad.append(f"{mod_name}.{name}: no example (a '>>>' doctest under 'Example:')")
    assert not bad, "\n".join(bad)


def test_every_public_name_is_in_the_api_reference(names):
    documented = dx.documented_objects()
    missing = [f"{m}.{n}" for m, n, obj in names if id(obj) not in documented]
    assert not missing, "not on any docs/api/*.md page (add a '::: shardprop.NAME' entry): " + ", ".join(missing)


def test_fragments_only_list_is_exact(names):
    # A public name whose examples all skip must be listed; a listed name must still have no running example.
    only_fragments = set()
    for mod_name, name, obj in names:
        exs, running = dx.examples(dx.docstring(mod_name, name, obj))
        if exs and not running:
            only_fragments.add(f"{mod_name}.{name}")
    assert only_fragments - FRAGMENTS_ONLY == set(), "give these an example that runs (see docs/api/index.md)"
    assert FRAGMENTS_ONLY - only_fragments == set(), "these have an example that runs now: drop them from the list"


def test_docstring_examples_run(names):
    results = run_on_ranks(WORLD, dx.run_all_docstrings, timeout=360)
    expected = {f"{m}.{n}" for m, n, obj in names if dx.examples(dx.docstring(m, n, obj))[1]}
    assert set(results[0]) == expected and expected  # every docstring with an example that runs, ran
    failures = [f"rank {rank}: {report}" for rank, per_rank in enumerate(results)
                for failed, _, report in per_rank.values() if failed]
    assert not failures, "\n".join(failures[:8])


# A docstring whose example is wrong twice over: a wrong expected output, and a name that does not exist.
_BROKEN = '''Broken on purpose.

Example:
    >>> x = distribute_tensor(torch.ones(8), init_device_mesh("cpu", (4,)), [Shard(0)])
    >>> x.to_local()
    tensor([1., 1., 1.])
    >>> shardprop.no_such_function()
'''


def test_a_broken_example_fails():
    # The runner must catch what it is there to catch, on every rank.
    results = run_on_ranks(WORLD, dx.run_all_docstrings, [("canary", _BROKEN, "shardprop")], False, timeout=360)
    failed, tried, report = results[0]["canary"]          # rank 0 checks the output too
    assert (failed, tried) == (2, 3)
    assert "Expected:" in report and "AttributeError" in report
    for per_rank in results[1:]:                          # the others: the exception
        failed, tried, report = per_rank["canary"]
        assert (failed, tried) == (1, 3) and "AttributeError" in report


EXAMPLES = sorted((ROOT / "docs" / "examples").glob("*.py"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_docs_example_program_runs(path):
    outputs = run_on_ranks(WORLD, dx.run_program, path, timeout=300)
    assert outputs[0], "the program printed nothing on rank 0"


def test_docs_example_programs_are_shown():
    # Each program under docs/examples/ is included in a page (pymdownx.snippets), so what runs is what readers see.
    pages = "\n".join(p.read_text() for p in (ROOT / "docs").rglob("*.md"))
    assert EXAMPLES
    for path in EXAMPLES:
        assert f'--8<-- "docs/examples/{path.name}"' in pages, f"{path.name} is in no page"


def test_readme_links_resolve():
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if "://" not in link]
    assert any(link.startswith("docs/") for link in local), "the README links into the docs"
    missing = [link for link in local if not (ROOT / link).exists()]
    assert not missing, f"README links to missing files: {missing}"
