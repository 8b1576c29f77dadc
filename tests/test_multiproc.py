"""Several processes on CPU (gloo), through the real entry point ``python -m recipes STAGE --config run.yaml``:

- data-parallel training (torchrun DDP, DeepSpeed ZeRO-2 and ZeRO-3 under the deepspeed launcher, and two
  "nodes" of one process each started by scripts/launch_multinode.sh on localhost) trains on exactly the data of
  one process with twice the batch, so the loss curves and final weights must agree with that process's;
- online training with the frozen target sharded across two processes (``target.shard: auto``): each holds
  about half of the target (a dense one, and a mixture of experts), and the loss curve is the one-process curve;
- regeneration split across two processes writes the same data as one process, also when killed and resumed.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import _train_worker as W
import pytest
import torch
import yaml
from safetensors.torch import load_file

from train.logging import read_metrics

pytestmark = pytest.mark.multiproc

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
STEPS = 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_config(tmp: Path, target: Path | None = None) -> Path:
    """A run config for the bigram target (a folder; or another ``target`` folder) on prepared data of
    equal-length sequences, so every micro-batch counts the same number of tokens and per-process means average to
    the global mean."""
    target = target or W.save_target_folder(tmp / "target")
    data = W.make_prepared(tmp / "data", n_train=48, n_val=8, length=24, prefix=0)
    (data / "prepare_meta.json").write_text("{}")  # what scripts/launch_multinode.sh checks is there
    config = {
        "run_dir": str(tmp / "run"),
        "target": {"name": str(target), "shard": "none"},
        "data": {"output_dir": str(data)},
        "head": {"kind": "eagle3", "draft_vocab_size": 128},
        "train": {
            "mode": "online",
            "max_steps": STEPS,
            "epochs": 10,
            "batch_size": 2,
            "grad_accum": 2,
            "lr": 3e-3,
            "warmup_steps": 2,
            "eval_every": 4,
            "save_every": 4,
            "log_every": 1,
            "progress": False,
            "max_grad_norm": 0.5,
            "bf16": False,  # fp32 everywhere: 1 and 2 processes must agree to 1e-4
        },
    }
    path = tmp / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Start the two-process runs, train the one-process reference meanwhile, then wait for them."""
    tmp = tmp_path_factory.mktemp("multiproc")
    config = _run_config(tmp)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    module = ["-m", "recipes", "train", "--config", str(config)]
    torchrun = [str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", str(_free_port())]
    deepspeed = [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(_free_port()), "--module"]
    procs = {
        "ddp": subprocess.Popen(
            [*torchrun, *module, f"train.output_dir={tmp / 'ddp'}"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        ),
        "zero2": subprocess.Popen(
            [
                *deepspeed,
                *module[1:],
                f"train.output_dir={tmp / 'zero2'}",
                f"train.deepspeed={ROOT / 'configs' / 'deepspeed' / 'zero2.json'}",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        ),
    }
    launches = {
        "zero3": [*deepspeed[:4], str(_free_port()), "--module", *module[1:], f"train.output_dir={tmp / 'zero3'}",
                  f"train.deepspeed={ROOT / 'configs' / 'deepspeed' / 'zero3.json'}", "target.shard=none"],
        "sharded": [*torchrun[:3], "--master_port", str(_free_port()), *module, f"train.output_dir={tmp / 'sharded'}",
                    "target.shard=auto"],
    }
    for name, command in launches.items():
        procs[name] = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    port = str(_free_port())
    for node in ("0", "1"):  # two "nodes" on localhost, one process each, through the multi-node launcher
        node_env = {**env, "NNODES": "2", "NODE_RANK": node, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                    "GPUS_PER_NODE": "1", "LAUNCHER": "torchrun", "CONFIG": str(config)}
        procs[f"node{node}"] = subprocess.Popen(
            ["bash", str(ROOT / "scripts" / "launch_multinode.sh"), f"train.output_dir={tmp / 'nodes'}",
             "target.shard=none"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=node_env)

    _train_one_process(config, tmp / "one")
    logs = {}
    for name, proc in procs.items():
        out, _ = proc.communicate(timeout=900)
        logs[name] = (proc.returncode, out)
    return tmp, logs


def _losses(out: Path) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in read_metrics(out / "metrics.jsonl") if e["event"] == "train"}


def _check_same_curve(tmp: Path, name: str) -> None:
    one, two = _losses(tmp / "one"), _losses(tmp / name)
    assert sorted(one) == sorted(two) == list(range(1, STEPS + 1))
    for step in one:
        assert two[step] == pytest.approx(one[step], rel=1e-4), (name, step)
    assert one[STEPS] < one[1]  # it trained
    evals = [e for e in read_metrics(tmp / name / "metrics.jsonl") if e["event"] == "eval"]
    ref = [e for e in read_metrics(tmp / "one" / "metrics.jsonl") if e["event"] == "eval"]
    assert [e["step"] for e in evals] == [4, 8]
    assert evals[-1]["val_loss"] == pytest.approx(ref[-1]["val_loss"], rel=1e-4)
    assert evals[-1]["val_tokens"] == ref[-1]["val_tokens"]  # every validation sequence counted once
    a, b = (load_file(str(tmp / d / "final" / "model.safetensors")) for d in ("one", name))
    for key in a:
        assert torch.allclose(a[key].float(), b[key].float(), atol=1e-4), key
    state = json.loads((tmp / name / "checkpoints" / "step-0000008" / "trainer_state.json").read_text())
    assert state["world_size"] == 2 and state["tokens_seen"] == STEPS * 2 * 4 * 24
    assert sorted(p.name for p in (tmp / name / "checkpoints" / "step-0000008" / "rng").iterdir()) == [
        "rank-00000.pt",
        "rank-00001.pt",
    ]


def test_ddp_two_processes_match_one(runs):
    tmp, logs = runs
    code, out = logs["ddp"]
    assert code == 0, out[-3000:]
    assert "2 process(es)" in out
    _check_same_curve(tmp, "ddp")
    assert (tmp / "ddp" / "checkpoints" / "step-0000008" / "optimizer.pt").is_file()


@pytest.mark.parametrize("stage, files", [("zero2", "*optim_states.pt"), ("zero3", "*model_states.pt")])
def test_deepspeed_two_processes_match_one(runs, stage, files):
    """ZeRO-2 writes one optimizer shard per process; ZeRO-3 also partitions the head's parameters (one model-state
    file per process)."""
    tmp, logs = runs
    code, out = logs[stage]
    assert code == 0, out[-3000:]
    assert "2 process(es) under DeepSpeed" in out
    _check_same_curve(tmp, stage)
    assert len(list((tmp / stage / "checkpoints" / "step-0000008" / "deepspeed").rglob(files))) == 2


def test_two_nodes_train_like_one_process_with_two_ranks(runs):
    tmp, logs = runs
    for node in ("node0", "node1"):
        code, out = logs[node]
        assert code == 0, out[-3000:]
    assert "node 0 of 2" in logs["node0"][1] and "node 1 of 2" in logs["node1"][1]
    _check_same_curve(tmp, "nodes")
    a, b = (load_file(str(tmp / d / "final" / "model.safetensors")) for d in ("ddp", "nodes"))
    for key in a:  # the same weights as one node with two ranks
        assert torch.allclose(a[key], b[key], atol=1e-6), key


def test_a_sharded_target_holds_half_a_copy_and_trains_the_same(runs):
    tmp, logs = runs
    code, out = logs["sharded"]
    assert code == 0, out[-3000:]
    import re

    held = re.findall(r"target sharded across 2 processes: this process holds ([\d,]+) of ([\d,]+) parameters", out)
    assert len(held) == 1, out[-3000:]
    local, whole = (int(x.replace(",", "")) for x in held[0])
    # the decoder layers are split in two, the (small) embeddings and lm_head are kept whole
    assert 0.45 * whole < local < 0.6 * whole, held
    _check_same_curve(tmp, "sharded")


def test_a_sharded_moe_target_trains_like_one_process(tmp_path):
    """The shape of configs/qwen3_30b_a3b_8gpu.yaml (online, target.shard: auto, a DDP head) with a tiny Qwen3-MoE
    target on two processes: each holds about half of it, experts included, and the loss curve is one process's."""
    import re

    from eagle.testing import family_model

    folder = tmp_path / "moe-target"
    family_model("qwen3_moe").save_pretrained(folder)
    W.save_word_tokenizer(folder)
    config = _run_config(tmp_path, folder)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    command = [str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", str(_free_port()), "-m", "recipes",
               "train", "--config", str(config), f"train.output_dir={tmp_path / 'sharded'}", "target.shard=auto"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    _train_one_process(config, tmp_path / "one")
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-3000:]
    held = re.findall(r"target sharded across 2 processes: this process holds ([\d,]+) of ([\d,]+) parameters", out)
    assert len(held) == 1, out[-3000:]
    local, whole = (int(x.replace(",", "")) for x in held[0])
    assert 0.45 * whole < local < 0.6 * whole, held
    _check_same_curve(tmp_path, "sharded")


def _train_one_process(config: Path, out: Path) -> None:
    """The one-process reference: twice the per-process batch, in this process."""
    from accelerate.state import AcceleratorState, GradientState

    from recipes.config import load_config
    from recipes.train import run as train

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train(load_config(config, [f"train.output_dir={out}", "train.batch_size=4"]))
    finally:
        torch.set_num_threads(threads)
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


def _prepare_command(config: Path, out: Path, processes: int) -> list[str]:
    stage = ["-m", "recipes", "prepare", "--config", str(config), f"data.output_dir={out}"]
    if processes == 1:
        return [sys.executable, *stage]
    return [str(BIN / "torchrun"), "--nproc_per_node", str(processes), "--master_port", str(_free_port()), *stage]


def _prepared(out: Path) -> dict:
    from datasets import load_from_disk

    return {split: load_from_disk(str(out / split)).to_dict() for split in ("train", "val")} | {
        "ids": json.loads((out / "split_ids.json").read_text())}


def test_regeneration_across_two_processes_writes_the_data_of_one_and_resumes(tmp_path, tiny_target_folder):
    """`eagle prepare` with regeneration under torchrun: each process answers every other batch of the one
    plan, so the prepared data is byte for byte the one-process data; killed after its first batches and run
    again, it answers only the rest."""
    import signal
    import time

    config = tmp_path / "prepare.yaml"
    config.write_text(yaml.safe_dump({
        "run_dir": str(tmp_path / "run"),
        "target": {"name": str(tiny_target_folder), "cpu_prepack": False},
        "data": {"sources": ["chitchat:24"], "max_conversations": 24, "regenerate": True, "regen_max_new_tokens": 6,
                 "regen_batch_size": 3, "max_length": 128, "capture_features": True},
    }))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one = subprocess.run(_prepare_command(config, tmp_path / "one", 1), env=env, capture_output=True, text=True,
                         timeout=600)
    assert one.returncode == 0, one.stdout[-2000:] + one.stderr[-2000:]
    # two processes, killed once each has answered a batch or so (a second per batch)
    two = tmp_path / "two"
    proc = subprocess.Popen(_prepare_command(config, two, 2), env={**env, "EAGLE_REGEN_SLOW": "1"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 300
    while time.time() < deadline and sum(len(p.read_text().splitlines()) for p in two.glob("regen-*.r*.jsonl")) < 6:
        time.sleep(0.5)
    # torchrun starts each worker in a session of its own: kill the whole tree, workers first
    import psutil

    for child in psutil.Process(proc.pid).children(recursive=True):
        child.kill()
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    before = {p.name: len(p.read_text().splitlines()) for p in two.glob("regen-*.r*.jsonl")}
    assert len(before) == 2 and sum(before.values()) >= 6, before  # both processes had answered
    again = subprocess.run(_prepare_command(config, two, 2), env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert "resuming with" in again.stdout + again.stderr
    assert _prepared(two) == _prepared(tmp_path / "one")
    merged = next(two.glob("regen-*.jsonl"))
    assert not list(two.glob("regen-*.r*.jsonl"))  # merged into one answers file
    assert len(merged.read_text().splitlines()) == 24
