"""Draft vocabulary for EAGLE-3 heads: the most frequent loss-masked training tokens.

A draft vocabulary of size n is a sorted list of target ids ``ids[0] < ids[1] < ...``. It is stored the way
EAGLE-3 / SGLang / vLLM expect: ``d2t[i] = ids[i] - i`` (so target id = ``i + d2t[i]``) and ``t2d`` a bool mask
over the target vocabulary that is True exactly at ``ids``.
"""

from __future__ import annotations

import os
import warnings
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from eagle.errors import EagleError
from eagle.fileio import write_json_atomic

VOCAB_FILE = "draft_vocab.safetensors"  # beside a checkpoint's head, and in the training output folder


def count_tokens(
    sequences: Iterable[tuple[torch.Tensor | list[int], torch.Tensor | list[int]]],
    vocab_size: int | None = None,
) -> torch.Tensor:
    """Count the tokens whose loss mask is set. ``sequences`` yields ``(input_ids, loss_mask)`` pairs (lists or
    tensors of any shape). Returns LongTensor [vocab_size] (or [max id + 1] when vocab_size is None)."""
    counts = torch.zeros(vocab_size or 0, dtype=torch.long)
    for input_ids, loss_mask in sequences:
        ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(-1)
        mask = torch.as_tensor(loss_mask).reshape(-1).bool()
        if ids.shape != mask.shape:
            raise EagleError(
                f"input_ids ({ids.numel()}) and loss_mask ({mask.numel()}) differ in length: rerun `eagle prepare`"
            )
        ids = ids[mask]
        if ids.numel() == 0:
            continue
        top = int(ids.max())
        if vocab_size is not None and (top >= vocab_size or int(ids.min()) < 0):
            raise EagleError(f"token id {top} is outside the vocabulary of {vocab_size}: check the tokenizer")
        size = max(counts.numel(), top + 1)
        if size > counts.numel():
            counts = torch.cat([counts, counts.new_zeros(size - counts.numel())])
        counts += torch.bincount(ids, minlength=size)
    return counts


def build_draft_vocab(
    token_counts: Counter | dict[int, int] | torch.Tensor, draft_vocab_size: int, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``draft_vocab_size`` most frequent tokens (ties, and unseen tokens used as padding when the corpus
    has fewer distinct tokens, go to the lowest ids). Returns ``(d2t int64 [draft_vocab], t2d bool [vocab])``."""
    if not 0 < draft_vocab_size <= vocab_size:
        raise EagleError(
            f"draft vocabulary size {draft_vocab_size} must be between 1 and the target's vocabulary "
            f"({vocab_size}): set head.draft_vocab_size accordingly"
        )
    counts = torch.zeros(vocab_size, dtype=torch.long)
    if isinstance(token_counts, torch.Tensor):
        given = token_counts.reshape(-1).long()
        if given.numel() > vocab_size and bool(given[vocab_size:].any()):
            raise EagleError(f"token counts include ids >= vocab_size ({vocab_size}): check the tokenizer")
        counts[: min(given.numel(), vocab_size)] = given[:vocab_size]
    else:
        for token, n in token_counts.items():
            if not 0 <= int(token) < vocab_size:
                raise EagleError(
                    f"token id {token} is outside the vocabulary of {vocab_size}: check the tokenizer"
                )
            counts[int(token)] += int(n)
    # stable descending sort keeps equal counts in increasing id order: deterministic tie-break and padding
    order = torch.sort(counts, descending=True, stable=True).indices
    ids = torch.sort(order[:draft_vocab_size]).values
    d2t = ids - torch.arange(draft_vocab_size, dtype=torch.long)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return d2t, t2d


def check_vocab(d2t: torch.Tensor, t2d: torch.Tensor) -> None:
    """Raise EagleError unless d2t/t2d describe the same strictly increasing id list."""
    ids = torch.arange(d2t.numel(), dtype=torch.long) + d2t.long().cpu()
    ok = (
        d2t.dim() == 1
        and t2d.dim() == 1
        and t2d.dtype == torch.bool
        and int(t2d.sum()) == d2t.numel()
        and bool((ids >= 0).all() and (ids < t2d.numel()).all())
        and bool(t2d.cpu()[ids.clamp(0, t2d.numel() - 1)].all())
        and bool((ids[1:] > ids[:-1]).all())
    )
    if not ok:
        raise EagleError(
            "d2t and t2d do not describe the same draft vocabulary: rebuild it with build_draft_vocab"
        )


def save_vocab(path: str | Path, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
    """Write ``d2t`` and ``t2d`` to a safetensors file."""
    from safetensors.torch import save_file

    check_vocab(d2t, t2d)
    save_file({"d2t": d2t.long().contiguous().cpu(), "t2d": t2d.bool().contiguous().cpu()}, str(path))


def load_vocab(path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Read ``(d2t, t2d)`` written by :func:`save_vocab`."""
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise EagleError(f"draft vocabulary file {path} not found: build it first (or fix the path)")
    try:
        tensors = load_file(str(path))
    except Exception as exc:  # truncated or not safetensors at all
        raise EagleError(
            f"draft vocabulary file {path} is unreadable ({exc}): resume from another checkpoint, or start "
            "fresh (train.resume=never) to rebuild it"
        ) from exc
    if set(tensors) != {"d2t", "t2d"}:
        raise EagleError(f"{path} is not a draft vocabulary file (expected tensors d2t and t2d)")
    check_vocab(tensors["d2t"], tensors["t2d"])
    return tensors["d2t"], tensors["t2d"]


def _count_training_tokens(train_src, vocab_size: int) -> torch.Tensor:
    from train.vocab import count_tokens

    return count_tokens(train_src.token_pairs(), vocab_size)


def draft_vocab_for_run(
    hcfg: Any, train_src: Any, out: Path, resumed: tuple[Path, str | None] | None, main: bool,
    init_state: dict | None,
) -> tuple[tuple[torch.Tensor, torch.Tensor], str | None]:
    """The eagle3 draft vocabulary: on resume (``resumed`` = the checkpoint folder and the data fingerprint it
    recorded) the checkpoint's, never rebuilt; taken from ``init_from`` when that head has one; else built from
    the training data's loss-masked token counts and saved (by the ``main`` process) as
    ``<output_dir>/draft_vocab.safetensors``. Returns (d2t, t2d) and the data's fingerprint."""
    from train.batching import counts_fingerprint

    vocab_file = out / VOCAB_FILE
    if resumed is not None:
        d2t, t2d = load_vocab(resumed[0] / VOCAB_FILE)
        saved_fp = resumed[1]
        if main and saved_fp is not None:
            now = counts_fingerprint(_count_training_tokens(train_src, hcfg.vocab_size))
            if now != saved_fp:
                warnings.warn(
                    "the training data changed since the draft vocabulary was built; keeping the checkpoint's "
                    "vocabulary (start a fresh run with train.resume=never to rebuild it)",
                    stacklevel=3,
                )
        return (d2t, t2d), saved_fp
    if init_state is not None and "d2t" in init_state and "t2d" in init_state:
        d2t, t2d = init_state["d2t"].long(), init_state["t2d"].bool()
        check_vocab(d2t, t2d)
        return (d2t, t2d), None
    # every process counts (cheap next to training, and no process waits on another's failure); main saves
    counts = _count_training_tokens(train_src, hcfg.vocab_size)
    if int(counts.sum()) == 0:
        raise EagleError(
            "the training data has no loss-masked tokens, so there is nothing to learn: check the loss masks "
            "of the prepared data (assistant turns) and rerun `eagle prepare`"
        )
    d2t, t2d = build_draft_vocab(counts, hcfg.draft_vocab_size, hcfg.vocab_size)
    fingerprint = counts_fingerprint(counts)
    if main:
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / f".{VOCAB_FILE}.tmp"
        save_vocab(tmp, d2t, t2d)
        os.replace(tmp, vocab_file)
        info = {
            "data_fingerprint": fingerprint,
            "loss_tokens": int(counts.sum()),
            "draft_vocab_size": hcfg.draft_vocab_size,
            "coverage": float(counts[t2d].sum() / counts.sum()),
        }
        write_json_atomic(info, out / "draft_vocab.json")
    return (d2t, t2d), fingerprint
