"""The feature-shard format: what ``eagle collect`` writes (:mod:`train.collect`) and training reads.

Layout of ``collect.output_dir``::

    manifest.json            target, fingerprint, aux layers, storage dtype, per split the shard list with sha256
    manifest.r{rank}.json    one process's progress while collecting (merged into manifest.json at the end)
    <split>/shard-r{rank:02d}-{index:05d}.safetensors

A shard is packed (no padding): ``input_ids`` int32 [N], ``loss_mask`` uint8 [N], ``offsets`` int64 [n+1],
``seq_index`` int64 [n] (rows of the prepared dataset), ``aux_hidden`` [N, k*h] and ``last_hidden`` [N, h] in the
storage dtype. :class:`FeatureShards` reads one split as a torch Dataset, checking each shard against the manifest.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from eagle.errors import EagleError

FORMAT = "eagle-features-v1"
STORAGE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
SAFETENSORS_DTYPES = {
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
}


def read_json(path: Path) -> dict | None:
    """A JSON file's content, None when absent; an unreadable one is an EagleError naming it."""
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise EagleError(f"{path} is unreadable ({exc}): delete it and rerun `eagle collect`") from exc


TENSOR_NAMES = {"offsets", "seq_index", "input_ids", "aux_hidden", "last_hidden", "loss_mask"}


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    """The hex sha256 of a file, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def storage_layout(k: int, hidden: int, dtype: torch.dtype, n_tok: int, n_seq: int):
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
        name: (SAFETENSORS_DTYPES[tp], list(shape))
        for name, tp, shape in storage_layout(num_aux, hidden, STORAGE_DTYPES[dtype], n_tok, n_seq)
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
        manifest = read_json(self.directory / "manifest.json")
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
