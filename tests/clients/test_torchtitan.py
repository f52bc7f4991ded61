"""The clients tier: torchtitan 0.3.0's own trainer, torch's stack against ``python -m shardprop.launch``.

Each configuration runs ``torchtitan.train`` (debug llama3, fp32, 4 CPU gloo ranks under torchrun) twice
from one seed checkpoint: on torch's DTensor stack, then through the launcher. Both must finish, the
launched run's parameters must be shardprop's DTensors (and the plain run's torch's), and the global loss
must agree at every step within 1e-5. Where torch's own stack cannot run a configuration on this release
and CPU, the test skips with torch's error; a configuration shardprop is known not to run yet is xfail
(strict), naming what is missing.

    make test-clients                          # builds .venv-clients, runs this tier
    SHARDPROP_CLIENTS=1 pytest -m clients tests/clients -k fsdp4
"""
from __future__ import annotations

import importlib.util
import os

import pytest

from tests.clients import harness

pytestmark = [
    pytest.mark.clients,
    pytest.mark.timeout(2400),
    pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None,
                       reason="torchtitan is not installed (make test-clients builds .venv-clients)"),
]

# Configurations shardprop does not run yet: name -> what is missing (see the report).
KNOWN_GAPS = {
}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    path = os.environ.get("CLIENTS_WORKDIR") or str(tmp_path_factory.mktemp("torchtitan"))
    os.makedirs(path, exist_ok=True)
    return path


@pytest.mark.parametrize("name", list(harness.CONFIGS))
def test_torchtitan_losses_match(workdir, name, request):
    if name in KNOWN_GAPS:
        request.applymarker(pytest.mark.xfail(reason=KNOWN_GAPS[name], strict=True))
    path = workdir
    config = harness.CONFIGS[name]
    seed = harness.prepare(path, config=config)
    ours = harness.run(config, "shardprop", path, seed)
    if harness.aborted_after_training(ours, config):
        # A known intermittent abort at process exit, after every step and the process group's teardown
        # (about one launched run in thirty): reported, and the run repeated once; a second one fails.
        print(f"\nWARNING: {name}: shardprop's run aborted after training completed ({ours.error}); running again")
        ours = harness.run(config, "shardprop", path, seed)
    reference = harness.run(config, "torch", path, seed)
    print(harness.row(name, reference, ours))
    if not reference.ok:
        pytest.skip(f"torch's stack fails {name}: {reference.error}")
    assert ours.ok, f"shardprop fails {name}: {ours.error} (log: {ours.log})"
    assert reference.parameter_types and all(t.startswith("torch.") for t in reference.parameter_types), \
        reference.parameter_types
    assert any(t.startswith("shardprop.") for t in ours.parameter_types), \
        f"the launched run did not train shardprop's DTensors: {ours.parameter_types}"
    assert len(ours.steps) == config.steps, ours.steps
    problems = harness.compare(reference, ours, atol=config.atol, grad_rtol=config.grad_rtol)
    assert not problems, "\n".join(problems)


def test_compare_catches_a_difference():
    """The comparison this tier rests on fails when one step's loss moves by more than 1e-5."""
    steps = [{"step": i, "loss": 8.0 - 0.1 * i, "grad_norm": 0.6 + 0.1 * i, "tps": 100.0} for i in range(1, 5)]
    a = harness.Result("torch", "x", 0, 1.0, steps=steps)
    moved = [dict(s) for s in steps]
    moved[2]["loss"] += 2e-5
    assert harness.compare(a, harness.Result("shardprop", "x", 0, 1.0, steps=list(steps))) == []
    assert harness.compare(a, harness.Result("shardprop", "x", 0, 1.0, steps=moved)) == [
        f"step 3: torch loss {steps[2]['loss']!r} vs shardprop {moved[2]['loss']!r}"]
    assert harness.compare(a, harness.Result("shardprop", "x", 0, 1.0, steps=steps[:3]))
    moved = [dict(s) for s in steps]
    moved[0]["grad_norm"] *= 1.001
    assert len(harness.compare(a, harness.Result("shardprop", "x", 0, 1.0, steps=moved))) == 1
