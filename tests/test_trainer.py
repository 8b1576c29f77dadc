"""The trainer on a tiny "bigram" target (see tests/_train_worker.py): learning, offline vs online, exact
kill-and-resume, checkpoint pruning, the draft vocabulary on resume, bad inputs and the report_to backends."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import _train_worker as W
import pytest
import torch
from safetensors.torch import load_file

from eagle.errors import EagleError
from eagle.heads import HeadConfig
from train import checkpoint as ck
from train.batching import collate, plan_epoch, plan_eval, rank_slice
from train.logging import read_metrics
from train.trainer import TrainConfig, train

ROOT = Path(__file__).resolve().parent.parent


pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")  # tests build Accelerators


def cfg(out: Path, **kw) -> TrainConfig:
    base = dict(
        output_dir=str(out),
        epochs=100,
        batch_size=8,
        lr=3e-3,
        warmup_steps=5,
        log_every=1,
        eval_every=0,
        save_every=1000,
        progress=False,
        bf16=False,  # fp32 on every CPU, so that exact comparisons hold; bf16 has its own test
    )
    base.update(kw)
    return TrainConfig(**base)


def losses(out: Path) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in read_metrics(out / "metrics.jsonl") if e["event"] == "train"}


def test_offline_training_learns_the_target(tmp_path, bigram_data, bigram_target):
    prepared, features = bigram_data
    out = tmp_path / "run"
    (out / "best").mkdir(parents=True)  # an earlier run's (train.keep_best): a fresh start removes it
    result = train(
        target=bigram_target,
        features_dir=features,
        head=HeadConfig(draft_vocab_size=256),
        cfg=cfg(out, max_steps=150, eval_every=50, save_every=50, keep_last=2, log_every=10),
    )
    # chance is 1/256 and the most common target token covers <5% of positions; the head gets ~93%
    assert result.global_step == 150
    assert result.val_metrics["val_acc"] > 0.8, result.val_metrics
    assert min(result.val_metrics[f"val_acc_{j}"] for j in range(3)) > 0.7
    assert result.val_metrics["sim_tau"] > 3.0  # chains of 3 drafts, most accepted whole
    events = read_metrics(out / "metrics.jsonl")
    evals = [e for e in events if e["event"] == "eval"]
    assert [e["step"] for e in evals] == [50, 100, 150]
    assert evals[0]["val_loss"] > evals[-1]["val_loss"]
    trains = [e for e in events if e["event"] == "train"]
    assert [e["step"] for e in trains] == list(range(10, 151, 10))
    assert all(e["tokens_per_s"] > 0 and e["lr"] > 0 for e in trains)
    assert trains[-1]["tokens"] == 150 * 8 * 32
    assert (out / "training_curves.png").stat().st_size > 1000

    # keep_last=2: only the two newest checkpoints survive, and latest points at the newest
    root = out / "checkpoints"
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["step-0000100", "step-0000150"]
    assert (root / "latest").read_text().strip() == "step-0000150"
    last = root / "step-0000150"
    state = json.loads((last / "trainer_state.json").read_text())
    assert state["global_step"] == 150 and state["tokens_seen"] == 150 * 8 * 32
    # optimizer / scheduler / RNG states load with weights_only=True
    optim = torch.load(last / "optimizer.pt", weights_only=True)
    assert optim["state"] and torch.load(last / "scheduler.pt", weights_only=True)["last_epoch"] == 150
    ck.set_rng_state(torch.load(last / "rng" / "rank-00000.pt", weights_only=True))

    # final/ = the last weights + config, ready for export (train.keep_best unset: no best/)
    assert not (out / "best").exists() and result.best is None
    assert json.loads((out / "final" / "train_info.json").read_text())["checkpoint"] == "step-0000150"
    final = load_file(str(out / "final" / "model.safetensors"))
    for key, value in load_file(str(last / "model.safetensors")).items():
        assert torch.equal(final[key], value)
    assert {"fc.weight", "lm_head.weight", "d2t", "t2d"} <= set(final)
    assert not any(k.startswith("embed") for k in final)  # the target's embedding is never saved
    head_cfg = json.loads((out / "final" / "head_config.json").read_text())
    assert head_cfg["target_fingerprint"] == bigram_target.fingerprint and head_cfg["kind"] == "eagle3"
    assert (out / "final" / "draft_vocab.safetensors").is_file()


def test_online_mode_matches_offline(tmp_path, bigram_data, bigram_target):
    """Online features are computed in the step; with fp32 shards both modes train on the same numbers."""
    prepared, features = bigram_data
    kw = dict(max_steps=8, ttt_steps=2, eval_every=4)
    train(
        target=bigram_target,
        features_dir=features,
        head=HeadConfig(draft_vocab_size=128),
        cfg=cfg(tmp_path / "off", **kw),
    )
    train(
        target=bigram_target,
        data_dir=prepared,
        head=HeadConfig(draft_vocab_size=128),
        cfg=cfg(tmp_path / "on", mode="online", **kw),
    )
    off, on = losses(tmp_path / "off"), losses(tmp_path / "on")
    assert sorted(on) == list(range(1, 9))
    for step in off:
        assert on[step] == pytest.approx(off[step], rel=1e-4, abs=1e-4)
    assert torch.equal(
        load_file(str(tmp_path / "off" / "final" / "model.safetensors"))["d2t"],
        load_file(str(tmp_path / "on" / "final" / "model.safetensors"))["d2t"],
    )


def _worker(args: dict, path: Path) -> subprocess.Popen:
    path.write_text(json.dumps(args))
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    return subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "_train_worker.py"), str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )


def test_kill_and_resume_continues_the_same_curve(tmp_path, bigram_data, bigram_target):
    prepared, features = bigram_data
    kw = dict(
        max_steps=20, save_every=6, eval_every=6, noise_std=0.2, deterministic=True, seed=3, batch_size=4
    )

    reference = tmp_path / "reference"
    train(
        target=bigram_target,
        features_dir=features,
        head=HeadConfig(draft_vocab_size=256),
        cfg=cfg(reference, **kw),
    )

    out = tmp_path / "killed"
    args = {
        "features_dir": str(features),
        "head": {"draft_vocab_size": 256},
        "train": {**cfg(out, **kw).__dict__},
        "hang_after_step": 12,
    }
    proc = _worker(args, tmp_path / "args.json")
    deadline = time.monotonic() + 120
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("CHECKPOINT 12") or time.monotonic() > deadline:
            break
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    proc.stdout.close()
    assert any(line.startswith("CHECKPOINT 12") for line in lines), "".join(lines[-20:])
    assert ck.find_latest(out / "checkpoints").name == "step-0000012"

    # what a crash can leave behind: a half-written checkpoint, a torn directory, events past the checkpoint
    (out / "checkpoints" / ".tmp-step-0000018").mkdir()
    torn = out / "checkpoints" / "step-0000016"
    torn.mkdir()
    (torn / "model.safetensors").write_bytes(b"junk")
    with open(out / "metrics.jsonl", "a") as fh:
        fh.write(json.dumps({"event": "train", "step": 13, "loss": 123.0}) + "\n")

    result = train(
        target=bigram_target, features_dir=features, head=HeadConfig(draft_vocab_size=256), cfg=cfg(out, **kw)
    )
    assert result.resumed_from.name == "step-0000012" and result.global_step == 20
    ref, got = losses(reference), losses(out)
    assert sorted(got) == list(range(1, 21))
    for step in ref:
        assert got[step] == pytest.approx(ref[step], abs=1e-6), step
    ref_eval = [e for e in read_metrics(reference / "metrics.jsonl") if e["event"] == "eval"]
    got_eval = [e for e in read_metrics(out / "metrics.jsonl") if e["event"] == "eval"]
    assert [e["step"] for e in got_eval] == [e["step"] for e in ref_eval] == [6, 12, 18, 20]
    assert got_eval[-1]["val_loss"] == pytest.approx(ref_eval[-1]["val_loss"], abs=1e-6)
    a = load_file(str(reference / "final" / "model.safetensors"))
    b = load_file(str(out / "final" / "model.safetensors"))
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    assert not (out / "checkpoints" / ".tmp-step-0000018").exists()


def test_draft_vocab_is_saved_and_not_rebuilt_on_resume(tmp_path, bigram_target):
    uniform = W.make_prepared(tmp_path / "d1", n_train=32, n_val=0, length=24, seed=1)
    skewed = tmp_path / "d2"
    from datasets import Dataset

    gen = torch.Generator().manual_seed(2)
    ids = [torch.randint(200, 256, (24,), generator=gen).tolist() for _ in range(32)]
    Dataset.from_dict({"input_ids": ids, "loss_mask": [[1] * 24] * 32}).save_to_disk(str(skewed / "train"))

    head = HeadConfig(draft_vocab_size=64)
    out = tmp_path / "run"
    train(
        target=bigram_target,
        data_dir=uniform,
        head=head,
        cfg=cfg(out, mode="online", max_steps=2, save_every=2),
    )
    saved = load_file(str(out / "draft_vocab.safetensors"))
    with pytest.warns(UserWarning, match="training data changed"):
        train(
            target=bigram_target,
            data_dir=skewed,
            head=head,
            cfg=cfg(out, mode="online", max_steps=4, save_every=2),
        )
    final = load_file(str(out / "final" / "model.safetensors"))
    assert torch.equal(final["d2t"], saved["d2t"]) and torch.equal(final["t2d"], saved["t2d"])
    assert torch.equal(
        load_file(str(out / "checkpoints" / "step-0000004" / "draft_vocab.safetensors"))["d2t"], saved["d2t"]
    )
    # a fresh run on the skewed data does build another vocabulary (so the check above can fail)
    fresh = tmp_path / "fresh"
    train(target=bigram_target, data_dir=skewed, head=head, cfg=cfg(fresh, mode="online", max_steps=2))
    assert not torch.equal(load_file(str(fresh / "draft_vocab.safetensors"))["d2t"], saved["d2t"])
    assert load_file(str(fresh / "draft_vocab.safetensors"))["t2d"][200:].all()


def test_resume_with_another_targets_checkpoint_fails(tmp_path, bigram_data, bigram_target):
    prepared, _ = bigram_data
    out = tmp_path / "run"
    train(
        target=bigram_target,
        data_dir=prepared,
        head=HeadConfig(draft_vocab_size=64),
        cfg=cfg(out, mode="online", max_steps=2),
    )
    with pytest.raises(EagleError, match="fingerprint"):
        train(
            target=W.bigram_target(seed=1),
            data_dir=prepared,
            head=HeadConfig(draft_vocab_size=64),
            cfg=cfg(out, mode="online", max_steps=4),
        )


def test_bad_inputs(tmp_path, bigram_data, bigram_target):
    prepared, features = bigram_data
    with pytest.raises(EagleError, match="draft_vocab_size"):
        train(
            target=bigram_target,
            features_dir=features,
            head=HeadConfig(draft_vocab_size=1000),
            cfg=cfg(tmp_path / "a"),
        )
    from datasets import Dataset

    empty = tmp_path / "empty"
    Dataset.from_dict({"input_ids": [[], []], "loss_mask": [[], []]}).save_to_disk(str(empty / "train"))
    with pytest.raises(EagleError, match="empty"):
        train(target=bigram_target, data_dir=empty, cfg=cfg(tmp_path / "b", mode="online"))
    with pytest.raises(EagleError, match="too small"):
        train(
            target=bigram_target,
            data_dir=prepared,
            head=HeadConfig(draft_vocab_size=64),
            cfg=cfg(tmp_path / "c", mode="online", batch_size=200),
        )
    with pytest.raises(EagleError, match="collect"):
        train(target=bigram_target, features_dir=tmp_path / "nothing", cfg=cfg(tmp_path / "d"))
    with pytest.raises(EagleError, match="report_to"):
        cfg(tmp_path / "e", report_to=["mlflow"]).validate()


def test_nonfinite_losses_skip_or_stop(tmp_path, bigram_data, bigram_target, monkeypatch):
    from train import trainer

    prepared, features = bigram_data
    real_forward = trainer.HeadWithLoss.forward
    calls = {"n": 0}

    def flaky(self, batch):
        loss, metrics = real_forward(self, batch)
        calls["n"] += 1
        return (loss * float("nan"), metrics) if calls["n"] == 3 and self.training else (loss, metrics)

    monkeypatch.setattr(trainer.HeadWithLoss, "forward", flaky)
    out = tmp_path / "skip"
    train(
        target=bigram_target,
        features_dir=features,
        head=HeadConfig(draft_vocab_size=64),
        cfg=cfg(out, max_steps=5),
    )
    events = [e for e in read_metrics(out / "metrics.jsonl") if e["event"] == "train"]
    assert events[-1]["skipped"] == 1 and all(math.isfinite(e["loss"]) for e in events if "loss" in e)
    assert sum("loss" not in e for e in events) == 1  # the skipped step has no loss to report
    assert all(
        torch.isfinite(v.float()).all() for v in load_file(str(out / "final" / "model.safetensors")).values()
    )
    calls["n"] = 0
    with pytest.raises(EagleError, match="not finite at step 3"):
        train(
            target=bigram_target,
            features_dir=features,
            head=HeadConfig(draft_vocab_size=64),
            cfg=cfg(tmp_path / "stop", max_steps=5, on_nonfinite="stop"),
        )


def test_command_line_reports_user_errors(tmp_path, capsys):
    from recipes.cli import main

    assert main(["train", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml" in capsys.readouterr().err


def test_eagle1_head_trains(tmp_path, bigram_data, bigram_target):
    _, features = bigram_data
    out = tmp_path / "e1"
    result = train(
        target=bigram_target,
        features_dir=features,
        head=HeadConfig(kind="eagle1"),
        cfg=cfg(out, max_steps=30, lr=1e-2, eval_every=30),
    )
    first, last = losses(out)[1], losses(out)[30]
    assert last < first and "val_loss_reg" in result.val_metrics
    assert json.loads((out / "final" / "head_config.json").read_text())["kind"] == "eagle1"
    assert "d2t" not in load_file(str(out / "final" / "model.safetensors"))


def test_bf16_mixed_precision_on_cpu_learns_and_saves_fp32_weights(
    tmp_path, bigram_data, bigram_target, monkeypatch, capsys
):
    """train.bf16: autocast on the CPU (auto picks it where the CPU has bf16 units); the head still learns the
    target and its saved weights are the fp32 master copy."""
    import train.launch as launch
    import train.trainer as trainer

    _, features = bigram_data
    monkeypatch.setattr("eagle.targets.cpu_has_fast_bf16", lambda: True)
    assert launch.mixed_precision(TrainConfig(bf16="auto")) == "bf16"
    assert launch.mixed_precision(TrainConfig(bf16=False)) == "no"
    monkeypatch.setattr("eagle.targets.cpu_has_fast_bf16", lambda: False)
    assert launch.mixed_precision(TrainConfig(bf16="auto")) == "no"
    assert launch.mixed_precision(TrainConfig(bf16=True)) == "bf16"

    seen = []
    real_forward = trainer.HeadWithLoss.forward

    def spy(self, batch):
        seen.append(torch.is_autocast_enabled("cpu"))
        return real_forward(self, batch)

    monkeypatch.setattr(trainer.HeadWithLoss, "forward", spy)
    out = tmp_path / "bf16"
    result = train(
        target=bigram_target,
        features_dir=features,
        head=HeadConfig(draft_vocab_size=256),
        cfg=cfg(out, max_steps=150, eval_every=150, bf16=True),
    )
    assert seen and all(seen)  # every training and eval forward ran under bf16 autocast
    assert "1 process(es), bf16 autocast; fresh start" in capsys.readouterr().out
    assert result.val_metrics["val_acc"] > 0.8, result.val_metrics
    final = load_file(str(out / "final" / "model.safetensors"))
    assert final["fc.weight"].dtype == torch.float32


def test_report_to_tensorboard_and_wandb_offline(tmp_path, bigram_data, bigram_target, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    _, features = bigram_data
    out = tmp_path / "run"
    train(
        target=bigram_target,
        features_dir=features,
        head=HeadConfig(draft_vocab_size=64),
        cfg=cfg(out, max_steps=3, eval_every=3, report_to=["tensorboard", "wandb"]),
    )
    events = list((out / "tb").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 100
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tb"))
    acc.Reload()
    assert "train/loss" in acc.Tags()["scalars"] and "eval/val_acc" in acc.Tags()["scalars"]
    runs = list((out / "wandb").glob("offline-run-*"))
    assert runs and any(runs[0].rglob("*.wandb"))


# ------------------------------------------------------------------------------------------- pieces


def test_plans_are_deterministic_dense_and_split_by_rank():
    lengths = [int(x) for x in torch.randint(1, 200, (500,), generator=torch.Generator().manual_seed(0))] + [
        0
    ]
    a = plan_epoch(lengths, world=2, seed=1, epoch=0, batch_size=4)
    assert a == plan_epoch(lengths, world=2, seed=1, epoch=0, batch_size=4)
    assert a != plan_epoch(lengths, world=2, seed=1, epoch=1, batch_size=4)
    flat = [i for b in a for i in b]
    assert len(flat) == len(set(flat)) and 500 not in flat and all(len(b) == 8 for b in a)
    assert len(flat) == 496  # 500 sequences, global batch 8: the 4-sequence tail is dropped
    # bucketing: padding is small compared with random batches
    pad = sum(len(b) * max(lengths[i] for i in b) - sum(lengths[i] for i in b) for b in a)
    assert pad < 0.1 * sum(lengths)
    # one process with batch 8 sees the same global batches as two with batch 4
    assert plan_epoch(lengths, world=1, seed=1, epoch=0, batch_size=8) == a
    for gb in a:
        assert rank_slice(gb, 0, 2) + rank_slice(gb, 1, 2) == gb
    tok = plan_epoch(lengths, world=2, seed=1, epoch=0, batch_tokens=400)
    assert all(len(b) % 2 == 0 and len(b) // 2 * max(lengths[i] for i in b) <= 400 for b in tok if len(b) > 2)
    ev = plan_eval(lengths, world=3, batch_size=2)
    assert sorted(i for b in ev for i in b) == list(range(500))


def test_collate_pads_right():
    items = [
        {
            "input_ids": torch.tensor([5, 6, 7]),
            "loss_mask": torch.tensor([0, 1, 1]),
            "aux_hidden": torch.ones(3, 4),
        },
        {"input_ids": torch.tensor([8]), "loss_mask": torch.tensor([1]), "aux_hidden": torch.ones(1, 4)},
    ]
    batch = collate(items)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1], [1, 0, 0]]
    assert batch["aux_hidden"][1, 1:].abs().sum() == 0


def test_find_latest_ignores_stale_pointers_and_partial_dirs(tmp_path):
    def fake(step: int, complete: bool = True) -> Path:
        d = tmp_path / ck.step_dir_name(step)
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"x")
        (d / "optimizer.pt").write_bytes(b"x")
        if complete:
            (d / "trainer_state.json").write_text(json.dumps({"global_step": step}))
        return d

    assert ck.find_latest(tmp_path) is None
    fake(5)
    fake(10)
    fake(15, complete=False)
    (tmp_path / "latest").write_text("step-0000099\n")  # points at nothing
    assert ck.find_latest(tmp_path).name == "step-0000010"
    (tmp_path / "latest").write_text("step-0000005\n")  # stale: a newer complete one exists
    assert ck.find_latest(tmp_path).name == "step-0000010"
    assert [p.name for p in ck.prune(tmp_path, keep_last=1)] == ["step-0000005"]
    assert [p.name for p in ck.list_checkpoints(tmp_path)] == ["step-0000010"]


def test_rng_state_round_trip_through_weights_only(tmp_path):
    import random

    import numpy as np

    torch.manual_seed(1)
    random.seed(2)
    np.random.seed(3)
    ck.save_pt(ck.rng_state(), tmp_path / "rng.pt")
    expected = (torch.rand(3), random.random(), np.random.rand())
    ck.set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert torch.equal(torch.rand(3), expected[0])
    assert random.random() == expected[1] and np.random.rand() == expected[2]


def _timed_run(tmp_path, bigram_data, bigram_target, monkeypatch, seconds_for_step):
    """Train with a 1-minute train.max_minutes on a hand-wound clock: micro-step n advances it by
    ``seconds_for_step(n)``. Returns the result, the run folder and the clock's final reading."""
    from eagle.deadline import Deadline
    from train import trainer as T

    clock, calls = [0.0], [0]
    monkeypatch.setattr(T, "Deadline", lambda minutes: Deadline(minutes, clock=lambda: clock[0]))
    real_step = T._Run._micro_step

    def timed_step(self, batch):
        calls[0] += 1
        clock[0] += seconds_for_step(calls[0])
        return real_step(self, batch)

    monkeypatch.setattr(T._Run, "_micro_step", timed_step)
    _, features = bigram_data
    out = tmp_path / "run"
    result = train(
        target=bigram_target,
        features_dir=features,
        head=HeadConfig(draft_vocab_size=128),
        cfg=cfg(out, max_minutes=1.0, log_every=5, ttt_steps=1),
    )
    return result, out, clock[0]


def test_time_limit_shortens_the_schedule_to_fit(tmp_path, bigram_data, bigram_target, monkeypatch):
    """train.max_minutes: at 1 s per step (a hand-wound clock), a 1-minute limit ends the run after ~58 steps
    with the cosine decay finished, instead of the 100 epochs asked for."""
    result, out, _ = _timed_run(tmp_path, bigram_data, bigram_target, monkeypatch, lambda n: 1.0)
    # 60 s minus the 1.8 s kept for the final evaluation and checkpoint, at 1 s a step
    assert 55 <= result.global_step <= 58, result.global_step
    assert json.loads((out / "final" / "train_info.json").read_text())["time_cut"] is True
    last = (out / "checkpoints" / "latest").read_text().strip()
    assert last == f"step-{result.global_step:07d}"
    state = json.loads((out / "checkpoints" / last / "trainer_state.json").read_text())
    assert state["total_steps"] == result.global_step and state["time_cut"] is True
    trains = [e for e in read_metrics(out / "metrics.jsonl") if e["event"] == "train"]
    assert trains[-1]["step"] == result.global_step
    assert trains[-1]["lr"] < 3e-3 * 0.15  # the (rescaled) cosine reached its floor (min_lr_ratio 0.1)
    with pytest.raises(EagleError, match="train.max_minutes"):
        TrainConfig(max_minutes=-1).validate()


def test_time_limit_lengthens_a_schedule_cut_by_slow_first_steps(
    tmp_path, bigram_data, bigram_target, monkeypatch, capsys
):
    """The first steps are slow (3 s each for 10 steps, then 1 s): judged on them alone the 1-minute run would stop
    at ~19 steps. The pace is measured over the later half of the steps run, so the cut schedule is lengthened
    again and the run ends at ~38 steps, still inside the minute. The console hears of the cut once, and of
    where the schedule ended once."""
    result, out, clock = _timed_run(
        tmp_path, bigram_data, bigram_target, monkeypatch, lambda n: 3.0 if n <= 10 else 1.0
    )
    said = [line for line in capsys.readouterr().out.splitlines() if "train.max_minutes=1" in line]
    assert len(said) == 2 and "shortening the schedule" in said[0], said
    assert f"ended the schedule at step {result.global_step} of the" in said[1], said
    # 30 s for the first 10 steps, then 1 s a step up to 60 s less the 1.8 s kept for the end
    assert 36 <= result.global_step <= 38, result.global_step
    assert clock <= 60.0
    assert json.loads((out / "final" / "train_info.json").read_text())["time_cut"] is True
    trains = [e for e in read_metrics(out / "metrics.jsonl") if e["event"] == "train"]
    assert trains[-1]["step"] == result.global_step and trains[-1]["lr"] < 3e-3 * 0.15


def test_validation_labels_are_computed_once(tmp_path, bigram_data, bigram_target, monkeypatch):
    """The target's exact top-1 of each validation batch is computed at the first evaluation and reused by the
    later ones (the labels never change), with the same metrics as computing them afresh."""
    import train.losses as L

    calls = [0]
    real = L.target_argmax

    def counted(lm_head, hidden):
        calls[0] += 1
        return real(lm_head, hidden)

    monkeypatch.setattr(L, "target_argmax", counted)
    _, features = bigram_data
    runs = {}
    for every in (5, 20):  # four evaluations, then one
        calls[0] = 0
        result = train(
            target=bigram_target,
            features_dir=features,
            head=HeadConfig(draft_vocab_size=128),
            cfg=cfg(tmp_path / f"every-{every}", max_steps=20, eval_every=every),
        )
        evals = [e for e in read_metrics(tmp_path / f"every-{every}" / "metrics.jsonl") if e["event"] == "eval"]
        runs[every] = (calls[0], evals[-1], result.global_step, len(evals))
    assert runs[5][2] == runs[20][2] == 20 and (runs[5][3], runs[20][3]) == (4, 1)
    assert runs[5][0] == runs[20][0] > 0  # one argmax per validation batch, however many evaluations
    last_5, last_20 = runs[5][1], runs[20][1]
    assert last_5["step"] == last_20["step"] == 20
    for key in ("val_acc_0", "val_acc_1", "val_acc_2", "val_loss"):
        assert last_5[key] == last_20[key], key
