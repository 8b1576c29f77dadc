"""Feature collection: shard contents, packing, resume after a kill, two processes, and bad inputs."""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from safetensors.torch import load_file

from eagle import fileio
from eagle.errors import EagleError
from eagle.targets import Target
from eagle.testing import tiny_model
from train.collect import CollectConfig, ShardPlan, collect, plan_shards
from train.shards import FeatureShards, sha256_file

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "_collect_worker.py"
BIN = Path(sys.executable).parent


def make_data(root: Path, sizes=(("train", 24), ("val", 6)), seed: int = 0, max_len: int = 40) -> Path:
    """A stand-in for `eagle prepare`: random token rows with 0/1 loss masks, saved with save_to_disk."""
    rng = random.Random(seed)
    for split, n in sizes:
        ids = [[rng.randrange(3, 256) for _ in range(rng.randrange(3, max_len))] for _ in range(n)]
        masks = [[int(rng.random() < 0.6) for _ in row] for row in ids]
        Dataset.from_dict({"input_ids": ids, "loss_mask": masks}).save_to_disk(str(root / split))
    (root / "prepare_meta.json").write_text(json.dumps({"seed": seed, "sizes": list(sizes)}))
    return root


@pytest.fixture(scope="module")
def target() -> Target:
    return Target.from_model(tiny_model("llama"), name="tiny-llama")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return make_data(tmp_path_factory.mktemp("data"))


def rows(data: Path, split: str) -> dict:
    from datasets import load_from_disk

    ds = load_from_disk(str(data / split))
    return {"input_ids": list(ds["input_ids"]), "loss_mask": list(ds["loss_mask"])}


def shard_files(out: Path, split: str = "train") -> list[Path]:
    return sorted((out / split).glob("shard-*.safetensors"))


def temp_files(out: Path) -> list[Path]:
    return [p for p in out.rglob("*") if "tmp" in p.name]


def shard_temp_files(out: Path, split: str = "train") -> list[Path]:
    """Shards being streamed (not the manifests' own brief temporary files, which also match `temp_files`)."""
    return sorted((out / split).glob(".shard-*.safetensors.tmp-*"))


def hidden_reference(model, ids: torch.Tensor, aux_layers: list[int]):
    """The target's own output_hidden_states for one sequence, without padding or batching."""
    with torch.no_grad():
        hs = model(ids[None], output_hidden_states=True).hidden_states
    return torch.cat([hs[i] for i in aux_layers], dim=-1)[0], hs[-1][0]


# ---------------------------------------------------------------------------------------------- contents


@pytest.mark.parametrize(
    "dtype, batch_tokens, tol",
    [
        ("float32", 1, 0.0),  # one unpadded sequence per forward, stored losslessly: bit for bit
        ("float32", 120, 1e-6),  # padded batches: same math, last-bit differences from other matmul shapes
        ("bfloat16", 120, 1e-2),  # storage rounding
    ],
)
def test_features_equal_independent_forward(tmp_path, target, data_dir, dtype, batch_tokens, tol):
    cfg = CollectConfig(
        output_dir=str(tmp_path / "f"), dtype=dtype, shard_tokens=150, batch_tokens=batch_tokens
    )
    manifest = collect(cfg, data_dir, target)
    assert manifest["complete"] and manifest["dtype"] == dtype and manifest["aux_layers"] == [1, 2, 3]
    fs = FeatureShards(tmp_path / "f", "train", expected_fingerprint=target.fingerprint)
    src = rows(data_dir, "train")
    assert len(fs) == len(src["input_ids"])
    for i, row in enumerate(fs.seq_indices()):
        item = fs[i]
        ids = torch.tensor(src["input_ids"][row])
        assert torch.equal(item["input_ids"], ids)
        aux_ref, last_ref = hidden_reference(target.model, ids, fs.aux_layers)
        assert item["aux_hidden"].dtype == item["last_hidden"].dtype == fs.dtype == getattr(torch, dtype)
        assert item["aux_hidden"].shape == (len(ids), 3 * target.hidden_size)
        assert item["last_hidden"].shape == (len(ids), target.hidden_size)
        torch.testing.assert_close(item["aux_hidden"].float(), aux_ref, rtol=tol, atol=tol)
        torch.testing.assert_close(item["last_hidden"].float(), last_ref, rtol=tol, atol=tol)
    if dtype == "float32":  # last_hidden is after the final norm: lm_head of it gives the target's logits
        ids = torch.tensor(src["input_ids"][fs.seq_indices()[0]])
        with torch.no_grad():
            logits = target.model(ids[None]).logits[0]
        torch.testing.assert_close(target.model.lm_head(fs[0]["last_hidden"]), logits, rtol=0, atol=1e-5)


def test_packing_offsets_and_manifest(tmp_path, target, data_dir):
    out = tmp_path / "f"
    cfg = CollectConfig(output_dir=str(out), dtype="bfloat16", shard_tokens=100, batch_tokens=64)
    manifest = collect(cfg, data_dir, target)
    for split in ("train", "val"):
        src = rows(data_dir, split)
        entry = manifest["splits"][split]
        assert entry["num_sequences"] == len(src["input_ids"])
        assert entry["num_tokens"] == sum(len(r) for r in src["input_ids"])
        assert entry["loss_tokens"] == sum(sum(m) for m in src["loss_mask"])
        assert [s["file"] for s in entry["shards"]] == [p.name for p in shard_files(out, split)]
        seen = []
        for s in entry["shards"]:
            path = out / split / s["file"]
            assert sha256_file(path) == s["sha256"]
            t = load_file(path)
            assert t["input_ids"].dtype == torch.int32 and t["loss_mask"].dtype == torch.uint8
            assert t["offsets"].dtype == torch.int64 and t["seq_index"].dtype == torch.int64
            assert t["aux_hidden"].dtype == torch.bfloat16 and t["last_hidden"].dtype == torch.bfloat16
            n_tok = len(t["input_ids"])
            assert (s["n_tok"], s["n_seq"]) == (n_tok, len(t["seq_index"]))
            assert t["offsets"][0] == 0 and t["offsets"][-1] == n_tok and len(t["offsets"]) == s["n_seq"] + 1
            assert t["aux_hidden"].shape == (n_tok, 3 * 64) and t["last_hidden"].shape == (n_tok, 64)
            # a shard closes once it reaches shard_tokens: all but its last sequence fit below the limit
            assert n_tok - int(t["offsets"][-1] - t["offsets"][-2]) < cfg.shard_tokens
            for j, row in enumerate(t["seq_index"].tolist()):
                a, b = int(t["offsets"][j]), int(t["offsets"][j + 1])
                assert t["input_ids"][a:b].tolist() == src["input_ids"][row]
                assert t["loss_mask"][a:b].tolist() == src["loss_mask"][row]
                seen.append(row)
        assert sorted(seen) == list(range(len(src["input_ids"])))  # every row exactly once
        fs = FeatureShards(out, split)
        assert fs.lengths() == [len(src["input_ids"][r]) for r in fs.seq_indices()]
        assert fs[-1]["loss_mask"].tolist() == src["loss_mask"][fs.seq_indices()[-1]]
        with pytest.raises(IndexError):
            fs[len(fs)]
    assert not temp_files(out) and not list(out.glob("manifest.r*.json"))


def test_plan_is_length_sorted_and_batches_fit():
    lengths = [5, 30, 0, 12, 30, 7, 40, 3]
    shards = plan_shards("train", lengths, shard_tokens=50)
    order = [r for s in shards for r in s.rows]
    assert order == [6, 1, 4, 3, 5, 0, 7]  # longest first, ties by row, the empty row skipped
    assert [s.index for s in shards] == list(range(len(shards)))
    assert plan_shards("train", lengths, 50) == shards  # deterministic
    plan = ShardPlan("train", 0, [6, 1, 4, 3, 5], [40, 30, 30, 12, 7])
    batches = plan.batches(64)
    assert batches == [(0, 1), (1, 3), (3, 5)]
    for a, b in batches:  # padded size (longest row x rows) within the budget, unless a single row
        assert b - a == 1 or plan.lengths[a] * (b - a) <= 64


def test_max_sequences_takes_first_rows(tmp_path, target, data_dir):
    cfg = CollectConfig(output_dir=str(tmp_path / "f"), max_sequences=5, splits=["train"], dtype="float16")
    manifest = collect(cfg, data_dir, target)
    assert manifest["splits"]["train"]["num_sequences"] == 5 and "val" not in manifest["splits"]
    assert sorted(FeatureShards(tmp_path / "f", "train").seq_indices()) == [0, 1, 2, 3, 4]


# ------------------------------------------------------------------------------------- resume, corruption


def test_rerun_keeps_finished_shards_and_rebuilds_a_corrupt_one(tmp_path, target, data_dir, caplog):
    out = tmp_path / "f"
    cfg = CollectConfig(output_dir=str(out), shard_tokens=120, batch_tokens=128, splits=["train"])
    collect(cfg, data_dir, target)
    files = shard_files(out)
    assert len(files) >= 3
    before = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns, p.read_bytes()) for p in files}
    collect(cfg, data_dir, target)  # nothing to do: no shard is rewritten
    assert {
        p.name: (p.stat().st_ino, p.stat().st_mtime_ns, p.read_bytes()) for p in shard_files(out)
    } == before

    victim = files[1]
    data = bytearray(victim.read_bytes())
    data[-10] ^= 0xFF  # inside the tensor data: the file still parses, only the checksum can tell
    victim.write_bytes(bytes(data))
    fs = FeatureShards(out, "train")
    shard_of_victim = [i for i in range(len(fs)) if int(fs._shard_of[i]) == 1][0]
    fs[0]  # shard 0 is fine
    with pytest.raises(EagleError, match=r"corrupt \(checksum mismatch\).*eagle collect"):
        fs[shard_of_victim]
    with pytest.raises(EagleError, match="checksum mismatch"):
        FeatureShards(out, "train").verify()

    with caplog.at_level(logging.WARNING, logger="train.collect"):
        collect(cfg, data_dir, target)
    assert any(victim.name in r.getMessage() and "checksum" in r.getMessage() for r in caplog.records)
    after = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns, p.read_bytes()) for p in shard_files(out)}
    assert after[victim.name][2] == before[victim.name][2]  # rebuilt, byte for byte
    for name in before:
        if name != victim.name:
            assert after[name] == before[name]  # untouched
    FeatureShards(out, "train").verify()


def _start_worker(model_dir: Path, data: Path, out: Path, log_path: Path, slow: str) -> subprocess.Popen:
    """`tests/_collect_worker.py` in a subprocess, sleeping ``slow`` seconds per batch (EAGLE_COLLECT_SLOW)."""
    args = [sys.executable, str(WORKER), str(model_dir), str(data), str(out), "150", "64", "bfloat16"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "EAGLE_COLLECT_SLOW": slow}
    with open(log_path, "wb") as log:  # a file, not a pipe: a full pipe would stall the worker
        return subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT)


Saved = namedtuple("Saved", "model_dir data ref")


def _collect_saved(model_dir: Path, data: Path, out: Path) -> None:
    """In this process, exactly what the worker does in its own (same settings, one thread)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager")
    cfg = CollectConfig(output_dir=str(out), shard_tokens=150, batch_tokens=64, dtype="bfloat16")
    collect(cfg, data, Target.from_model(model, name="tiny-saved"))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny target saved to disk (so other processes can load it) and an uninterrupted reference run."""
    root = tmp_path_factory.mktemp("saved")
    tiny_model("llama", seed=3).save_pretrained(root / "model")
    data = make_data(root / "data", sizes=(("train", 30), ("val", 6)), seed=1)
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # module-scoped: runs before the autouse fixture
    try:
        _collect_saved(root / "model", data, root / "ref")
    finally:
        torch.set_num_threads(before)
    return Saved(root / "model", data, root / "ref")


def test_resume_after_kill_is_byte_identical(tmp_path, saved):
    out = tmp_path / "f"
    ref_files = sorted(p.relative_to(saved.ref) for p in saved.ref.rglob("shard-*.safetensors"))
    assert len(ref_files) >= 4
    log = tmp_path / "worker.log"
    proc = _start_worker(saved.model_dir, saved.data, out, log, slow="0.2")
    try:
        deadline = time.time() + 120
        # kill while shard 0 is finished and the next one is being streamed into its temporary file; the worker
        # is frozen before the second look, so the file seen cannot be renamed between the look and the kill
        while time.time() < deadline and proc.poll() is None:
            if shard_files(out) and shard_temp_files(out):
                proc.send_signal(signal.SIGSTOP)
                if shard_temp_files(out):
                    break
                proc.send_signal(signal.SIGCONT)
            time.sleep(0.02)
        assert shard_files(out), f"no shard appeared: {log.read_text()[-2000:]}"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    first = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in shard_files(out)}
    assert 1 <= len(first) < len(shard_files(saved.ref))  # killed mid-run
    assert shard_temp_files(out)  # ... leaving a partial shard behind, under a hidden temporary name
    assert not json.loads((out / "manifest.json").read_text())["complete"]
    with pytest.raises(EagleError, match="unfinished"):
        FeatureShards(out, "train")

    _collect_saved(saved.model_dir, saved.data, out)
    files = sorted(p.relative_to(out) for p in out.rglob("shard-*.safetensors"))
    assert files == ref_files
    for rel in files:
        assert (out / rel).read_bytes() == (saved.ref / rel).read_bytes(), rel
    for name, stat in first.items():  # the shards finished before the kill were kept, not rewritten
        p = out / "train" / name
        assert (p.stat().st_ino, p.stat().st_mtime_ns) == stat
    assert not temp_files(out)
    got, ref = (json.loads((d / "manifest.json").read_text()) for d in (out, saved.ref))
    assert got["complete"] and got["splits"] == ref["splits"]


def test_rerun_removes_manifest_temp_files_a_kill_left(tmp_path, saved):
    """A kill while a manifest was being written leaves its temporary file; the next run removes it."""
    out = tmp_path / "f"
    shutil.copytree(saved.ref, out)
    planted = []
    for name in ("manifest.json", "manifest.r0.json"):
        p = fileio._temp_name(out / name)  # the very name an interrupted write would have left
        p.write_text('{"half": ', encoding="utf-8")
        planted.append(p)
    _collect_saved(saved.model_dir, saved.data, out)
    assert not [p for p in planted if p.exists()]
    assert not temp_files(out)
    assert json.loads((out / "manifest.json").read_text())["complete"]


@pytest.mark.multiproc
def test_two_processes_give_the_same_shards(tmp_path, saved):
    out = tmp_path / "f"
    args = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "2", str(WORKER)]
    args += [str(saved.model_dir), str(saved.data), str(out), "150", "64", "bfloat16"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("worker done") == 2
    names = [p.name for p in shard_files(out)]
    assert any(n.startswith("shard-r00-") for n in names) and any(n.startswith("shard-r01-") for n in names)
    assert not list(out.glob("manifest.r*.json"))
    for split in ("train", "val"):
        two, one = FeatureShards(out, split), FeatureShards(saved.ref, split)
        two.verify()
        assert sorted(two.seq_indices()) == sorted(one.seq_indices())
        pos_two = {r: i for i, r in enumerate(two.seq_indices())}
        for i, r in enumerate(one.seq_indices()):
            a, b = one[i], two[pos_two[r]]
            for key in a:
                assert torch.equal(a[key], b[key]), (split, r, key)


# ------------------------------------------------------------------------------------------- bad inputs


def test_manifest_of_another_target_is_refused(tmp_path, target, data_dir):
    out = tmp_path / "f"
    cfg = CollectConfig(output_dir=str(out), splits=["val"])
    collect(cfg, data_dir, target)
    other = Target.from_model(tiny_model("llama", seed=7), name="other-llama")
    assert other.fingerprint != target.fingerprint
    with pytest.raises(EagleError, match=r"collected for target tiny-llama .*not other-llama.*delete it"):
        collect(cfg, data_dir, other)
    with pytest.raises(EagleError, match="aux_layers"):
        collect(CollectConfig(output_dir=str(out), splits=["val"], aux_layers=[1, 4]), data_dir, target)
    with pytest.raises(EagleError, match="dtype"):
        collect(CollectConfig(output_dir=str(out), splits=["val"], dtype="float32"), data_dir, target)
    with pytest.raises(EagleError, match="collected for target tiny-llama"):
        FeatureShards(out, "val", expected_fingerprint=other.fingerprint)
    with pytest.raises(EagleError, match="was not collected"):
        FeatureShards(out, "train")
    other_data = make_data(tmp_path / "other", sizes=(("val", 6),), seed=5)
    with pytest.raises(EagleError, match=r"split 'val' .* from other data.*data_hash.*delete it"):
        collect(cfg, other_data, target)
    collect(cfg, data_dir, target)  # the same target, data and settings: accepted (nothing to redo)


def test_token_ids_beyond_the_vocabulary_are_refused(tmp_path, target):
    Dataset.from_dict({"input_ids": [[5, 300, 7]], "loss_mask": [[0, 1, 1]]}).save_to_disk(
        str(tmp_path / "d" / "train")
    )
    with pytest.raises(EagleError, match="token id 300.*vocabulary of 256.*eagle prepare"):
        collect(CollectConfig(output_dir=str(tmp_path / "f"), splits=["train"]), tmp_path / "d", target)
    assert not list((tmp_path / "f").rglob("*.safetensors")) and not temp_files(tmp_path / "f")


def test_not_enough_disk_fails_before_writing(tmp_path, target, data_dir, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 20_000, 20_000))
    out = tmp_path / "f"
    with pytest.raises(
        EagleError, match=r"not enough disk space.*bytes/token.*20\.0 KB is free.*max_sequences"
    ):
        collect(CollectConfig(output_dir=str(out)), data_dir, target)
    assert not out.exists()


def test_empty_or_missing_data_is_refused(tmp_path, target):
    Dataset.from_dict({"input_ids": [], "loss_mask": []}).save_to_disk(str(tmp_path / "data" / "train"))
    with pytest.raises(EagleError, match="has no tokens"):
        collect(CollectConfig(output_dir=str(tmp_path / "f"), splits=["train"]), tmp_path / "data", target)
    with pytest.raises(EagleError, match="'val' not found.*eagle prepare"):
        collect(CollectConfig(output_dir=str(tmp_path / "f"), splits=["val"]), tmp_path / "data", target)
    assert not (tmp_path / "f").exists()
    with pytest.raises(EagleError, match="manifest.json missing"):
        FeatureShards(tmp_path / "f")


@pytest.mark.parametrize(
    "bad",
    [
        dict(dtype="int8"),
        dict(aux_layers=[]),
        dict(aux_layers=[0, 2]),
        dict(aux_layers=[2, 2]),
        dict(batch_tokens=0),
        dict(shard_tokens=0),
        dict(splits=[]),
        dict(splits=["train", "train"]),
        dict(max_sequences=0),
        dict(disk_headroom=0.5),
    ],
)
def test_config_validation(bad):
    with pytest.raises(EagleError, match="collect\\."):
        CollectConfig(**bad).validate()
    CollectConfig().validate()


def test_aux_layers_beyond_the_target_are_refused(tmp_path, target, data_dir):
    with pytest.raises(EagleError, match="outside 1..4"):
        collect(CollectConfig(output_dir=str(tmp_path / "f"), aux_layers=[1, 5]), data_dir, target)
