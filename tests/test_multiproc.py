"""Data parallel training on CPU: two gloo processes (torchrun DDP, and DeepSpeed ZeRO-2 under the deepspeed
launcher) train on exactly the data of one process with twice the batch, so their loss curves must agree.

Both launches go through the real entry point, ``python -m train.trainer --config run.yaml key=value``, and run
at the same time as the one-process reference (they are mostly start-up time)."""

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


def _run_config(tmp: Path) -> Path:
    """A run config for the bigram target (a folder) on prepared data of equal-length sequences, so every
    micro-batch counts the same number of tokens and per-process means average to the global mean."""
    target = W.save_target_folder(tmp / "target")
    data = W.make_prepared(tmp / "data", n_train=48, n_val=8, length=24, prefix=0)
    config = {
        "run_dir": str(tmp / "run"),
        "target": {"name": str(target)},
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
    module = ["-m", "train.trainer", "--config", str(config)]
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

    from accelerate.state import AcceleratorState, GradientState

    from train.config import load_config
    from train.trainer import train

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train(load_config(config, [f"train.output_dir={tmp / 'one'}", "train.batch_size=4"]))
    finally:
        torch.set_num_threads(threads)
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    logs = {}
    for name, proc in procs.items():
        out, _ = proc.communicate(timeout=300)
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


def test_deepspeed_zero2_two_processes_match_one(runs):
    tmp, logs = runs
    code, out = logs["zero2"]
    assert code == 0, out[-3000:]
    assert "2 process(es) under DeepSpeed" in out
    _check_same_curve(tmp, "zero2")
    shards = list((tmp / "zero2" / "checkpoints" / "step-0000008" / "deepspeed").rglob("*optim_states.pt"))
    assert len(shards) == 2  # ZeRO-2: one optimizer shard per process
