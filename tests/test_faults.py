"""Faults: SIGKILL at random points (training and collection), a full disk during a checkpoint, non-finite losses.

Kill points are chosen per seed among the *events* of a run: every training forward and every checkpoint file
operation (``train.checkpoint``'s writers, renames and deletions), or every shard write of a collection. The child
process (``tests/_train_worker.py`` / ``tests/_collect_worker.py``, run through :func:`child` below) counts the
events and SIGKILLs itself at the chosen one -- when the event writes a ``.pt`` file, after writing half of it,
like a crash in mid-write. The killed run is then resumed to the end.

"Lose nothing" is checked byte for byte: every checkpoint (shard) that was complete when a process died is still
there afterwards with the same bytes, and the resumed run ends with the same final weights as an uninterrupted run
(deterministic mode: bit for bit) and the same loss curve (tolerance 1e-6 absolute: the values are the same
floats, the tolerance only absorbs JSON round-tripping).
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import _train_worker as W
import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eagle.errors import EagleError
from eagle.heads import HeadConfig
from train import checkpoint as ck
from train.logging import read_metrics
from train.trainer import TrainConfig, train

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
SEEDS = (0, 1, 2)
KILLS_PER_SEED = 2

# what the kill tests train: 24 steps, a checkpoint every 4, noise (so the RNG state matters), deterministic
TRAIN_KW = dict(
    epochs=100,
    max_steps=24,
    batch_size=4,
    lr=3e-3,
    warmup_steps=3,
    log_every=1,
    eval_every=8,
    save_every=4,
    keep_last=None,
    noise_std=0.2,
    deterministic=True,
    seed=3,
    progress=False,
)
HEAD = {"draft_vocab_size": 128}


pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")  # tests build Accelerators


# ------------------------------------------------------------------------------------------- fault injection


class Injector:
    """Counts events and SIGKILLs this process at event ``kill_at`` (None: only count)."""

    def __init__(self, kill_at: int | None = None):
        self.kill_at = kill_at
        self.count = 0

    def tick(self, what: str, tear: Callable[[], None] | None = None) -> None:
        self.count += 1
        if self.count == self.kill_at:
            if tear is not None:
                tear()
            print(f"fault: SIGKILL at event {self.count} ({what})", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    def wrap(self, fn: Callable, torn_write: bool = False) -> Callable:
        what = fn.__qualname__ + (" half-written" if torn_write else "")

        def wrapped(*args, **kwargs):
            tear = None
            if torn_write:  # save_pt(obj, path): leave half of the file behind

                def tear() -> None:
                    buf = io.BytesIO()
                    torch.save(args[0], buf)
                    path = Path(args[1])
                    path.parent.mkdir(parents=True, exist_ok=True)
                    with open(path, "wb") as fh:
                        fh.write(buf.getvalue()[: len(buf.getvalue()) // 2])
                        fh.flush()
                        os.fsync(fh.fileno())

            self.tick(what, tear)
            return fn(*args, **kwargs)

        return wrapped


CHECKPOINT_EVENTS = (
    "save_pt",
    "save_head_files",
    "write_json_atomic",
    "write_text_atomic",
    "replace_dir",
    "remove_tree",
)


def arm_training(inj: Injector, patch: Callable = setattr) -> None:
    """Count training forwards and checkpoint file operations (``patch`` is setattr or monkeypatch.setattr)."""
    from train import trainer

    for name in CHECKPOINT_EVENTS:
        patch(ck, name, inj.wrap(getattr(ck, name), torn_write=name == "save_pt"))
    forward = trainer.HeadWithLoss.forward

    def counted(self, batch):
        inj.tick("training step" if self.training else "evaluation step")
        return forward(self, batch)

    patch(trainer.HeadWithLoss, "forward", counted)


def arm_collection(inj: Injector, patch: Callable = setattr) -> None:
    """Count shard row writes, shard closes and manifest writes of ``train.collect``."""
    from train import collect

    patch(collect._ShardWriter, "write_rows", inj.wrap(collect._ShardWriter.write_rows))
    patch(collect._ShardWriter, "close", inj.wrap(collect._ShardWriter.close))
    patch(collect, "write_json_atomic", inj.wrap(collect.write_json_atomic))


def child(argv: list[str]) -> int:
    """Subprocess entry: ``train|collect KILL_AT WORKER-ARGS...`` runs the worker armed to die at event KILL_AT."""
    kind, kill_at, rest = argv[0], int(argv[1]), argv[2:]
    torch.set_num_threads(1)
    inj = Injector(kill_at)
    if kind == "train":
        arm_training(inj)
        return W.main(rest)
    import _collect_worker

    arm_collection(inj)
    sys.argv = ["_collect_worker.py", *rest]
    _collect_worker.main()
    return 0


def start_child(kind: str, kill_at: int, args: list[str], log: Path) -> subprocess.Popen:
    code = f"import sys; sys.path.insert(0, {str(TESTS)!r}); import test_faults; sys.exit(test_faults.child(sys.argv[1:]))"
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    with open(log, "wb") as fh:  # a file, not a pipe: a full pipe would stall the child
        return subprocess.Popen(
            [sys.executable, "-c", code, kind, str(kill_at), *args],
            stdout=fh,
            stderr=subprocess.STDOUT,
            env=env,
        )


def run_children(specs: list[tuple[str, int, list[str], Path]]) -> list[int]:
    """Run children in parallel; returns their exit statuses (-9: killed at its chosen event)."""
    procs = [start_child(*spec) for spec in specs]
    codes = []
    for proc, spec in zip(procs, specs):
        try:
            codes.append(proc.wait(timeout=300))
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        log = spec[3].read_text(errors="replace")
        assert codes[-1] in (0, -signal.SIGKILL), log[-3000:]
        print("".join(f"{m}\n" for m in re.findall(r"fault: SIGKILL at event \d+ \([^)]*\)", log)), end="")
    return codes


# ----------------------------------------------------------------------------------------------- helpers


def file_hashes(folder: Path) -> dict[str, tuple[str, int]]:
    return {
        str(p.relative_to(folder)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_size)
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def complete_checkpoints(out: Path) -> dict[str, dict[str, tuple[str, int]]]:
    return {p.name: file_hashes(p) for p in ck.list_checkpoints(out / "checkpoints")}


def bytes_lost(
    before: dict[str, dict[str, tuple[str, int]]], after: dict[str, dict[str, tuple[str, int]]]
) -> int:
    """Bytes of files of complete checkpoints (shards) in ``before`` that are gone or changed in ``after``."""
    lost = 0
    for name, files in before.items():
        for rel, (sha, size) in files.items():
            if after.get(name, {}).get(rel, (None, 0))[0] != sha:
                lost += size
    return lost


def losses(out: Path) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in read_metrics(out / "metrics.jsonl") if e["event"] == "train"}


def evals(out: Path) -> dict[int, float]:
    return {e["step"]: e["val_loss"] for e in read_metrics(out / "metrics.jsonl") if e["event"] == "eval"}


def same_weights(a: Path, b: Path) -> bool:
    x, y = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def train_cfg(out: Path, **kw) -> TrainConfig:
    return TrainConfig(output_dir=str(out), **{**TRAIN_KW, **kw})


# ----------------------------------------------------------------------------------------- kills: training


@pytest.mark.slow
def test_training_killed_at_random_points_resumes_to_the_same_weights(
    tmp_path, bigram_data, bigram_target, monkeypatch
):
    _, features = bigram_data
    reference = tmp_path / "reference"
    counter = Injector()
    with monkeypatch.context() as m:
        arm_training(counter, m.setattr)
        train(target=bigram_target, features_dir=features, head=HeadConfig(**HEAD), cfg=train_cfg(reference))
    events = counter.count
    assert events > 24 + 6 * 6  # forwards (train + eval) and the file operations of 6 checkpoints + final

    runs = {seed: tmp_path / f"seed{seed}" for seed in SEEDS}
    rngs = {seed: random.Random(seed) for seed in SEEDS}
    kills, lost, at_death = 0, 0, {seed: {} for seed in SEEDS}
    for round_ in range(KILLS_PER_SEED):
        specs = []
        for seed, out in runs.items():
            args = {"features_dir": str(features), "head": HEAD, "train": train_cfg(out).__dict__}
            path = tmp_path / f"args-{seed}.json"
            path.write_text(json.dumps(args))
            # the first kill anywhere in a whole run; later ones early in the (shorter) resumed run
            kill_at = rngs[seed].randint(1, events if round_ == 0 else events // 3)
            specs.append(("train", kill_at, [str(path)], tmp_path / f"log-{seed}-{round_}.txt"))
        for seed, code in zip(runs, run_children(specs)):
            if code == -signal.SIGKILL:
                kills += 1
                at_death[seed].update(complete_checkpoints(runs[seed]))
    assert kills >= len(SEEDS)  # the first kill of every seed falls inside a run

    for seed, out in runs.items():
        result = train(target=bigram_target, features_dir=features, head=HeadConfig(**HEAD), cfg=train_cfg(out))
        assert result.global_step == 24
        assert same_weights(reference / "final", out / "final"), seed  # bit for bit
        ref, got = losses(reference), losses(out)
        assert sorted(got) == list(range(1, 25)), seed
        assert all(abs(got[s] - ref[s]) <= 1e-6 for s in ref), (seed, ref, got)
        assert evals(out) == pytest.approx(evals(reference), abs=1e-6)
        end = complete_checkpoints(out)
        lost += bytes_lost(at_death[seed], end)
        # and every checkpoint holds the reference run's weights of that step
        assert sorted(end) == sorted(complete_checkpoints(reference))
        assert all(same_weights(reference / "checkpoints" / n, out / "checkpoints" / n) for n in end)
        assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith((".tmp", ".trash"))]
    print(f"\ntraining: {kills} kills survived over seeds {SEEDS}, {lost} bytes lost")
    assert lost == 0


# --------------------------------------------------------------------------------------- kills: collection


@pytest.mark.slow
def test_collection_killed_at_random_points_is_byte_identical(tmp_path, monkeypatch):
    from test_collect import _collect_saved, make_data

    from eagle.testing import tiny_model

    tiny_model("llama", seed=3).save_pretrained(tmp_path / "model")
    prepared = make_data(tmp_path / "data", sizes=(("train", 30), ("val", 6)), seed=1)
    reference = tmp_path / "reference"
    counter = Injector()
    with monkeypatch.context() as m:
        arm_collection(counter, m.setattr)
        _collect_saved(tmp_path / "model", prepared, reference)
    events = counter.count
    ref_shards = file_hashes(reference)
    assert sum(name.endswith(".safetensors") for name in ref_shards) >= 4

    outs = {seed: tmp_path / f"seed{seed}" for seed in SEEDS}
    specs = [
        (
            "collect",
            random.Random(seed).randint(1, events),
            [str(tmp_path / "model"), str(prepared), str(out), "150", "64", "bfloat16"],
            tmp_path / f"log-{seed}.txt",
        )
        for seed, out in outs.items()
    ]
    codes = run_children(specs)
    kills = sum(code == -signal.SIGKILL for code in codes)
    assert kills == len(SEEDS)
    lost = 0
    for out in outs.values():
        finished = {
            p.relative_to(out): (p.stat().st_ino, p.stat().st_mtime_ns)
            for p in out.rglob("shard-*.safetensors")
        }
        before = {"shards": {k: v for k, v in file_hashes(out).items() if k.endswith(".safetensors")}}
        _collect_saved(tmp_path / "model", prepared, out)
        after = file_hashes(out)
        lost += bytes_lost(before, {"shards": after})
        shards = {k: v for k, v in after.items() if k.endswith(".safetensors")}
        assert shards == {k: v for k, v in ref_shards.items() if k.endswith(".safetensors")}
        for p in out.rglob("shard-*.safetensors"):  # shards finished before the kill were kept, not rewritten
            if p.relative_to(out) in finished:
                assert (p.stat().st_ino, p.stat().st_mtime_ns) == finished[p.relative_to(out)]
        got, ref = (json.loads((d / "manifest.json").read_text()) for d in (out, reference))
        assert got["complete"] and got["splits"] == ref["splits"]
        assert not [p for p in out.rglob("*") if "tmp" in p.name]
    print(f"\ncollection: {kills} kills survived over seeds {SEEDS}, {lost} bytes lost")
    assert lost == 0


# -------------------------------------------------------------------------------------------- full disk


def _fail_writing(step: int, what: str = "optimizer.pt") -> Callable:
    """A ``save_pt`` that, for checkpoint ``step``'s ``what``, writes half the file and then hits ENOSPC."""
    real = ck.save_pt

    def save_pt(obj, path: Path) -> None:
        path = Path(path)
        if path.name == what and path.parent.name == f".tmp-{ck.step_dir_name(step)}":
            buf = io.BytesIO()
            torch.save(obj, buf)
            path.write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        real(obj, path)

    return save_pt


def _check_full_disk_outcome(out: Path, kept: dict, failed_step: int, exc: EagleError) -> None:
    message = str(exc)
    assert f"could not write checkpoint {out / 'checkpoints' / ck.step_dir_name(failed_step)}" in message
    assert "free disk space" in message and "resumes from the last complete checkpoint" in message
    assert complete_checkpoints(out) == kept  # the earlier checkpoints, byte for byte
    assert (out / "checkpoints" / "latest").read_text().strip() == max(kept)
    assert not [p.name for p in (out / "checkpoints").iterdir() if p.name.startswith(".tmp")]


def test_full_disk_during_a_checkpoint_keeps_the_previous_one(
    tmp_path, bigram_data, bigram_target, monkeypatch
):
    _, features = bigram_data
    kw = dict(max_steps=6, save_every=2, eval_every=0)
    reference = tmp_path / "reference"
    train(target=bigram_target, features_dir=features, head=HeadConfig(**HEAD), cfg=train_cfg(reference, **kw))

    out = tmp_path / "run"
    kept: dict = {}

    def remember(path: Path, step: int) -> None:
        kept.update(complete_checkpoints(out))

    with monkeypatch.context() as m:
        m.setattr(ck, "save_pt", _fail_writing(step=4))
        with pytest.raises(EagleError) as info:
            train(
                target=bigram_target,
                features_dir=features,
                head=HeadConfig(**HEAD),
                cfg=train_cfg(out, **kw),
                on_checkpoint=remember,
            )
    assert sorted(kept) == ["step-0000002"]
    _check_full_disk_outcome(out, kept, 4, info.value)
    assert "No space left on device" in str(info.value)

    # space freed: the same command resumes from step 2 and ends where an uninterrupted run ends
    result = train(
        target=bigram_target, features_dir=features, head=HeadConfig(**HEAD), cfg=train_cfg(out, **kw)
    )
    assert result.resumed_from.name == "step-0000002" and result.global_step == 6
    assert same_weights(reference / "final", out / "final")
    assert losses(out) == pytest.approx(losses(reference), abs=1e-6)


def _mount_tmpfs(where: Path, size: int) -> bool:
    where.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True
    )
    return done.returncode == 0


def _page_bytes(folder: Path, pattern: str = "*") -> int:
    """What the files under ``folder`` matching ``pattern`` take on a tmpfs (whole 4 KiB pages)."""
    return sum(-(-p.stat().st_size // 4096) * 4096 for p in folder.rglob(pattern) if p.is_file())


@pytest.mark.slow
def test_full_disk_on_a_real_small_tmpfs(tmp_path, bigram_data, bigram_target):
    """A real ENOSPC (torch.save and safetensors report it as RuntimeError / SafetensorError, not OSError)."""
    _, features = bigram_data
    kw = dict(max_steps=6, save_every=2, eval_every=0, log_every=100)
    reference = tmp_path / "reference"
    train(target=bigram_target, features_dir=features, head=HeadConfig(**HEAD), cfg=train_cfg(reference, **kw))
    one = _page_bytes(reference / "checkpoints" / "step-0000002")
    base = sum(_page_bytes(reference, name) for name in ("draft_vocab.*", "metrics.jsonl"))
    size = base + one + one // 2 + 8 * 4096  # room for the first checkpoint, not for the second
    mount = tmp_path / "mnt"
    if not _mount_tmpfs(mount, size):
        pytest.skip("cannot mount a tmpfs here (needs root and mount permission)")
    try:
        out = mount / "run"
        kept: dict = {}
        with pytest.raises(EagleError) as info:
            train(
                target=bigram_target,
                features_dir=features,
                head=HeadConfig(**HEAD),
                cfg=train_cfg(out, **kw),
                on_checkpoint=lambda path, step: kept.update(complete_checkpoints(out)),
            )
        assert sorted(kept) == ["step-0000002"]
        _check_full_disk_outcome(out, kept, 4, info.value)
        subprocess.run(["mount", "-o", "remount,size=64m", str(mount)], check=True)
        result = train(
            target=bigram_target, features_dir=features, head=HeadConfig(**HEAD), cfg=train_cfg(out, **kw)
        )
        assert result.resumed_from.name == "step-0000002" and result.global_step == 6
        assert same_weights(reference / "final", out / "final")
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


# ------------------------------------------------------------------------------------------ non-finite loss


def _poison_first_sequence(features: Path, out: Path) -> Path:
    """A copy of the features with NaN target features for the first sequence of the first train shard."""
    from train.shards import sha256_file

    shutil.copytree(features, out)
    manifest = json.loads((out / "manifest.json").read_text())
    entry = manifest["splits"]["train"]["shards"][0]
    path = out / "train" / entry["file"]
    with safe_open(str(path), framework="pt") as fh:
        metadata = fh.metadata()
    tensors = load_file(str(path))
    end = int(tensors["offsets"][1])
    tensors["last_hidden"][:end] = float("nan")
    save_file(tensors, str(path), metadata=metadata)
    entry["sha256"] = sha256_file(path)
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


def test_nonfinite_loss_skips_or_stops_and_says_so(tmp_path, bigram_data, capsys):
    """Through the command line: bad data makes one batch per epoch non-finite."""
    from recipes import cli

    _, features = bigram_data
    poisoned = _poison_first_sequence(features, tmp_path / "features")
    config = {
        "run_dir": str(tmp_path / "run"),
        "target": {"name": str(W.save_target_folder(tmp_path / "target"))},
        "collect": {"output_dir": str(poisoned)},
        "head": HEAD,
        "train": {
            **{k: v for k, v in TRAIN_KW.items() if k != "keep_last"},
            "max_steps": 48,
            "save_every": 8,
        },
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    argv = ["train", "--config", str(tmp_path / "run.yaml")]

    capsys.readouterr()
    assert cli.main([*argv, f"train.output_dir={tmp_path / 'skip'}"]) == 0
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if "is not finite at step" in line]
    assert len(said) == 2 and all("skipped that batch (train.on_nonfinite=skip" in s for s in said), err
    events = [e for e in read_metrics(tmp_path / "skip" / "metrics.jsonl") if e["event"] == "train"]
    assert events[-1]["skipped"] == 2 and sum("loss" not in e for e in events) == 2
    final = load_file(str(tmp_path / "skip" / "final" / "model.safetensors"))
    assert all(torch.isfinite(v.float()).all() for v in final.values())

    stop = [f"train.output_dir={tmp_path / 'stop'}", "train.on_nonfinite=stop", "train.save_every=2"]
    assert cli.main([*argv, *stop]) == 2
    err = capsys.readouterr().err
    step = int(said[0].split("at step ")[1].split(":")[0])
    assert f"eagle train: error: the loss is not finite at step {step}: lower train.lr" in err
    assert "check the data" in err and "Traceback" not in err
    # the checkpoints written before the bad batch are complete and load; nothing after it was written
    written = ck.list_checkpoints(tmp_path / "stop" / "checkpoints")
    assert [ck.read_state(p)["global_step"] for p in written] == list(range(2, step, 2))[-3:] and written
    for path in written:
        ck.load_head_files(path)
    assert not (tmp_path / "stop" / "final").exists()


def test_clean_stale_removes_what_a_killed_checkpoint_write_left(tmp_path):
    """Temporary step folders, trash and a half-written ``latest`` pointer go; finished checkpoints stay."""
    from eagle import fileio

    root = tmp_path / "checkpoints"
    keep = root / ck.step_dir_name(4)
    keep.mkdir(parents=True)
    (keep / "model.safetensors").write_bytes(b"x")
    (root / ck.LATEST).write_text(keep.name + "\n")
    doomed = [root / f".tmp-{ck.step_dir_name(8)}", root / ".trash-1234"]
    for d in doomed:
        d.mkdir()
        (d / "part").write_bytes(b"half")
    pointer_tmp = fileio._temp_name(root / ck.LATEST)  # the name an interrupted pointer write leaves
    pointer_tmp.write_text("step-")
    ck.clean_stale(root)
    assert not [p for p in [*doomed, pointer_tmp] if p.exists()]
    assert (keep / "model.safetensors").read_bytes() == b"x"
    assert (root / ck.LATEST).read_text() == keep.name + "\n"
