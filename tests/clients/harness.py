"""Run torchtitan's trainer on 4 CPU gloo ranks on torch's stack and through ``python -m shardprop.launch``.

Both runs start from one seed checkpoint (torchtitan's ``--checkpoint.create-seed-checkpoint``, written on
torch's stack by one rank and loaded by both with ``--checkpoint.initial-load-path``): torch's DTensor on CPU
draws each shard's initial values from the same local generator, so a 4-rank initialisation is not the
1-rank one and the two stacks' random initialisations cannot be compared. The rest is as torchtitan runs:
the debug llama3, fp32 (``--training.mixed-precision-param float32``), the ``partial_dtensor`` backend.

    python tests/clients/harness.py [CONFIG ...]      # runs the configurations, prints the table
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
LAUNCH = os.path.join(HERE, "cpu_launch.py")

# torchtitan's CLI (torchtitan/config/manager.py: --module/--config, then tyro over Trainer.Config)
BASE = ["--training.seq-len", "128", "--training.local-batch-size", "2",
        "--training.mixed-precision-param", "float32", "--training.dtype", "float32",
        "--parallelism.spmd-backend", "partial_dtensor", "--debug.seed", "42",
        "--metrics.log-freq", "1"]


@dataclass
class Config:
    name: str
    args: List[str]
    world: int = 4
    steps: int = 6
    # torch's stack runs these instead where it cannot be the reference for ``args`` on this release
    reference_args: Optional[List[str]] = None
    why_reference: str = ""
    module: str = "llama3"
    config: str = "llama3_debugmodel"
    # Resharded resume: train ``resume_at`` steps with ``args`` and save a full checkpoint, then resume it
    # with these arguments (another layout) up to ``steps``.
    resume_args: Optional[List[str]] = None
    resume_at: int = 3
    # what "equal" means: the 1e-5 in fp32; bf16 compute (fp32 master weights) within 5e-4
    atol: float = 1e-5
    grad_rtol: float = 1e-4

    @property
    def model(self) -> List[str]:
        return ["--module", self.module, "--config", self.config]


# Order of the issue: FSDP, TP x FSDP, + selective AC, + full AC, HSDP, then compile, PP, CP.
# The activation-checkpoint mode is a tyro subcommand and goes last.
CONFIGS: Dict[str, Config] = {c.name: c for c in [
    Config("fsdp4", ["--parallelism.data-parallel-shard-degree", "4", "activation-checkpoint:none"]),
    Config("tp2_fsdp2", ["--parallelism.data-parallel-shard-degree", "2", "--parallelism.tensor-parallel-degree", "2",
                         "activation-checkpoint:none"]),
    Config("tp2_fsdp2_sac", ["--parallelism.data-parallel-shard-degree", "2",
                             "--parallelism.tensor-parallel-degree", "2", "activation-checkpoint:selective"]),
    Config("tp2_fsdp2_fullac", ["--parallelism.data-parallel-shard-degree", "2",
                                "--parallelism.tensor-parallel-degree", "2", "activation-checkpoint:full"]),
    Config("fsdp4_bf16", ["--parallelism.data-parallel-shard-degree", "4", "--training.mixed-precision-param",
                          "bfloat16", "activation-checkpoint:none"], atol=5e-4, grad_rtol=5e-3),
    Config("tp2_fsdp2_bf16", ["--parallelism.data-parallel-shard-degree", "2",
                              "--parallelism.tensor-parallel-degree", "2", "--training.mixed-precision-param",
                              "bfloat16", "activation-checkpoint:none"], atol=5e-4, grad_rtol=5e-3),
    Config("hsdp2x2", ["--parallelism.data-parallel-replicate-degree", "2",
                       "--parallelism.data-parallel-shard-degree", "2", "activation-checkpoint:none"]),
    # torch 2.13's stack trains full_dtensor as partial_dtensor does (the same grad norm at every step) but logs
    # world-size x the loss: its loss DTensor is Replicate, which torchtitan's _dist_reduce_tensor
    # (distributed/utils.py:117) takes to_local and sums over the loss mesh (trainer.py:977). The reference is
    # therefore torch's partial_dtensor run of the same mesh.
    Config("fsdp4_full_dtensor", ["--parallelism.data-parallel-shard-degree", "4",
                                  "--parallelism.spmd-backend", "full_dtensor", "activation-checkpoint:none"],
           reference_args=["--parallelism.data-parallel-shard-degree", "4", "activation-checkpoint:none"],
           why_reference="torch 2.13 logs world-size x the loss under full_dtensor"),
    # torchtitan's default backend: spmd_types' own placements and redistributions over our meshes
    # torch 2.13's fully_shard refuses spmd_types' annotated plain parameters under dp_mesh_dims ("all parameters
    # must be DTensors on the full SPMD mesh"; 2.15 reads the annotations): the reference is torch's
    # partial_dtensor run of the same mesh, the same computation.
    Config("fsdp4_spmd_types", ["--parallelism.data-parallel-shard-degree", "4",
                                "--parallelism.spmd-backend", "spmd_types", "activation-checkpoint:none"],
           reference_args=["--parallelism.data-parallel-shard-degree", "4", "activation-checkpoint:none"],
           why_reference="torch 2.13's fully_shard refuses spmd_types' plain parameters"),
    Config("tp2_fsdp2_spmd_types", ["--parallelism.data-parallel-shard-degree", "2",
                                    "--parallelism.tensor-parallel-degree", "2",
                                    "--parallelism.spmd-backend", "spmd_types", "activation-checkpoint:none"],
           reference_args=["--parallelism.data-parallel-shard-degree", "2", "--parallelism.tensor-parallel-degree",
                           "2", "activation-checkpoint:none"],
           why_reference="torch 2.13's fully_shard refuses spmd_types' plain parameters"),
    Config("fsdp4_compile", ["--parallelism.data-parallel-shard-degree", "4", "--compile.enable",
                             "--compile.backend", "aot_eager", "--compile.components", "model",
                             "activation-checkpoint:none"]),
    Config("tp2_fsdp2_compile", ["--parallelism.data-parallel-shard-degree", "2",
                                 "--parallelism.tensor-parallel-degree", "2", "--compile.enable",
                                 "--compile.backend", "aot_eager", "--compile.components", "model",
                                 "activation-checkpoint:none"]),
    Config("pp2_fsdp2", ["--parallelism.pipeline-parallel-degree", "2", "--parallelism.data-parallel-shard-degree",
                         "2", "--parallelism.pipeline-parallel-schedule", "1F1B", "--training.disable-cuda-graphs",
                         "activation-checkpoint:none"]),
    # CP with flex attention needs seq_len divisible by 2 * cp * the BlockMask's 128 (the later flag wins)
    Config("moe_fsdp4", ["--parallelism.data-parallel-shard-degree", "4", "--training.disable-cuda-graphs",
                         "activation-checkpoint:none"], module="deepseek_v3", config="deepseek_v3_debugmodel"),
    Config("moe_ep2_fsdp4", ["--parallelism.data-parallel-shard-degree", "4", "--parallelism.expert-parallel-degree",
                             "2", "--training.disable-cuda-graphs", "activation-checkpoint:none"], module="deepseek_v3", config="deepseek_v3_debugmodel"),
    Config("resume_fsdp4_to_hsdp2x2", ["--parallelism.data-parallel-shard-degree", "4",
                                       "activation-checkpoint:none"],
           resume_args=["--parallelism.data-parallel-replicate-degree", "2",
                        "--parallelism.data-parallel-shard-degree", "2", "activation-checkpoint:none"]),
    Config("resume_tp2_fsdp2_to_fsdp4", ["--parallelism.data-parallel-shard-degree", "2",
                                         "--parallelism.tensor-parallel-degree", "2", "activation-checkpoint:none"],
           # the data loader's state is kept per dp rank, and dp grows from 2 to 4 (on either stack)
           resume_args=["--parallelism.data-parallel-shard-degree", "4", "--checkpoint.exclude-from-loading",
                        "dataloader", "activation-checkpoint:none"]),
    Config("cp2_fsdp2", ["--parallelism.context-parallel-degree", "2", "--parallelism.data-parallel-shard-degree",
                         "2", "--training.seq-len", "512", "--parallelism.context-parallel-load-balancer", "ptrr",
                         "activation-checkpoint:none"]),
    # the same with torchtitan's other balancer: head-tail chunks, flex attention over all-gathered K/V
    Config("cp2_fsdp2_headtail", ["--parallelism.context-parallel-degree", "2",
                                  "--parallelism.data-parallel-shard-degree", "2", "--training.seq-len", "512",
                                  "--parallelism.context-parallel-load-balancer", "headtail",
                                  "activation-checkpoint:none"]),
    # CP with the model's blocks compiled: flex_cp_allgather is one opaque custom op in the graph
    Config("cp2_fsdp2_compile", ["--parallelism.context-parallel-degree", "2",
                                 "--parallelism.data-parallel-shard-degree", "2", "--training.seq-len", "512",
                                 "--parallelism.context-parallel-load-balancer", "ptrr", "--compile.enable",
                                 "--compile.backend", "aot_eager", "--compile.components", "model",
                                 "activation-checkpoint:none"]),
]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def environment(workdir: str) -> Dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
               HF_DATASETS_CACHE=os.path.join(workdir, "hf_cache"), PYTHONUNBUFFERED="1")
    return env


def prepare(workdir: str, python: str = sys.executable, timeout: int = 600, config: Optional[Config] = None) -> str:
    """Assets and the seed checkpoint of ``config``'s model (default: the debug llama3) under ``workdir``;
    returns the checkpoint's path."""
    sys.path.insert(0, HERE)
    from assets import make_assets

    config = config or next(iter(CONFIGS.values()))
    if not os.path.exists(os.path.join(workdir, "tests", "assets", "tokenizer", "tokenizer.json")):
        make_assets(workdir)
    seed = os.path.join(workdir, "seed" if config.config == "llama3_debugmodel" else f"seed_{config.config}")
    step0 = os.path.join(seed, "step-0")
    if os.path.exists(os.path.join(step0, ".metadata")):
        return step0
    cmd = [python, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port", str(free_port()), LAUNCH,
           *config.model, *BASE, "--parallelism.data-parallel-shard-degree", "1", "--checkpoint.enable",
           "--checkpoint.create-seed-checkpoint", "--checkpoint.folder", seed,
           "--dump-folder", os.path.join(workdir, "out_seed"), "activation-checkpoint:none"]
    with open(os.path.join(workdir, f"log_seed_{config.config}.txt"), "w") as log:
        subprocess.run(cmd, cwd=workdir, env=environment(workdir), stdout=log, stderr=subprocess.STDOUT,
                       timeout=timeout, check=True)
    return step0


@dataclass
class Result:
    stack: str
    config: str
    rc: int
    seconds: float
    steps: List[dict] = field(default_factory=list)
    parameter_types: List[str] = field(default_factory=list)
    error: str = ""
    log: str = ""

    @property
    def ok(self) -> bool:
        return self.rc == 0 and bool(self.steps)

    def losses(self) -> List[float]:
        return [s["loss"] for s in self.steps]

    def median_tps(self, skip: int = 2) -> Optional[float]:
        later = [s["tps"] for s in self.steps[skip:]] or [s["tps"] for s in self.steps]
        return statistics.median(later) if later else None


def first_error(log_text: str) -> str:
    """The first rank's exception line and the frame above it (where it comes from), else how a rank died."""
    lines = log_text.splitlines()
    in_traceback = False
    for i, line in enumerate(lines):
        if not line.startswith("[rank"):
            continue
        body = line.split("]: ", 1)[-1]
        if body.startswith("Traceback (most recent call last)"):
            in_traceback = True
            continue
        # the exception line: the first unindented ``dotted.Name: message`` after a traceback's frames
        if in_traceback and re.match(r"[A-Za-z_][\w.]*(: |$)", body):
            frames = [l.split("]: ", 1)[-1].strip() for l in lines[max(0, i - 12):i] if 'File "' in l]
            return (frames[-1] + " :: " if frames else "") + body.strip()
    for line in lines:
        if "Error parsing Config" in line:  # tyro's box
            return line.strip(" │")
    for i, line in enumerate(lines):
        if line.startswith(("terminate called", "Fatal Python error")):
            died = [l for l in lines[i:] if "failed (exitcode" in l]
            last = [l for l in lines[:i] if l.startswith("[titan]")][-1:]
            return f"{line.strip()} ({died[0].split('] ', 1)[-1] if died else 'a rank aborted'}; " \
                   f"last log line before it: {last[0].split(' - ')[-1].strip() if last else '-'})"
    return ""


def run(config: Config, stack: str, workdir: str, seed_ckpt: str, python: str = sys.executable,
        timeout: int = 900) -> Result:
    """One torchrun of torchtitan's trainer: ``stack`` is ``torch`` or ``shardprop`` (through the launcher)."""
    tag = f"{config.name}_{stack}"
    record = os.path.join(workdir, f"rec_{tag}.jsonl")
    log_path = os.path.join(workdir, f"log_{tag}.txt")
    if os.path.exists(record):
        os.remove(record)
    launcher = ["-m", "shardprop.launch"] if stack == "shardprop" else []
    head = [python, "-m", "torch.distributed.run", "--nproc-per-node", str(config.world),
            "--master-port", str(free_port()), *launcher, LAUNCH, *config.model, *BASE,
            "--checkpoint.enable", "--checkpoint.initial-load-path", seed_ckpt,
            "--checkpoint.folder", os.path.join(workdir, f"ckpt_{tag}"),
            "--dump-folder", os.path.join(workdir, f"out_{tag}")]
    args = config.reference_args if stack == "torch" and config.reference_args is not None else config.args
    if config.resume_args is None:
        phases = [[*head, "--training.steps", str(config.steps), "--checkpoint.load-only", *args]]
    else:  # save a full checkpoint (model, optimizer, data loader) at resume_at, then resume at another layout
        shutil.rmtree(os.path.join(workdir, f"ckpt_{tag}"), ignore_errors=True)
        phases = [[*head, "--training.steps", str(config.resume_at), "--checkpoint.interval", str(config.resume_at),
                   "--checkpoint.no-last-save-model-only", *args],
                  [*head, "--training.steps", str(config.steps), "--checkpoint.load-only", *config.resume_args]]
    env = environment(workdir)
    env["CLIENTS_RECORD"] = record
    start = time.perf_counter()
    rc = 0
    with open(log_path, "w") as log:
        for cmd in phases:
            try:
                rc = subprocess.run(cmd, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    timeout=timeout).returncode
            except subprocess.TimeoutExpired:
                rc = 124
            if rc:
                break
    result = Result(stack, config.name, rc, time.perf_counter() - start, log=log_path)
    if os.path.exists(record):
        for line in open(record):
            entry = json.loads(line)
            if "parameter_types" in entry:
                result.parameter_types = entry["parameter_types"]
            else:
                result.steps.append(entry)
    if rc != 0:
        result.error = first_error(open(log_path).read()) or f"exit code {rc} (see {log_path})"
    return result


def aborted_after_training(result: Result, config: Config) -> bool:
    """Whether a run logged every step and then died at exit ("terminate called ..." after torchtitan's
    "Process group destroyed"): the losses are all there; the crash is at process teardown."""
    if result.ok or len(result.steps) != config.steps or not result.error.startswith("terminate called"):
        return False
    return "Process group destroyed" in result.error


def compare(a: Result, b: Result, atol: float = 1e-5, grad_rtol: float = 1e-4) -> List[str]:
    """Step-by-step differences: losses beyond ``atol``, grad norms beyond ``grad_rtol`` (relative), missing steps."""
    problems = []
    if len(a.steps) != len(b.steps):
        problems.append(f"{a.stack} logged {len(a.steps)} steps, {b.stack} {len(b.steps)}")
    for x, y in zip(a.steps, b.steps):
        if x["step"] != y["step"] or abs(x["loss"] - y["loss"]) > atol:
            problems.append(f"step {x['step']}: {a.stack} loss {x['loss']!r} vs {b.stack} {y['loss']!r}")
        if abs(x["grad_norm"] - y["grad_norm"]) > grad_rtol * max(abs(x["grad_norm"]), 1e-12):
            problems.append(f"step {x['step']}: {a.stack} grad norm {x['grad_norm']!r} vs {b.stack} {y['grad_norm']!r}")
    return problems


def row(config: str, torch_r: Result, sp_r: Result) -> str:
    def cell(r):
        if not r.ok:
            return f"FAILED: {r.error}"
        return f"ok, {len(r.steps)} steps, median tps {r.median_tps():.0f}"
    if torch_r.ok and sp_r.ok:
        c = CONFIGS.get(config)
        diffs = compare(torch_r, sp_r, c.atol, c.grad_rtol) if c else compare(torch_r, sp_r)
        worst = max(abs(x["loss"] - y["loss"]) for x, y in zip(torch_r.steps, sp_r.steps))
        verdict = "losses equal (max |diff| %.1e)" % worst if not diffs else "LOSSES DIFFER: " + "; ".join(diffs[:2])
    else:
        verdict = "-"
    return f"| {config} | {cell(torch_r)} | {cell(sp_r)} | {verdict} |"


def main(argv: Sequence[str]) -> int:
    names = list(argv) or list(CONFIGS)
    workdir = os.environ.get("CLIENTS_WORKDIR") or os.path.join("/tmp", f"shardprop-clients-{os.getpid()}")
    os.makedirs(workdir, exist_ok=True)
    rows = []
    for name in names:
        seed = prepare(workdir, config=CONFIGS[name])
        results = [run(CONFIGS[name], stack, workdir, seed) for stack in ("torch", "shardprop")]
        rows.append(row(name, *results))
        print(rows[-1], flush=True)
        for r in results:
            print(f"    {r.stack}: rc={r.rc} {r.seconds:.0f}s params={r.parameter_types} losses={r.losses()}",
                  flush=True)
    print("\n| config | torch's stack | shardprop | losses |\n| --- | --- | --- | --- |")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
