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

from eagle.errors import EagleError
from eagle.fileio import fsync_dir, remove_stale_temps, write_json_atomic

log = logging.getLogger(__name__)

FORMAT = "eagle-features-v1"
STORAGE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_ST_DTYPE = {
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
}
SLOW_ENV = "EAGLE_COLLECT_SLOW"


@dataclass
class CollectConfig:
    """The ``collect:`` section of a run config."""

    output_dir: str = "runs/demo/features"
    aux_layers: list[int] | None = None  # None: the target's default (eagle.targets.default_aux_layers)
    dtype: str = "bfloat16"  # storage dtype of the hidden states
    # the dtype the target computes the features in; null: target.dtype. A bf16 target's features train a head
    # as well as fp32 ones (TUNING.md run 38); with data.regen_dtype the same, regeneration's capture is used
    target_dtype: str | None = None
    batch_tokens: int = 8192  # padded tokens per forward batch
    shard_tokens: int = 200_000  # tokens per shard file
    splits: list[str] = field(default_factory=lambda: ["train", "val"])
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


def _read_json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise EagleError(f"{path} is unreadable ({exc}): delete it and rerun `eagle collect`") from exc


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    """The hex sha256 of a file, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


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
                "dtype": _ST_DTYPE[dtype],
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


def _storage_layout(k: int, hidden: int, dtype: torch.dtype, n_tok: int, n_seq: int):
    return [
        ("offsets", torch.int64, (n_seq + 1,)),
        ("seq_index", torch.int64, (n_seq,)),
        ("input_ids", torch.int32, (n_tok,)),
        ("aux_hidden", dtype, (n_tok, k * hidden)),
        ("last_hidden", dtype, (n_tok, hidden)),
        ("loss_mask", torch.uint8, (n_tok,)),
    ]


_KEYS = {"offsets", "seq_index", "input_ids", "aux_hidden", "last_hidden", "loss_mask"}


def bytes_per_token(num_aux: int, hidden_size: int, dtype: str) -> int:
    """Disk bytes per stored token: int32 id + uint8 mask + (k+1)*h hidden values."""
    return 4 + 1 + (num_aux + 1) * hidden_size * STORAGE_DTYPES[dtype].itemsize


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
    if seq_index != shard.rows or n_tok != shard.n_tok or keys != _KEYS:
        return None, "its sequences differ from the plan"
    sha = sha256_file(path)
    if known_sha is not None and sha != known_sha:
        return None, "its checksum does not match the manifest"
    return sha, ""


def _known_checksums(out: Path) -> dict[tuple[str, str], str]:
    """(split, file) -> sha256 from the manifest and any per-process progress files."""
    known: dict[tuple[str, str], str] = {}
    for path in [out / "manifest.json", *sorted(out.glob("manifest.r*.json"))]:
        data = _read_json(path) or {}
        for split, entry in (data.get("splits") or {}).items():
            for s in entry.get("shards", []):
                known[(split, s["file"])] = s["sha256"]
    return known


def _check_compatible(out: Path, header: dict, splits: dict[str, dict]) -> dict | None:
    """Refuse to mix features of another target, layer set, dtype, data or plan into ``out``."""
    old = _read_json(out / "manifest.json")
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


def _target_device(target) -> torch.device:
    dev = getattr(target, "device", None)
    if dev is not None:
        return torch.device(dev)
    return next(target.model.parameters()).device


class _OneProcess:
    """Stands in for accelerate's PartialState in a plain single-process run."""

    process_index, num_processes, is_main_process = 0, 1, True

    def wait_for_everyone(self) -> None:
        pass


_WORLD_ENV = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")


def _distributed_state(device: torch.device):
    """accelerate's PartialState under a multi-process launch (or when the caller already set one up); a
    single plain process leaves accelerate's process-wide state alone, so a later Accelerator is unaffected."""
    from accelerate import PartialState

    launched = any(int(os.environ.get(k, "1") or 1) > 1 for k in _WORLD_ENV)
    if not launched and PartialState._shared_state == {}:
        return _OneProcess()
    # gloo on CPU: without cpu=True accelerate treats a CPU torchrun launch as one process
    return PartialState(cpu=device.type == "cpu")


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
    from eagle.targets import capture_features

    device = _target_device(target)
    slow = float(os.environ.get(SLOW_ENV, "0") or 0)
    offsets = [0]
    for n in shard.lengths:
        offsets.append(offsets[-1] + n)
    layout = _storage_layout(len(aux_layers), target.hidden_size, dtype, offsets[-1], len(shard.rows))
    tmp = _tmp_name(final)
    writer = _ShardWriter(tmp, layout, meta)
    loss_tokens = captured_tokens = 0
    try:
        writer.write_rows("offsets", 0, torch.tensor(offsets, dtype=torch.int64))
        writer.write_rows("seq_index", 0, torch.tensor(shard.rows, dtype=torch.int64))
        for start, end in shard.batches(batch_tokens):
            rows = ds[shard.rows[start:end]]
            todo = []  # batch positions the target must run over
            for j, (tok, lm) in enumerate(zip(rows["input_ids"], rows["loss_mask"])):
                if len(lm) != len(tok):
                    raise EagleError(
                        f"row {shard.rows[start + j]} of split {shard.split!r} has {len(tok)} tokens but "
                        f"{len(lm)} loss-mask entries: rerun `eagle prepare`"
                    )
                if max(tok) >= target.vocab_size or min(tok) < 0:
                    bad_id = max(tok) if max(tok) >= target.vocab_size else min(tok)
                    raise EagleError(
                        f"split {shard.split!r} has token id {bad_id} but {target.name} has a vocabulary of "
                        f"{target.vocab_size}: the data was prepared for another tokenizer; rerun `eagle prepare`"
                    )
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
                if slow > 0:
                    time.sleep(slow)
                width = max(len(rows["input_ids"][j]) for j in todo)
                ids = torch.zeros(len(todo), width, dtype=torch.long)
                mask = torch.zeros(len(todo), width, dtype=torch.long)
                for i, j in enumerate(todo):
                    tok = rows["input_ids"][j]
                    ids[i, : len(tok)] = torch.tensor(tok, dtype=torch.long)
                    mask[i, : len(tok)] = 1
                try:
                    with torch.inference_mode():
                        aux, last = capture_features(target.model, ids.to(device), mask.to(device), aux_layers)
                except torch.OutOfMemoryError as exc:
                    raise EagleError(
                        f"out of memory on a batch of {len(todo)} x {width} tokens: lower collect.batch_tokens "
                        f"(now {batch_tokens}) and rerun; finished shards are kept"
                    ) from exc
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
    return {
        "file": final.name,
        "index": shard.index,
        "n_seq": len(shard.rows),
        "n_tok": offsets[-1],
        "loss_tokens": loss_tokens,
        "captured_tokens": captured_tokens,
        "sha256": sha,
    }


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


def collect(cfg: CollectConfig, data_dir: str | os.PathLike, target) -> dict:
    """Collect the target's hidden states over the prepared data into resumable shards; returns the manifest.

    ``target`` is an ``eagle.targets.Target`` (frozen model on its device). Under ``torchrun`` /
    ``accelerate launch`` every process takes shards ``i % world == rank`` and rank 0 writes the manifest.
    """
    from tqdm.auto import tqdm

    from eagle.targets import check_aux_layers, default_aux_layers

    cfg.validate()
    data_dir = Path(data_dir)
    out = Path(cfg.output_dir)
    dtype = STORAGE_DTYPES[cfg.dtype]
    if cfg.aux_layers is None:
        aux_layers = default_aux_layers(target.num_layers)
    else:
        aux_layers = check_aux_layers(list(cfg.aux_layers), target.num_layers)
    state = _distributed_state(_target_device(target))
    rank, world, main = state.process_index, state.num_processes, state.is_main_process

    header = {
        "format": FORMAT,
        "target": target.name,
        "target_fingerprint": target.fingerprint,
        "hidden_size": int(target.hidden_size),
        "num_layers": int(target.num_layers),
        "vocab_size": int(getattr(target, "vocab_size", 0) or 0),
        "aux_layers": aux_layers,
        "dtype": cfg.dtype,
    }
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
    old = _check_compatible(out, header, split_info)
    captured = _captured_lookup(data_dir, target, aux_layers, cfg.dtype)

    bpt = bytes_per_token(len(aux_layers), target.hidden_size, cfg.dtype)
    all_shards = [s for split in cfg.splits for s in plans[split]]
    _check_disk(cfg, out, all_shards, bpt, f"{len(aux_layers)}+1 x {target.hidden_size} x {cfg.dtype}", main)

    known = _known_checksums(out)  # before rank 0 rewrites manifest.json below
    for split in cfg.splits:
        (out / split).mkdir(parents=True, exist_ok=True)
    state.wait_for_everyone()
    if main:  # record what is being collected before any shard exists, so a rerun can check it
        remove_stale_temps(out / "manifest.json")
        kept = {k: v for k, v in ((old or {}).get("splits") or {}).items() if k not in cfg.splits}
        write_json_atomic(
            {
                **header,
                "complete": False,
                "splits": {**kept, **{k: {**v, "shards": []} for k, v in split_info.items()}},
            },
            out / "manifest.json",
        )
    state.wait_for_everyone()

    # this process's slice: global shard order across splits, dealt round robin
    mine = [s for g, s in enumerate(all_shards) if g % world == rank]
    progress_path = out / f"manifest.r{rank}.json"
    remove_stale_temps(progress_path)
    entries, todo = _scan_finished(out, mine, header, split_info, known)

    def save_progress() -> None:
        write_json_atomic(
            {"rank": rank, "world": world, "splits": {k: {"shards": v} for k, v in entries.items()}},
            progress_path,
        )

    save_progress()
    t0 = time.perf_counter()
    computed = copied = 0
    if todo:
        bar = tqdm(
            total=sum(s.n_tok for s in todo), unit="tok", unit_scale=True, desc="collect", disable=not main
        )
        try:
            for shard in todo:
                final = out / shard.split / shard_file_name(rank, shard.index)
                meta = _shard_meta(header, split_info[shard.split], shard)
                entry = _collect_shard(
                    shard,
                    datasets[shard.split],
                    target,
                    aux_layers,
                    dtype,
                    cfg.batch_tokens,
                    final,
                    meta,
                    bar,
                    captured.get(shard.split),
                )
                copied += entry.pop("captured_tokens")  # logged, not kept: a resumed run's manifest is the same
                entries[shard.split].append(entry)
                computed += entry["n_tok"]
                save_progress()
        finally:
            bar.close()
    elapsed = time.perf_counter() - t0
    rate = computed / max(elapsed, 1e-9)
    log.info(
        "rank %d: %d tokens in %.1fs (%.0f tokens/s), %d bytes/token", rank, computed, elapsed, rate, bpt
    )
    if main:
        done_before = len(mine) - len(todo)
        kept = f", {copied:,} of them copied from regeneration's captures" if captured else ""
        print(
            f"collect: {computed:,} tokens in {elapsed:.1f}s ({rate:,.0f} tokens/s on this process{kept}), "
            f"{bpt:,} bytes/token; {done_before} of this process's {len(mine)} shards were already done",
            flush=True,
        )

    state.wait_for_everyone()
    if main:
        manifest = _merge(out, header, split_info, plans, world, old, cfg.splits)
    state.wait_for_everyone()
    if not main:
        manifest = _read_json(out / "manifest.json")
    return manifest


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
        data = _read_json(out / f"manifest.r{r}.json") or {}
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


# ----------------------------------------------------------------------------------------------------------
# reading


def _check_manifest(manifest: dict, path: Path) -> None:
    """The fields a reader relies on, with their types (a hand-edited or foreign manifest fails here, clearly)."""

    def bad(what: str) -> EagleError:
        return EagleError(
            f"{path} is malformed ({what}): rerun `eagle collect` into a fresh collect.output_dir"
        )

    for key, kind in (("target", str), ("target_fingerprint", str), ("hidden_size", int), ("splits", dict)):
        if not isinstance(manifest.get(key), kind):
            raise bad(f"'{key}' must be a {kind.__name__}, got {manifest.get(key)!r:.60}")
    layers = manifest.get("aux_layers")
    if not isinstance(layers, list) or not layers or not all(isinstance(i, int) for i in layers):
        raise bad(f"'aux_layers' must be a list of layer ids, got {layers!r:.60}")
    if manifest.get("dtype") not in STORAGE_DTYPES:
        raise bad(f"'dtype' must be one of {list(STORAGE_DTYPES)}, got {manifest.get('dtype')!r:.60}")
    for split, entry in manifest["splits"].items():
        shards = entry.get("shards") if isinstance(entry, dict) else None
        if not isinstance(shards, list) or not all(
            isinstance(s, dict) and isinstance(s.get("file"), str) and isinstance(s.get("sha256"), str)
            for s in shards
        ):
            raise bad(f"split {split!r} needs a 'shards' list of {{file, sha256}} entries")


def _check_shard_layout(
    path: Path, layout: dict[str, tuple[str, list[int]]], offsets, num_aux: int, hidden: int, dtype: str
) -> None:
    """A shard must hold exactly the tensors of the documented layout, with the manifest's dtype and sizes."""

    def dim0(name: str) -> int:
        shape = layout.get(name, ("", []))[1]
        return shape[0] if len(shape) == 1 else -1

    n_seq, n_tok = dim0("seq_index"), dim0("input_ids")
    expected = {
        name: (_ST_DTYPE[tp], list(shape))
        for name, tp, shape in _storage_layout(num_aux, hidden, STORAGE_DTYPES[dtype], n_tok, n_seq)
    }
    wrong = [
        f"{name} {layout[name][0]} {layout[name][1]} (expected {want[0]} {want[1]})"
        if name in layout
        else f"{name} missing"
        for name, want in expected.items()
        if layout.get(name) != want
    ]
    wrong += [f"unexpected tensor {name}" for name in sorted(set(layout) - set(expected))]
    if not wrong and (int(offsets[0]) != 0 or int(offsets[-1]) != n_tok or bool((offsets.diff() < 0).any())):
        wrong.append("offsets do not cover the tokens in order")
    if wrong:
        raise EagleError(
            f"shard {path} does not have the feature layout ({'; '.join(wrong[:3])}): it was not written by "
            "`eagle collect` for this manifest; rerun `eagle collect` into a fresh collect.output_dir"
        )


class FeatureShards(torch.utils.data.Dataset):
    """The collected features of one split as a torch Dataset of per-sequence dicts.

    ``ds[i]`` -> ``input_ids`` long [T], ``loss_mask`` long [T], ``aux_hidden`` [T, k*h], ``last_hidden`` [T, h]
    (storage dtype), read with safetensors slicing (memory mapped: only the rows asked for are touched).
    Each shard's sha256 is checked against the manifest the first time it is used (``verify()`` checks all).
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        split: str = "train",
        expected_fingerprint: str | None = None,
        verify_checksums: bool = True,
    ):
        self.directory = Path(directory)
        self.split = split
        self.verify_checksums = verify_checksums
        manifest = _read_json(self.directory / "manifest.json")
        if manifest is None:
            raise EagleError(
                f"no features in {self.directory} (manifest.json missing): run `eagle collect` first"
            )
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise EagleError(f"{self.directory} does not hold eagle features: point at a collect.output_dir")
        if not manifest.get("complete"):
            raise EagleError(
                f"feature collection in {self.directory} is unfinished: rerun `eagle collect` to finish it"
            )
        _check_manifest(manifest, self.directory / "manifest.json")
        if expected_fingerprint is not None and manifest["target_fingerprint"] != expected_fingerprint:
            raise EagleError(
                f"features in {self.directory} were collected for target {manifest['target']} (fingerprint "
                f"{manifest['target_fingerprint'][:12]}), not the configured one (fingerprint "
                f"{expected_fingerprint[:12]}): rerun `eagle collect` for this target into another collect.output_dir"
            )
        if split not in manifest["splits"]:
            raise EagleError(
                f"split {split!r} was not collected in {self.directory} (have {sorted(manifest['splits'])}): "
                f"add it to collect.splits and rerun `eagle collect`"
            )
        self.manifest = manifest
        self.aux_layers: list[int] = manifest["aux_layers"]
        self.hidden_size: int = manifest["hidden_size"]
        self.dtype: torch.dtype = STORAGE_DTYPES[manifest["dtype"]]
        self.target_fingerprint: str = manifest["target_fingerprint"]
        self._shards = manifest["splits"][split]["shards"]
        self._paths = [self.directory / split / s["file"] for s in self._shards]
        shard_of, starts, lengths, seq_index = [], [], [], []
        for k, path in enumerate(self._paths):
            if not path.is_file():
                raise EagleError(f"shard {path} is missing: rerun `eagle collect` to rebuild it")
            try:
                with safe_open(str(path), framework="pt") as fh:
                    layout = {
                        k: (fh.get_slice(k).get_dtype(), fh.get_slice(k).get_shape()) for k in fh.keys()
                    }
                    offsets = fh.get_tensor("offsets") if "offsets" in layout else None
                    rows = fh.get_tensor("seq_index") if "seq_index" in layout else None
            except Exception as exc:
                raise EagleError(
                    f"shard {path} is corrupt ({exc}): rerun `eagle collect` to rebuild it"
                ) from exc
            _check_shard_layout(
                path, layout, offsets, len(self.aux_layers), self.hidden_size, manifest["dtype"]
            )
            shard_of.append(torch.full((len(rows),), k, dtype=torch.int32))
            starts.append(offsets[:-1])
            lengths.append(offsets[1:] - offsets[:-1])
            seq_index.append(rows)
        self._shard_of = torch.cat(shard_of) if shard_of else torch.zeros(0, dtype=torch.int32)
        self._starts = torch.cat(starts) if starts else torch.zeros(0, dtype=torch.int64)
        self._lengths = torch.cat(lengths) if lengths else torch.zeros(0, dtype=torch.int64)
        self._seq_index = torch.cat(seq_index) if seq_index else torch.zeros(0, dtype=torch.int64)
        self._verified: set[int] = set()
        self._handles: dict[int, Any] = {}

    def __len__(self) -> int:
        return len(self._lengths)

    def lengths(self) -> list[int]:
        """Token count of every sequence (for length bucketing)."""
        return self._lengths.tolist()

    def seq_indices(self) -> list[int]:
        """Row of every sequence in the prepared dataset."""
        return self._seq_index.tolist()

    def verify(self) -> None:
        """Check every shard's sha256 now (EagleError on the first mismatch)."""
        for k in range(len(self._paths)):
            self._verify(k)

    def _verify(self, k: int) -> None:
        if k in self._verified:
            return
        if sha256_file(self._paths[k]) != self._shards[k]["sha256"]:
            raise EagleError(
                f"shard {self._paths[k]} is corrupt (checksum mismatch): rerun `eagle collect` to rebuild it"
            )
        self._verified.add(k)

    def _handle(self, k: int):
        if k not in self._handles:
            self._handles[k] = safe_open(str(self._paths[k]), framework="pt")
        return self._handles[k]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"index {i} out of range for {n} sequences")
        i %= n
        k = int(self._shard_of[i])
        if self.verify_checksums:
            self._verify(k)
        a = int(self._starts[i])
        b = a + int(self._lengths[i])
        fh = self._handle(k)
        return {
            "input_ids": fh.get_slice("input_ids")[a:b].long(),
            "loss_mask": fh.get_slice("loss_mask")[a:b].long(),
            "aux_hidden": fh.get_slice("aux_hidden")[a:b],
            "last_hidden": fh.get_slice("last_hidden")[a:b],
        }

    def __getstate__(self) -> dict:
        # open file handles do not pickle (DataLoader workers reopen them)
        return {**self.__dict__, "_handles": {}}
