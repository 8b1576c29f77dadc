"""Feature collection (`eagle collect`): run the frozen target over prepared data and store its hidden states.

Layout of ``collect.output_dir``::

    manifest.json            target, fingerprint, aux layers, storage dtype, per split the shard list with sha256
    manifest.r{rank}.json    one process's progress while collecting (merged into manifest.json at the end)
    <split>/shard-r{rank:02d}-{index:05d}.safetensors

``index`` is the shard's number in the split's plan and ``rank`` the process that wrote it. A shard is packed
(no padding): ``input_ids`` int32 [N], ``loss_mask`` uint8 [N], ``offsets`` int64 [n+1], ``seq_index`` int64 [n]
(rows of the prepared dataset), ``aux_hidden`` [N, k*h] and ``last_hidden`` [N, h] in the storage dtype.

The work is planned deterministically from the data and the config: sequences sorted by length (longest
first, so an out-of-memory batch shows up at once) are cut into shards of about ``shard_tokens`` tokens, and
the shards are dealt to processes round robin. Each shard is streamed into a temporary file and renamed into
place, so a killed run leaves only complete shards; a rerun verifies and keeps them and writes the rest (also
with another number of processes, or a smaller ``batch_tokens`` after running out of memory).

Rows whose features regeneration already kept (``data.capture_features``, ``train/regen_features.py``) are copied
from there instead of recomputed; such a row's positions after its last label may be zeros (never read).

Test hook: the environment variable ``EAGLE_COLLECT_SLOW=<seconds>`` sleeps that long before every forward
batch, so tests can kill a run between two shards deterministically. It has no other effect.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from eagle.devices import model_device
from eagle.errors import EagleError
from eagle.fileio import fsync_dir, remove_stale_temps, write_json_atomic
from train.launch import process_state
from train.shards import (
    FORMAT,
    SAFETENSORS_DTYPES,
    STORAGE_DTYPES,
    TENSOR_NAMES,
    bytes_per_token,
    read_json,
    sha256_file,
    storage_layout,
)

log = logging.getLogger(__name__)

SLOW_ENV = "EAGLE_COLLECT_SLOW"


@dataclass
class CollectConfig:
    """The ``collect:`` section of a run config."""

    output_dir: str = "runs/demo/features"  # where the feature shards go
    aux_layers: list[int] | None = None  # None: the target's default (eagle.features.default_aux_layers)
    dtype: str = "bfloat16"  # storage dtype of the hidden states
    # the dtype the target computes the features in; null: target.dtype. A bf16 target's features train a head
    # as well as fp32 ones; with data.regen_dtype the same, regeneration's capture is used
    target_dtype: str | None = None
    batch_tokens: int = 8192  # padded tokens per forward batch
    shard_tokens: int = 200_000  # tokens per shard file
    splits: list[str] = field(default_factory=lambda: ["train", "val"])  # the prepared splits to collect
    max_sequences: int | None = None  # per split: only the first N rows of the prepared data
    disk_headroom: float = 1.1  # refuse to start unless free space >= needed * disk_headroom

    def validate(self) -> None:
        """Raise EagleError on values that cannot work."""
        if self.dtype not in STORAGE_DTYPES:
            raise EagleError(f"collect.dtype must be one of {list(STORAGE_DTYPES)}, got {self.dtype!r}")
        if self.target_dtype is not None and self.target_dtype not in STORAGE_DTYPES:
            raise EagleError(
                f"collect.target_dtype must be null (target.dtype) or one of {list(STORAGE_DTYPES)}, "
                f"got {self.target_dtype!r}"
            )
        layers = self.aux_layers
        if layers is not None and (not layers or min(layers) < 1 or len(set(layers)) != len(layers)):
            raise EagleError(
                f"collect.aux_layers must list distinct hidden-state indices >= 1 (k = output of decoder layer "
                f"k-1), got {layers}: or leave it unset for the target's default"
            )
        for name in ("batch_tokens", "shard_tokens"):
            if getattr(self, name) < 1:
                raise EagleError(f"collect.{name} must be >= 1, got {getattr(self, name)}")
        if not self.splits or len(set(self.splits)) != len(self.splits):
            raise EagleError(
                f"collect.splits must name distinct splits (e.g. [train, val]), got {self.splits}"
            )
        if self.max_sequences is not None and self.max_sequences < 1:
            raise EagleError(f"collect.max_sequences must be >= 1 or unset (all), got {self.max_sequences}")
        if self.disk_headroom < 1.0:
            raise EagleError(f"collect.disk_headroom must be >= 1.0, got {self.disk_headroom}")


# ----------------------------------------------------------------------------------------------------------
# small file helpers


def _tmp_name(final: Path) -> Path:
    return final.with_name(f".{final.name}.tmp-{os.getpid()}")


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def _free_bytes(path: Path) -> int:
    """Free space on the file system that will hold ``path`` (which may not exist yet)."""
    probe = path.absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return shutil.disk_usage(probe).free


class _ShardWriter:
    """Streams one safetensors file: sizes are known from the plan, so the header goes first and the
    tensors' rows are written batch by batch at their offsets (a shard never has to fit in memory)."""

    def __init__(self, path: Path, specs: Sequence[tuple[str, torch.dtype, tuple[int, ...]]], meta: dict):
        header: dict[str, Any] = {"__metadata__": meta}
        self._where: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, dtype, shape in specs:
            row_bytes = math.prod(shape[1:]) * dtype.itemsize
            nbytes = shape[0] * row_bytes
            header[name] = {
                "dtype": SAFETENSORS_DTYPES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            self._where[name] = (offset, row_bytes)
            offset += nbytes
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned
        self._start = 8 + len(blob)
        self._fh = open(path, "wb")
        self._fh.write(struct.pack("<Q", len(blob)) + blob)
        self._fh.truncate(self._start + offset)

    def write_rows(self, name: str, row: int, tensor: torch.Tensor) -> None:
        offset, row_bytes = self._where[name]
        self._fh.seek(self._start + offset + row * row_bytes)
        self._fh.write(tensor.contiguous().view(torch.uint8).numpy().data)

    def close(self) -> None:
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()

    def abort(self) -> None:
        if not self._fh.closed:
            self._fh.close()


# ----------------------------------------------------------------------------------------------------------
# the plan


@dataclass
class ShardPlan:
    """One planned shard: which dataset rows (in storage order) go into it."""

    split: str
    index: int
    rows: list[int]
    lengths: list[int]

    @property
    def n_tok(self) -> int:
        return sum(self.lengths)

    def batches(self, batch_tokens: int) -> list[tuple[int, int]]:
        """(start, end) positions of the forward batches: rows are sorted longest first, so a batch's padded
        size is its first row's length times its row count, kept within ``batch_tokens``."""
        out, start = [], 0
        while start < len(self.rows):
            end = start + 1
            while end < len(self.rows) and self.lengths[start] * (end - start + 1) <= batch_tokens:
                end += 1
            out.append((start, end))
            start = end
        return out


def plan_shards(split: str, lengths: Sequence[int], shard_tokens: int) -> list[ShardPlan]:
    """Cut a split into shards: rows sorted by length (longest first, ties by row), about ``shard_tokens``
    tokens each. Empty rows are skipped. Depends only on the lengths and ``shard_tokens``."""
    order = sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: (-lengths[i], i))
    shards: list[ShardPlan] = []
    rows: list[int] = []
    tokens = 0
    for i in order:
        rows.append(i)
        tokens += lengths[i]
        if tokens >= shard_tokens:
            shards.append(ShardPlan(split, len(shards), rows, [lengths[r] for r in rows]))
            rows, tokens = [], 0
    if rows:
        shards.append(ShardPlan(split, len(shards), rows, [lengths[r] for r in rows]))
    return shards


def shard_file_name(rank: int, index: int) -> str:
    """``shard-r{rank:02d}-{index:05d}.safetensors``."""
    return f"shard-r{rank:02d}-{index:05d}.safetensors"


def _row_lengths(ds) -> list[int]:
    try:  # arrow list lengths: no Python lists of token ids
        import pyarrow.compute as pc

        return [int(n) for n in pc.list_value_length(ds.data.column("input_ids")).to_pylist()]
    except Exception:  # pragma: no cover - other table backends
        return [len(x) for x in ds["input_ids"]]


def _prepare_config_hash(data_dir: Path) -> str | None:
    """``config_hash`` of prepare_meta.json (the settings the data was prepared with), when there is one."""
    try:
        return json.loads((data_dir / "prepare_meta.json").read_text(encoding="utf-8")).get("config_hash")
    except (OSError, ValueError, AttributeError):
        return None


def _data_hash(ds, n_rows: int) -> str:
    """Identifies the token data a split's features came from: a hash of the dataset's arrow files (content,
    so an identical re-preparation keeps its features) and of the number of rows used."""
    h = hashlib.sha256(f"{n_rows}|{len(ds)}".encode())
    files = [c["filename"] for c in getattr(ds, "cache_files", [])]
    for name in files:
        h.update(sha256_file(name).encode())
    if not files:  # an in-memory dataset: its fingerprint is the best we have
        h.update(str(getattr(ds, "_fingerprint", "")).encode())
    return h.hexdigest()[:16]


def _load_split(data_dir: Path, split: str, max_sequences: int | None):
    from datasets import load_from_disk

    path = data_dir / split
    if not path.is_dir():
        raise EagleError(
            f"split {split!r} not found at {path}: run `eagle prepare` first, or remove it from collect.splits"
        )
    empty = f"split {split!r} at {path} has no tokens: prepare more data or drop it from collect.splits"
    try:
        state = json.loads((path / "state.json").read_text())
    except (OSError, ValueError):
        state = None
    if state is not None and state.get("_data_files") == []:  # saved empty: load_from_disk cannot read it
        raise EagleError(empty)
    try:
        ds = load_from_disk(str(path))
    except Exception as exc:
        raise EagleError(f"{path} is not a prepared dataset ({exc}): rerun `eagle prepare`") from exc
    missing = {"input_ids", "loss_mask"} - set(ds.column_names)
    if missing:
        raise EagleError(f"{path} lacks column(s) {sorted(missing)}: rerun `eagle prepare`")
    from train.batching import check_token_columns

    check_token_columns(ds, path)
    n_rows = len(ds) if max_sequences is None else min(len(ds), max_sequences)
    lengths = _row_lengths(ds)[:n_rows]
    if sum(lengths) == 0:
        raise EagleError(empty)
    return ds, lengths


# ----------------------------------------------------------------------------------------------------------
# collection


def _shard_bytes(shard: ShardPlan, bpt: int) -> int:
    return shard.n_tok * bpt + 16 * len(shard.rows) + 8 + 1024  # + offsets/seq_index + header


def _existing_files(split_dir: Path, index: int) -> list[Path]:
    return sorted(split_dir.glob(f"shard-r*-{index:05d}.safetensors"))


def _check_shard(path: Path, shard: ShardPlan, meta: dict, known_sha: str | None) -> tuple[str | None, str]:
    """(sha256, "") when ``path`` is a finished shard for this plan, else (None, why not)."""
    try:
        with safe_open(str(path), framework="pt") as fh:
            found = fh.metadata() or {}
            seq_index = fh.get_tensor("seq_index").tolist()
            n_tok = fh.get_slice("input_ids").get_shape()[0]
            keys = set(fh.keys())
    except Exception as exc:
        return None, f"it does not load ({exc})"
    if found != meta:
        return None, "it was written for another target, layer set, dtype or data"
    if seq_index != shard.rows or n_tok != shard.n_tok or keys != TENSOR_NAMES:
        return None, "its sequences differ from the plan"
    sha = sha256_file(path)
    if known_sha is not None and sha != known_sha:
        return None, "its checksum does not match the manifest"
    return sha, ""


def _known_checksums(out: Path) -> dict[tuple[str, str], str]:
    """(split, file) -> sha256 from the manifest and any per-process progress files."""
    known: dict[tuple[str, str], str] = {}
    for path in [out / "manifest.json", *sorted(out.glob("manifest.r*.json"))]:
        data = read_json(path) or {}
        for split, entry in (data.get("splits") or {}).items():
            for s in entry.get("shards", []):
                known[(split, s["file"])] = s["sha256"]
    return known


def _check_compatible(out: Path, header: dict, splits: dict[str, dict]) -> dict | None:
    """Refuse to mix features of another target, layer set, dtype, data or plan into ``out``."""
    old = read_json(out / "manifest.json")
    if old is None:
        return None
    if old.get("format") != FORMAT:
        raise EagleError(f"{out} holds something other than eagle features: use another collect.output_dir")
    if old.get("target_fingerprint") != header["target_fingerprint"]:
        raise EagleError(
            f"features in {out} were collected for target {old.get('target')} (fingerprint "
            f"{str(old.get('target_fingerprint'))[:12]}), not {header['target']} (fingerprint "
            f"{header['target_fingerprint'][:12]}): use another collect.output_dir or delete it"
        )
    for key in ("aux_layers", "dtype", "hidden_size"):
        if old.get(key) != header[key]:
            raise EagleError(
                f"features in {out} were collected with {key}={old.get(key)}, not {header[key]}: "
                f"use another collect.output_dir or delete it"
            )
    for split, entry in splits.items():
        prev = (old.get("splits") or {}).get(split)
        if prev is None:
            continue
        for key in ("data_hash", "shard_tokens", "num_sequences", "num_shards"):
            if prev.get(key) != entry[key]:
                raise EagleError(
                    f"features of split {split!r} in {out} were collected from other data or settings "
                    f"({key} {prev.get(key)} != {entry[key]}; check data.output_dir, collect.shard_tokens and "
                    f"collect.max_sequences): use another collect.output_dir or delete it"
                )
    return old


def _check_row(shard: ShardPlan, row: int, tok: list[int], lm: list[int], target: Any) -> None:
    """A prepared row must have one loss-mask entry per token and ids inside the target's vocabulary."""
    if len(lm) != len(tok):
        raise EagleError(
            f"row {row} of split {shard.split!r} has {len(tok)} tokens but {len(lm)} loss-mask entries: "
            "rerun `eagle prepare`"
        )
    if max(tok) >= target.vocab_size or min(tok) < 0:
        bad_id = max(tok) if max(tok) >= target.vocab_size else min(tok)
        raise EagleError(
            f"split {shard.split!r} has token id {bad_id} but {target.name} has a vocabulary of "
            f"{target.vocab_size}: the data was prepared for another tokenizer; rerun `eagle prepare`"
        )


def _forward(target: Any, token_rows: list[list[int]], aux_layers: list[int], batch_tokens: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's (aux, last) features of a right-padded batch of rows (``eagle.features.capture_features``)."""
    from eagle.features import capture_features

    slow = float(os.environ.get(SLOW_ENV, "0") or 0)
    if slow > 0:
        time.sleep(slow)
    width = max(len(tok) for tok in token_rows)
    ids = torch.zeros(len(token_rows), width, dtype=torch.long)
    mask = torch.zeros(len(token_rows), width, dtype=torch.long)
    for i, tok in enumerate(token_rows):
        ids[i, : len(tok)] = torch.tensor(tok, dtype=torch.long)
        mask[i, : len(tok)] = 1
    device = model_device(target.model)
    try:
        with torch.inference_mode():
            return capture_features(target.model, ids.to(device), mask.to(device), aux_layers)
    except torch.OutOfMemoryError as exc:
        raise EagleError(
            f"out of memory on a batch of {len(token_rows)} x {width} tokens: lower collect.batch_tokens "
            f"(now {batch_tokens}) and rerun; finished shards are kept"
        ) from exc


def _collect_shard(
    shard: ShardPlan,
    ds,
    target,
    aux_layers: list[int],
    dtype: torch.dtype,
    batch_tokens: int,
    final: Path,
    meta: dict,
    bar,
    captured: Callable[[int, list[int], list[int]], tuple[torch.Tensor, torch.Tensor] | None] | None = None,
) -> dict:
    """Run the target over one shard's rows and write the shard atomically; returns its manifest entry.

    ``captured(row, input_ids, loss_mask)`` may give a row's features kept from regeneration; only the other
    rows of a batch go through the target. The entry counts those rows' tokens as ``captured_tokens`` (for the
    log; the caller drops it from the manifest entry)."""
    offsets = [0]
    for n in shard.lengths:
        offsets.append(offsets[-1] + n)
    tmp = _tmp_name(final)
    writer = _ShardWriter(tmp, storage_layout(len(aux_layers), target.hidden_size, dtype, offsets[-1],
                                              len(shard.rows)), meta)
    loss_tokens = captured_tokens = 0
    try:
        writer.write_rows("offsets", 0, torch.tensor(offsets, dtype=torch.int64))
        writer.write_rows("seq_index", 0, torch.tensor(shard.rows, dtype=torch.int64))
        for start, end in shard.batches(batch_tokens):
            rows = ds[shard.rows[start:end]]
            todo = []  # batch positions the target must run over
            for j, (tok, lm) in enumerate(zip(rows["input_ids"], rows["loss_mask"])):
                _check_row(shard, shard.rows[start + j], tok, lm, target)
                at = offsets[start + j]
                writer.write_rows("input_ids", at, torch.tensor(tok, dtype=torch.int32))
                writer.write_rows("loss_mask", at, torch.tensor(lm, dtype=torch.uint8))
                loss_tokens += int(sum(lm))
                kept = captured(shard.rows[start + j], tok, lm) if captured is not None else None
                if kept is None:
                    todo.append(j)
                    continue
                writer.write_rows("aux_hidden", at, kept[0].to(dtype))
                writer.write_rows("last_hidden", at, kept[1].to(dtype))
                captured_tokens += len(tok)
            if todo:
                aux, last = _forward(target, [rows["input_ids"][j] for j in todo], aux_layers, batch_tokens)
                for i, j in enumerate(todo):
                    n = len(rows["input_ids"][j])
                    writer.write_rows("aux_hidden", offsets[start + j], aux[i, :n].to(dtype).cpu())
                    writer.write_rows("last_hidden", offsets[start + j], last[i, :n].to(dtype).cpu())
            if bar is not None:
                bar.update(offsets[end] - offsets[start])
        writer.close()
        sha = sha256_file(tmp)
        os.replace(tmp, final)
        fsync_dir(final.parent)
    finally:
        writer.abort()
        tmp.unlink(missing_ok=True)
    return {"file": final.name, "index": shard.index, "n_seq": len(shard.rows), "n_tok": offsets[-1],
            "loss_tokens": loss_tokens, "captured_tokens": captured_tokens, "sha256": sha}


def _check_disk(
    cfg: CollectConfig, out: Path, shards: list[ShardPlan], bpt: int, what: str, main: bool
) -> None:
    """Print the disk cost and refuse to start when the shards not on disk yet do not fit (with headroom).
    Every process computes the same numbers, so all of them stop together."""
    total = sum(_shard_bytes(s, bpt) for s in shards)
    needed = sum(_shard_bytes(s, bpt) for s in shards if not _existing_files(out / s.split, s.index))
    free = _free_bytes(out)
    n_tok = sum(s.n_tok for s in shards)
    if main:
        print(
            f"collect: {n_tok:,} tokens in {len(shards)} shards ({', '.join(cfg.splits)}), {bpt:,} bytes/token "
            f"({what}): {_human(total)} in all, {_human(needed)} still to write, {_human(free)} free in {out}",
            flush=True,
        )
    if needed * cfg.disk_headroom > free:
        smaller = ", collect.dtype=bfloat16 or float16 (half of float32)" if cfg.dtype == "float32" else ""
        raise EagleError(
            f"not enough disk space for the features in {out}: they need {_human(needed)} ({n_tok:,} tokens x "
            f"{bpt:,} bytes/token, x{cfg.disk_headroom} headroom = {_human(needed * cfg.disk_headroom)}) but "
            f"only {_human(free)} is free. Collect fewer sequences (collect.max_sequences){smaller}, use a "
            f"collect.output_dir on a larger disk, or train online (train.mode=online: features computed in the "
            f"training step, nothing stored)"
        )


def _scan_finished(
    out: Path, mine: list[ShardPlan], header: dict, split_info: dict, known: dict
) -> tuple[dict[str, list[dict]], list[ShardPlan]]:
    """Sort this process's shards into finished ones (verified, kept as they are: their manifest entries) and
    the ones still to write; drops temporary files and invalid shards (with a warning)."""
    entries: dict[str, list[dict]] = {split: [] for split in split_info}
    todo: list[ShardPlan] = []
    for shard in mine:
        split_dir = out / shard.split
        for stale in split_dir.glob(f".shard-r*-{shard.index:05d}.safetensors.tmp-*"):
            stale.unlink(missing_ok=True)
        meta = _shard_meta(header, split_info[shard.split], shard)
        done = None
        for path in _existing_files(split_dir, shard.index):
            if done is not None:  # a second copy (e.g. from a run with another world size): drop it
                path.unlink(missing_ok=True)
                continue
            sha, why = _check_shard(path, shard, meta, known.get((shard.split, path.name)))
            if sha is None:
                log.warning("rewriting shard %s: %s", path, why)
                path.unlink(missing_ok=True)
                continue
            done = {"file": path.name, "index": shard.index, "n_seq": len(shard.rows), "n_tok": shard.n_tok}
            done.update(loss_tokens=_loss_tokens(path), sha256=sha)
        if done is not None:
            entries[shard.split].append(done)
        else:
            todo.append(shard)
    return entries, todo


def _plan(cfg: CollectConfig, data_dir: Path) -> tuple[dict, dict, dict]:
    """Per split: the prepared dataset, its shard plan, and what the manifest records of it."""
    datasets, plans, split_info = {}, {}, {}
    for split in cfg.splits:
        ds, lengths = _load_split(data_dir, split, cfg.max_sequences)
        datasets[split] = ds
        plans[split] = plan_shards(split, lengths, cfg.shard_tokens)
        split_info[split] = {
            "data_hash": _data_hash(ds, len(lengths)),
            "prepare_config_hash": _prepare_config_hash(data_dir),
            "shard_tokens": cfg.shard_tokens,
            "num_sequences": sum(len(s.rows) for s in plans[split]),
            "num_tokens": sum(s.n_tok for s in plans[split]),
            "num_shards": len(plans[split]),
        }
    return datasets, plans, split_info


def _announce(out: Path, header: dict, split_info: dict, old: dict | None, splits: Sequence[str]) -> None:
    """Record what is being collected before any shard exists (rank 0), so that a rerun can check it."""
    remove_stale_temps(out / "manifest.json")
    kept = {k: v for k, v in ((old or {}).get("splits") or {}).items() if k not in splits}
    write_json_atomic(
        {**header, "complete": False, "splits": {**kept, **{k: {**v, "shards": []} for k, v in split_info.items()}}},
        out / "manifest.json",
    )


def collect(cfg: CollectConfig, data_dir: str | os.PathLike, target) -> dict:
    """Collect the target's hidden states over the prepared data into resumable shards; returns the manifest.

    ``target`` is an ``eagle.targets.Target`` (frozen model on its device). Under ``torchrun`` /
    ``accelerate launch`` every process takes shards ``i % world == rank`` and rank 0 writes the manifest.
    """
    from eagle.features import check_aux_layers, default_aux_layers

    cfg.validate()
    data_dir, out = Path(data_dir), Path(cfg.output_dir)
    aux_layers = (default_aux_layers(target.num_layers) if cfg.aux_layers is None
                  else check_aux_layers(list(cfg.aux_layers), target.num_layers))
    state = process_state(model_device(target.model))
    header = {
        "format": FORMAT, "target": target.name, "target_fingerprint": target.fingerprint,
        "hidden_size": int(target.hidden_size), "num_layers": int(target.num_layers),
        "vocab_size": int(getattr(target, "vocab_size", 0) or 0), "aux_layers": aux_layers, "dtype": cfg.dtype,
    }
    datasets, plans, split_info = _plan(cfg, data_dir)
    old = _check_compatible(out, header, split_info)
    bpt = bytes_per_token(len(aux_layers), target.hidden_size, cfg.dtype)
    all_shards = [s for split in cfg.splits for s in plans[split]]
    _check_disk(cfg, out, all_shards, bpt, f"{len(aux_layers)}+1 x {target.hidden_size} x {cfg.dtype}",
                state.is_main_process)
    known = _known_checksums(out)  # before rank 0 rewrites manifest.json below
    for split in cfg.splits:
        (out / split).mkdir(parents=True, exist_ok=True)
    state.wait_for_everyone()
    if state.is_main_process:
        _announce(out, header, split_info, old, cfg.splits)
    state.wait_for_everyone()
    # this process's slice: global shard order across splits, dealt round robin
    mine = [s for g, s in enumerate(all_shards) if g % state.num_processes == state.process_index]
    work = _Work(out, state, header, split_info, known, mine)
    work.run(datasets, target, aux_layers, cfg, _captured_lookup(data_dir, target, aux_layers, cfg.dtype), bpt)
    state.wait_for_everyone()
    if state.is_main_process:
        manifest = _merge(out, header, split_info, plans, state.num_processes, old, cfg.splits)
    state.wait_for_everyone()
    return manifest if state.is_main_process else read_json(out / "manifest.json")


class _Work:
    """This process's shards: those already done (verified), those to write, and the progress file."""

    def __init__(self, out: Path, state: Any, header: dict, split_info: dict, known: dict, mine: list[ShardPlan]):
        self.out, self.state, self.header, self.split_info, self.mine = out, state, header, split_info, mine
        self.rank, self.world = state.process_index, state.num_processes
        self.progress_path = out / f"manifest.r{self.rank}.json"
        remove_stale_temps(self.progress_path)
        self.entries, self.todo = _scan_finished(out, mine, header, split_info, known)
        self.save_progress()

    def save_progress(self) -> None:
        shards = {k: {"shards": v} for k, v in self.entries.items()}
        write_json_atomic({"rank": self.rank, "world": self.world, "splits": shards}, self.progress_path)

    def run(self, datasets: dict, target: Any, aux_layers: list[int], cfg: CollectConfig, captured: dict,
            bpt: int) -> None:
        """Write every shard still to do, saving progress after each; then say how it went."""
        from tqdm.auto import tqdm

        t0 = time.perf_counter()
        computed = copied = 0
        if self.todo:
            main = self.state.is_main_process
            with tqdm(total=sum(s.n_tok for s in self.todo), unit="tok", unit_scale=True, desc="collect",
                      disable=not main) as bar:
                for shard in self.todo:
                    final = self.out / shard.split / shard_file_name(self.rank, shard.index)
                    meta = _shard_meta(self.header, self.split_info[shard.split], shard)
                    entry = _collect_shard(shard, datasets[shard.split], target, aux_layers,
                                           STORAGE_DTYPES[cfg.dtype], cfg.batch_tokens, final, meta, bar,
                                           captured.get(shard.split))
                    copied += entry.pop("captured_tokens")  # logged, not kept: a resumed run's manifest is the same
                    self.entries[shard.split].append(entry)
                    computed += entry["n_tok"]
                    self.save_progress()
        elapsed = time.perf_counter() - t0
        rate = computed / max(elapsed, 1e-9)
        log.info("rank %d: %d tokens in %.1fs (%.0f tokens/s), %d bytes/token", self.rank, computed, elapsed,
                 rate, bpt)
        if self.state.is_main_process:
            kept = f", {copied:,} of them copied from regeneration's captures" if captured else ""
            print(f"collect: {computed:,} tokens in {elapsed:.1f}s ({rate:,.0f} tokens/s on this process{kept}), "
                  f"{bpt:,} bytes/token; {len(self.mine) - len(self.todo)} of this process's {len(self.mine)} "
                  "shards were already done", flush=True)


def _captured_lookup(data_dir: Path, target, aux_layers: list[int], dtype: str) -> dict[str, Callable]:
    """Per split, ``row, input_ids, loss_mask -> features | None`` from the features regeneration kept
    (``data.capture_features``) when they match this target and layout; empty when there are none."""
    from train.regen_features import CapturedFeatures, CaptureSpec

    spec = CaptureSpec.of(str(target.fingerprint), getattr(target, "dtype", None), aux_layers, dtype)
    kept = CapturedFeatures.find(data_dir, spec)
    if kept is None:
        return {}
    try:
        split_ids = json.loads((data_dir / "split_ids.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    log.info("collect: %d conversations' features were kept by regeneration in %s", len(kept), kept.folder)

    def lookup(ids: list[str]) -> Callable:
        return lambda row, tok, lm: kept.for_row(ids[row], tok, lm) if row < len(ids) else None

    return {split: lookup(list(ids)) for split, ids in split_ids.items()}


def _shard_meta(header: dict, info: dict, shard: ShardPlan) -> dict[str, str]:
    """What a shard file records about its origin (safetensors metadata is str -> str)."""
    return {
        "format": FORMAT,
        "target_fingerprint": header["target_fingerprint"],
        "aux_layers": json.dumps(header["aux_layers"]),
        "dtype": header["dtype"],
        "split": shard.split,
        "index": str(shard.index),
        "data_hash": info["data_hash"],
    }


def _loss_tokens(path: Path) -> int:
    with safe_open(str(path), framework="pt") as fh:
        return int(fh.get_tensor("loss_mask").sum())


def _merge(
    out: Path, header: dict, split_info: dict, plans: dict, world: int, old: dict | None, splits
) -> dict:
    """Rank 0: combine the processes' progress files into manifest.json (atomically)."""
    by_split: dict[str, dict[int, dict]] = {split: {} for split in splits}
    for r in range(world):
        data = read_json(out / f"manifest.r{r}.json") or {}
        for split, entry in (data.get("splits") or {}).items():
            for s in entry.get("shards", []):
                by_split[split][s["index"]] = s
    result_splits = {k: v for k, v in ((old or {}).get("splits") or {}).items() if k not in splits}
    for split in splits:
        missing = [s.index for s in plans[split] if s.index not in by_split[split]]
        if missing:
            raise EagleError(
                f"shards {missing[:5]} of split {split!r} in {out} were not written by any process: rerun "
                f"`eagle collect` to finish them"
            )
        shards = [by_split[split][s.index] for s in plans[split]]
        result_splits[split] = {
            **split_info[split],
            "loss_tokens": sum(s["loss_tokens"] for s in shards),
            "shards": shards,
        }
    bpt = bytes_per_token(len(header["aux_layers"]), header["hidden_size"], header["dtype"])
    manifest = {**header, "complete": True, "bytes_per_token": bpt, "splits": result_splits}
    write_json_atomic(manifest, out / "manifest.json")
    for path in out.glob("manifest.r*.json"):
        path.unlink(missing_ok=True)
    return manifest
