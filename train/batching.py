"""Training data for the trainer: sequence sources, length-bucketed batch plans and collation.

Offline mode reads :class:`train.shards.FeatureShards` (token ids, loss mask and the target's features per
sequence); online mode reads the prepared dataset (token ids and loss mask only) and the trainer computes the
features inside the step. Both expose ``__len__``, ``__getitem__`` (a dict of tensors), ``lengths()`` and
``token_pairs()`` (``(input_ids, loss_mask)`` chunks for counting the draft vocabulary).

Batches are planned *globally*: one plan per epoch (a function of the lengths, the seed and the epoch only) lists
the global micro-batches, and each process takes its own contiguous slice of every global batch. So N processes
with ``batch_size`` b see exactly the data of one process with ``batch_size`` N*b, and a resumed run can skip to
any batch of any epoch without replaying the data.
"""

from __future__ import annotations

import hashlib
import os
import random
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from eagle.errors import EagleError

CHUNK_BATCHES = 64  # length bucketing sorts within random chunks of this many global batches


def check_token_columns(ds, path: str | os.PathLike) -> None:
    """Prepared data holds lists of integers in ``input_ids`` and ``loss_mask`` (float ids would be truncated
    silently, so they are refused)."""
    import pyarrow as pa

    for name in ("input_ids", "loss_mask"):
        kind = ds.data.schema.field(name).type
        lists = pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)
        item = kind.value_type if lists else None
        if item is None or not (
            pa.types.is_integer(item) or (name == "loss_mask" and pa.types.is_boolean(item))
        ):
            raise EagleError(
                f"{path}: column {name!r} holds {kind}, not lists of integers: rerun `eagle prepare` (token ids "
                "and 0/1 loss masks are integer lists)"
            )


class PreparedSequences(torch.utils.data.Dataset):
    """One split of prepared data (``datasets.save_to_disk`` with columns input_ids, loss_mask)."""

    def __init__(self, data_dir: str | os.PathLike, split: str = "train", max_length: int | None = None):
        from datasets import load_from_disk

        self.path = Path(data_dir) / split
        if not self.path.is_dir():
            raise EagleError(
                f"prepared split {split!r} not found at {self.path}: run `eagle prepare` first "
                "(or point data.output_dir at the prepared data)"
            )
        try:
            self.ds = load_from_disk(str(self.path))
        except Exception as exc:
            raise EagleError(f"{self.path} is not a prepared dataset ({exc}): rerun `eagle prepare`") from exc
        missing = {"input_ids", "loss_mask"} - set(self.ds.column_names)
        if missing:
            raise EagleError(f"{self.path} lacks column(s) {sorted(missing)}: rerun `eagle prepare`")
        check_token_columns(self.ds, self.path)
        self.ds = self.ds.select_columns(["input_ids", "loss_mask"])
        self.max_length = max_length

    def __len__(self) -> int:
        return len(self.ds)

    def lengths(self) -> list[int]:
        """Token count of every sequence (after ``max_length`` truncation)."""
        import pyarrow.compute as pc

        column = self.ds.data.column("input_ids")
        lengths = [int(n) for n in pc.list_value_length(column).fill_null(0).to_pylist()]
        if self.max_length is not None:
            lengths = [min(n, self.max_length) for n in lengths]
        return lengths

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        row = self.ds[int(i)]
        ids = torch.tensor(row["input_ids"], dtype=torch.long)
        mask = torch.tensor(row["loss_mask"], dtype=torch.long)
        if ids.shape != mask.shape:
            raise EagleError(
                f"row {i} of {self.path}: input_ids and loss_mask differ in length; rerun `eagle prepare`"
            )
        return _truncate({"input_ids": ids, "loss_mask": mask}, self.max_length)

    def token_pairs(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """``(input_ids, loss_mask)`` of all sequences, flattened per arrow chunk (no Python lists of ids)."""
        import numpy as np
        import pyarrow.compute as pc

        table = self.ds.data
        for ids_chunk, mask_chunk in zip(table.column("input_ids").chunks, table.column("loss_mask").chunks):
            ids = pc.list_flatten(ids_chunk).to_numpy(zero_copy_only=False).astype(np.int64)
            mask = pc.list_flatten(mask_chunk).to_numpy(zero_copy_only=False).astype(np.int64)
            yield torch.from_numpy(ids), torch.from_numpy(mask)


class ShardSequences(torch.utils.data.Dataset):
    """Collected features of one split (a thin view over :class:`train.shards.FeatureShards`)."""

    def __init__(
        self,
        features_dir: str | os.PathLike,
        split: str = "train",
        expected_fingerprint: str | None = None,
        max_length: int | None = None,
    ):
        from train.shards import FeatureShards

        self.shards = FeatureShards(features_dir, split, expected_fingerprint=expected_fingerprint)
        self.split = split
        self.max_length = max_length
        self.aux_layers: list[int] = list(self.shards.aux_layers)

    def __len__(self) -> int:
        return len(self.shards)

    def lengths(self) -> list[int]:
        lengths = self.shards.lengths()
        if self.max_length is not None:
            lengths = [min(n, self.max_length) for n in lengths]
        return lengths

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return _truncate(self.shards[int(i)], self.max_length)

    def token_pairs(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """``(input_ids, loss_mask)`` of each shard file, read without touching the hidden states."""
        from safetensors import safe_open

        shards = self.shards.manifest["splits"][self.split]["shards"]
        for entry in shards:
            with safe_open(str(self.shards.directory / self.split / entry["file"]), framework="pt") as fh:
                yield fh.get_tensor("input_ids").long(), fh.get_tensor("loss_mask").long()


def _truncate(item: dict[str, torch.Tensor], max_length: int | None) -> dict[str, torch.Tensor]:
    if max_length is None or item["input_ids"].shape[0] <= max_length:
        return item
    return {k: v[:max_length] for k, v in item.items()}


def counts_fingerprint(counts: torch.Tensor) -> str:
    """A short hash of token counts: tells whether the training data changed since a vocabulary was built."""
    return hashlib.sha256(counts.long().contiguous().numpy().tobytes()).hexdigest()[:16]


# ------------------------------------------------------------------------------------------------- plans


def _global_groups(
    order: list[int], lengths: Sequence[int], world: int, batch_size: int | None, batch_tokens: int | None
) -> list[list[int]]:
    """Cut ``order`` (already bucketed) into global batches; each has a multiple of ``world`` sequences.

    batch_size: exactly ``batch_size * world`` sequences (a short tail is dropped). batch_tokens: as many
    sequences as keep ``count/world * longest <= batch_tokens`` (at least ``world``; a short tail is dropped).
    """
    groups: list[list[int]] = []
    if batch_tokens is None:
        size = batch_size * world
        for start in range(0, len(order) - size + 1, size):
            groups.append(order[start : start + size])
        return groups
    start = 0
    while start + world <= len(order):
        end = start + world
        longest = max(lengths[i] for i in order[start:end])
        while end + world <= len(order):
            nxt = max(longest, max(lengths[i] for i in order[end : end + world]))
            if (end + world - start) // world * nxt > batch_tokens:
                break
            longest, end = nxt, end + world
        groups.append(order[start:end])
        start = end
    return groups


def plan_epoch(
    lengths: Sequence[int],
    *,
    world: int,
    seed: int,
    epoch: int,
    batch_size: int | None = None,
    batch_tokens: int | None = None,
) -> list[list[int]]:
    """The global micro-batches of one epoch (lists of sequence indices, sorted by length within a batch).

    Length bucketing: the sequences are shuffled (seeded by ``seed`` and ``epoch``), cut into chunks of
    ``CHUNK_BATCHES`` batches, each chunk sorted by length and cut into batches (so batches are dense), and the
    batches are shuffled again. Empty sequences are skipped. Deterministic in (lengths, world, sizes, seed, epoch).
    """
    if (batch_size is None) == (batch_tokens is None):
        raise ValueError("give exactly one of batch_size and batch_tokens")
    rng = random.Random(f"{seed}:{epoch}")
    order = [i for i, n in enumerate(lengths) if n > 0]
    rng.shuffle(order)
    if batch_tokens is None:
        chunk = batch_size * world * CHUNK_BATCHES
    else:
        mean = max(1, sum(lengths[i] for i in order) // max(1, len(order)))
        chunk = max(world, batch_tokens * world // mean) * CHUNK_BATCHES
    batches: list[list[int]] = []
    for start in range(0, len(order), chunk):
        part = sorted(order[start : start + chunk], key=lambda i: (lengths[i], i))
        batches.extend(_global_groups(part, lengths, world, batch_size, batch_tokens))
    rng.shuffle(batches)
    return batches


def plan_eval(
    lengths: Sequence[int], *, world: int, batch_size: int | None = None, batch_tokens: int | None = None
) -> list[list[int]]:
    """Global evaluation batches: every non-empty sequence once, sorted by length, no shuffling. The last batch
    may hold fewer than ``world`` sequences (see :func:`rank_slice`)."""
    order = sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: (lengths[i], i))
    groups = _global_groups(order, lengths, world, batch_size, batch_tokens)
    used = sum(len(g) for g in groups)
    if used < len(order):
        groups.append(order[used:])
    return groups


def rank_slice(global_batch: list[int], rank: int, world: int) -> list[int]:
    """This process's contiguous share of a global batch (may be empty for a short evaluation tail)."""
    per, extra = divmod(len(global_batch), world)
    start = rank * per + min(rank, extra)
    return global_batch[start : start + per + (1 if rank < extra else 0)]


# ---------------------------------------------------------------------------------------------- collation


def collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right-pad a list of per-sequence dicts into a batch: ``input_ids`` (pad 0), ``attention_mask``,
    ``loss_mask`` (0 on padding) and, when present, ``aux_hidden`` / ``last_hidden`` (zero padded)."""
    if not items:
        raise ValueError("cannot collate an empty batch")
    longest = max(int(it["input_ids"].shape[0]) for it in items)
    batch: dict[str, torch.Tensor] = {
        "input_ids": torch.zeros(len(items), longest, dtype=torch.long),
        "attention_mask": torch.zeros(len(items), longest, dtype=torch.long),
        "loss_mask": torch.zeros(len(items), longest, dtype=torch.long),
    }
    for key in ("aux_hidden", "last_hidden"):
        if key in items[0]:
            ref = items[0][key]
            batch[key] = torch.zeros(len(items), longest, ref.shape[-1], dtype=ref.dtype)
    for row, it in enumerate(items):
        n = int(it["input_ids"].shape[0])
        batch["input_ids"][row, :n] = it["input_ids"]
        batch["attention_mask"][row, :n] = 1
        batch["loss_mask"][row, :n] = it["loss_mask"]
        for key in ("aux_hidden", "last_hidden"):
            if key in batch:
                batch[key][row, :n] = it[key]
    return batch


class _Batches(torch.utils.data.Dataset):
    """Index i -> the collated batch of ``plan[i]`` (so DataLoader workers collate in parallel)."""

    def __init__(self, source: torch.utils.data.Dataset, plan: list[list[int]]):
        self.source, self.plan = source, plan

    def __len__(self) -> int:
        return len(self.plan)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return collate([self.source[j] for j in self.plan[i]])


def batch_loader(
    source: torch.utils.data.Dataset, plan: list[list[int]], num_workers: int = 0, pin_memory: bool = False
) -> torch.utils.data.DataLoader:
    """A DataLoader yielding the collated batches of ``plan`` in order. It owns its generator, so creating it
    never draws from the global torch RNG (which would shift a resumed run's random stream)."""
    return torch.utils.data.DataLoader(
        _Batches(source, plan),
        batch_size=None,
        shuffle=False,
        num_workers=num_workers,
        pin_memory=pin_memory,
        generator=torch.Generator().manual_seed(0),
        persistent_workers=False,
    )


def _to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def _add_features(batch: dict[str, torch.Tensor], target, aux_layers: list[int]) -> None:
    """Online mode: run the frozen target on the batch and add its features."""
    from eagle.features import capture_features

    with torch.no_grad():
        ids = batch["input_ids"].to(target.device)
        aux, last = capture_features(target.model, ids, batch["attention_mask"].to(target.device), aux_layers)
    device = batch["input_ids"].device
    batch["aux_hidden"], batch["last_hidden"] = aux.to(device), last.to(device)


def prepare_batch(batch, accelerator, online: bool, target, aux_layers) -> dict[str, torch.Tensor]:
    batch = _to_device(batch, accelerator.device)
    if online:
        _add_features(batch, target, aux_layers)
    return batch


def open_sources(mode: str, data_dir: Any, features_dir: Any, fingerprint: str, max_length: int | None
                 ) -> tuple[Any, Any]:
    """(train source, val source or None) for ``train.mode``: feature shards offline, prepared data online."""
    if mode == "offline":
        if not features_dir:
            raise EagleError(
                "train.mode=offline needs collected features: set collect.output_dir (or train online)"
            )
        train_src = ShardSequences(features_dir, "train", fingerprint, max_length)
        has_val = "val" in train_src.shards.manifest.get("splits", {})
        val_src = ShardSequences(features_dir, "val", fingerprint, max_length) if has_val else None
        return train_src, val_src
    if not data_dir:
        raise EagleError("train.mode=online needs prepared data: set data.output_dir (run `eagle prepare`)")
    train_src = PreparedSequences(data_dir, "train", max_length)
    val_src = None
    if (Path(data_dir) / "val").is_dir():
        try:
            val_src = PreparedSequences(data_dir, "val", max_length)
        except EagleError as exc:
            # e.g. an empty split (datasets cannot reload one): train without evaluation
            warnings.warn(f"no usable validation split, training without evaluation: {exc}", stacklevel=3)
    return train_src, val_src
