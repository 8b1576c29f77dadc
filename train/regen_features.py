"""Hidden states kept from regeneration, so that ``eagle collect`` need not run the target over the data again.

When ``data.capture_features`` is on, :func:`train.prepare.generate_batch` asks the target for its hidden states
while it writes the answers (the prompt's from the prefill, each answer token's from the decoding step that
reads it) and :func:`write_batch` stores them per regeneration batch under
``<data.output_dir>/regen-<key>-features-<spec>/batch-<turn>-<index>.safetensors`` (written atomically, before
the answers are appended to the regeneration log, so an answer on record has its features unless the run was
killed in between). ``eagle collect`` then copies them into its shards (:class:`CapturedFeatures`) and runs the
target only over rows without a usable capture.

A capture is used for a prepared row only when it was made by the same target (fingerprint and dtype), for the
same aux layers and storage dtype, and its token ids are exactly the row's first tokens (a chat template or a
decode/re-encode round trip that changes the answer's tokens sends the row back to the target). It must cover
every position the losses read: the features of tokens ``0 .. L-1`` where ``L`` is the row's last loss-masked
position (the label at ``L`` is predicted from the feature at ``L-2`` and scored against the target's
distribution from the feature at ``L-1``; ``train/losses.py``). The row's positions from ``L`` on (its closing
end-of-turn token and what the template adds after it) are never read, and are stored as zeros when the capture
stops short of them. The features differ from a collection pass only by floating-point rounding (batched,
left-padded decoding with a KV cache instead of one right-padded forward).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from eagle.fileio import fsync_dir

log = logging.getLogger(__name__)

CAPTURE_FORMAT = "eagle-regen-features-v1"


@dataclass(frozen=True)
class CaptureSpec:
    """What captured features are: which target (fingerprint, dtype) and which states, stored how."""

    target_fingerprint: str
    model_dtype: str  # the dtype the target ran in, e.g. "float32"
    aux_layers: tuple[int, ...]
    dtype: str  # storage dtype, as collect.dtype

    @classmethod
    def of(
        cls, fingerprint: str, model_dtype: torch.dtype | None, aux_layers: Sequence[int], dtype: str
    ) -> CaptureSpec:
        """The spec both sides build (regeneration writing, collection reading), so that they compare equal."""
        return cls(fingerprint, str(model_dtype).removeprefix("torch."), tuple(aux_layers), dtype)

    def key(self) -> str:
        """A short hash naming the capture folder: another spec never reads these files."""
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:8]


def capture_dir(data_dir: str | os.PathLike, regen_key: str, spec: CaptureSpec) -> Path:
    """The folder a regeneration with ``regen_key`` keeps its features in for ``spec``."""
    return Path(data_dir) / f"regen-{regen_key}-features-{spec.key()}"


class FeatureCapture:
    """Collects one regeneration batch's features row by row while :func:`train.prepare.generate_batch` runs.

    ``prefill`` takes the prompt forward (left padded), ``step`` each decoding forward; both keep only the
    real tokens, in the storage dtype on the CPU. ``rows()`` gives per prompt the token ids read so far and
    their ``(aux [n, k*h], last [n, h])`` features.
    """

    def __init__(self, model: torch.nn.Module, aux_layers: list[int], dtype: torch.dtype):
        self.model = model
        self.aux_layers = list(aux_layers)
        self.dtype = dtype
        self._ids: list[list[torch.Tensor]] = []
        self._aux: list[list[torch.Tensor]] = []
        self._last: list[list[torch.Tensor]] = []

    def _select(self, hidden_states: Any) -> tuple[torch.Tensor, torch.Tensor]:
        from eagle.features import select_features

        aux, last = select_features(self.model, hidden_states, self.aux_layers, torch.device("cpu"))
        return aux.to(self.dtype), last.to(self.dtype)

    def prefill(self, input_ids: torch.Tensor, attention: torch.Tensor, hidden_states: Any) -> None:
        """The prompts' forward: ``input_ids`` / ``attention`` [B, W], one row per prompt."""
        aux, last = self._select(hidden_states)
        keep = attention.bool().cpu()
        ids = input_ids.cpu()
        for r in range(ids.shape[0]):
            self._ids.append([ids[r][keep[r]]])
            self._aux.append([aux[r][keep[r]]])
            self._last.append([last[r][keep[r]]])

    def step(self, rows: list[int], tokens: torch.Tensor, hidden_states: Any) -> None:
        """A decoding forward over one token per live row; ``rows[j]`` is the prompt batch row ``j`` answers."""
        aux, last = self._select(hidden_states)
        tokens = tokens.reshape(-1).cpu()
        for j, r in enumerate(rows):
            self._ids[r].append(tokens[j : j + 1])
            self._aux[r].append(aux[j, -1:])
            self._last[r].append(last[j, -1:])

    def rows(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per prompt: ``(ids [n] long, aux [n, k*h], last [n, h])``."""
        return [
            (torch.cat(i).long(), torch.cat(a), torch.cat(h))
            for i, a, h in zip(self._ids, self._aux, self._last)
        ]


def write_batch(
    folder: Path,
    name: str,
    keys: list[tuple[str, int]],
    rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    spec: CaptureSpec,
) -> Path:
    """Store one batch's captures as ``<folder>/<name>.safetensors`` (packed rows, atomically); returns it.

    ``keys[j]`` is row ``j``'s (conversation id, turn)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    lengths = [len(r[0]) for r in rows]
    offsets = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)
    tensors = {
        "offsets": offsets,
        "input_ids": torch.cat([r[0] for r in rows]).to(torch.int32),
        "aux_hidden": torch.cat([r[1] for r in rows]).contiguous(),
        "last_hidden": torch.cat([r[2] for r in rows]).contiguous(),
    }
    meta = {"format": CAPTURE_FORMAT, "spec": json.dumps(asdict(spec)), "keys": json.dumps(keys)}
    final = folder / f"{name}.safetensors"
    tmp = folder / f".{name}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        save_file(tensors, str(tmp), metadata=meta)
        os.replace(tmp, final)
        fsync_dir(folder)
    finally:
        tmp.unlink(missing_ok=True)
    return final


def last_loss_position(loss_mask: list[int] | torch.Tensor) -> int:
    """Index of the row's last loss-masked token (-1 when there is none)."""
    mask = torch.as_tensor(loss_mask)
    hits = mask.nonzero()
    return int(hits[-1]) if len(hits) else -1


class CapturedFeatures:
    """Read side: the captures in a folder, indexed by conversation id (the latest turn of each wins, since
    its prompt holds the earlier turns)."""

    def __init__(self, folder: Path, spec: CaptureSpec):
        from safetensors import safe_open

        self.folder = folder
        self.spec = spec
        # conversation id -> (turn, file, first token, end): the latest turn's row
        self._where: dict[str, tuple[int, Path, int, int]] = {}
        wanted = json.loads(json.dumps(asdict(spec)))  # as a file's metadata reads back (tuples as lists)
        for path in sorted(folder.glob("batch-*.safetensors")):
            try:
                with safe_open(str(path), framework="pt") as fh:
                    meta = fh.metadata() or {}
                    if meta.get("format") != CAPTURE_FORMAT or json.loads(meta.get("spec", "{}")) != wanted:
                        continue
                    keys = json.loads(meta.get("keys", "[]"))
                    offsets = fh.get_tensor("offsets").tolist()
            except Exception as exc:  # a torn or foreign file: ignore it, its rows go to the target
                log.warning("captured features: skipping unreadable %s (%s)", path, exc)
                continue
            for row, (conv_id, turn) in enumerate(keys):
                if conv_id not in self._where or self._where[conv_id][0] < turn:
                    self._where[conv_id] = (int(turn), path, offsets[row], offsets[row + 1])
        self._handles: dict[Path, Any] = {}

    def __len__(self) -> int:
        return len(self._where)

    @classmethod
    def find(cls, data_dir: str | os.PathLike, spec: CaptureSpec) -> CapturedFeatures | None:
        """The captures ``eagle prepare`` recorded in ``prepare_meta.json`` for ``spec``, or None."""
        try:
            meta = json.loads((Path(data_dir) / "prepare_meta.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        name = (meta.get("captured_features") or {}).get("dir") if isinstance(meta, dict) else None
        if not name:
            return None
        folder = Path(data_dir) / name
        if not folder.is_dir():
            return None
        found = cls(folder, spec)
        return found if len(found) else None

    def _handle(self, path: Path):
        from safetensors import safe_open

        if path not in self._handles:
            self._handles[path] = safe_open(str(path), framework="pt")
        return self._handles[path]

    def for_row(
        self, conv_id: str, input_ids: list[int] | torch.Tensor, loss_mask: list[int] | torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(aux [T, k*h], last [T, h])`` for a prepared row, or None when no capture fits it (see the module
        docstring: same leading tokens, covering every position the losses read; zeros after the capture)."""
        where = self._where.get(conv_id)
        if where is None:
            return None
        _, path, a, b = where
        fh = self._handle(path)
        ids = torch.as_tensor(input_ids, dtype=torch.long)
        n = min(b - a, len(ids))
        if n < last_loss_position(loss_mask) or n == 0:
            return None
        if not torch.equal(fh.get_slice("input_ids")[a : a + n].long(), ids[:n]):
            return None
        aux = fh.get_slice("aux_hidden")[a : a + n]
        last = fh.get_slice("last_hidden")[a : a + n]
        if n < len(ids):  # never read by the losses (module docstring)
            aux = torch.cat([aux, aux.new_zeros(len(ids) - n, aux.shape[1])])
            last = torch.cat([last, last.new_zeros(len(ids) - n, last.shape[1])])
        return aux, last

