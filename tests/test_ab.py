"""``bench/ab.py``: another commit's shardprop imported from its own tree, and a short A/B that runs.

The A/B is how "no slower than before" is measured (issue 32), so its plumbing is checked: the
overlay must import every subpackage from the tree it was built from (not from the editable
install of this checkout), and a one-round A/B of the dispatch job must report both sides.
"""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

needs_git = pytest.mark.skipif(not os.path.exists(os.path.join(ROOT, ".git")),  # a folder, or a file in a worktree
                               reason="bench/ab.py exports commits with git archive: needs a git checkout")


@needs_git
def test_overlay_imports_every_subpackage_from_its_tree(tmp_path):
    import ab
    tree = ab.export("HEAD", str(tmp_path / "tree"))
    pkg = ab.overlay(tree, str(tmp_path / "pkg"))
    code = ("import shardprop, shardprop.mesh, shardprop.ops, shardprop.tensor.spec as s; "
            "print(shardprop.__file__); print(shardprop.mesh.__file__); print(shardprop.ops.__file__); "
            "print(s.__file__)")
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=pkg), cwd=str(tmp_path),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    files = out.stdout.split()
    assert len(files) == 4
    for f in files:
        assert f.startswith(pkg + os.sep), f"{f} was not imported from the overlay {pkg}"
        assert os.path.realpath(f).startswith(os.path.realpath(tree) + os.sep)
    # ops/ and mesh/ sit at the top of the tree and install under shardprop.*
    assert os.path.realpath(files[1]) == os.path.realpath(os.path.join(tree, "mesh", "__init__.py"))
    assert os.path.realpath(files[2]) == os.path.realpath(os.path.join(tree, "ops", "__init__.py"))


@needs_git
def test_one_round_of_the_dispatch_job_reports_both_sides(tmp_path):
    out_json = tmp_path / "ab.json"
    run = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "ab.py"), "--base", "HEAD", "--jobs",
                          "dispatch", "--sets", "1", "--rounds", "2", "--json", str(out_json)],
                         capture_output=True, text=True, timeout=240, cwd=str(tmp_path))
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert "this/base" in run.stdout
    res = json.loads(out_json.read_text())
    (one_set,) = res["samples"]["dispatch"]
    assert set(one_set) == {"base", "this"}
    import dispatch
    cases = set(dispatch._cases())
    for side in ("base", "this"):
        assert set(one_set[side]) == cases
        for name, samples in one_set[side].items():
            assert len(samples) == 2, (side, name)
            # an overhead is DTensor time minus local time: a few microseconds or more, never absurd
            assert all(-50.0 < s < 5e4 for s in samples), (side, name, samples)
