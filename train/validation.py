"""Validation during training: the head's loss and top-1 accuracy on the validation split, per TTT step,
token-weighted over all processes.
"""

from __future__ import annotations

from typing import Any

import torch

from eagle.lazy_logits import TargetLogits
from train.batching import prepare_batch


def validate(
    model,
    source,
    plan: list[list[int]],
    accelerator,
    cfg: Any,
    kind: str,
    online: bool,
    target,
    aux_layers,
    top1_cache: dict[int, torch.Tensor] | None = None,
) -> dict[str, float]:
    """Validation loss and top-1 accuracy (per TTT step for eagle3), token-weighted over all processes. ``cfg``:
    the ``train:`` section (``ttt_steps``, ``step_decay``, ``num_workers``).

    Every process runs the same number of forwards (a process without data in the last global batch runs a
    dummy with weight 0), which DDP's buffer broadcast and ZeRO-3's parameter gathering need.

    ``top1_cache`` (eagle3): the target's full-vocabulary argmax of every validation batch, by batch index, kept
    by the caller from one evaluation to the next. The labels never change while the head trains, and that argmax
    (a 49k-row fp32 lm_head over every position, for SmolLM2) was ~3/4 of an evaluation's time; the plan
    yields the same batches in the same order every time, so an index names a batch."""
    from train.batching import batch_loader, rank_slice
    from train.losses import target_argmax

    rank, world = accelerator.process_index, accelerator.num_processes
    mine, weights = [], []
    for gb in plan:
        part = rank_slice(gb, rank, world)
        mine.append(part or gb[:1])
        weights.append(1.0 if part else 0.0)
    steps = cfg.ttt_steps if kind == "eagle3" else 1
    # per step j: [loss*count, acc*count, count]; eagle1 adds reg*count, ce*count
    sums = torch.zeros(steps, 5, dtype=torch.float64, device=accelerator.device)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for i, (batch, weight) in enumerate(zip(batch_loader(source, mine, cfg.num_workers), weights)):
            batch = prepare_batch(batch, accelerator, online, target, aux_layers)
            if top1_cache is not None and kind == "eagle3":
                if i not in top1_cache:
                    top1_cache[i] = target_argmax(TargetLogits(target.model), batch["last_hidden"])
                batch["target_top"] = top1_cache[i]
            _, m = model(batch)
            for j in range(steps):
                if kind == "eagle3":
                    count = m[f"count_{j}"].double() * weight
                    parts = [m[f"loss_{j}"], m[f"acc_{j}"], 1.0, 0.0, 0.0]
                else:
                    count = m["count"].double() * weight
                    parts = [m["loss"], m["acc"], 1.0, m["loss_reg"], m["loss_ce"]]
                sums[j] += torch.stack(
                    [torch.as_tensor(p, device=count.device).double() * count for p in parts]
                )
    model.train(was_training)
    sums = accelerator.reduce(sums, reduction="sum").cpu()
    out: dict[str, float] = {}
    if kind == "eagle3":
        total = 0.0
        for j in range(steps):
            count = max(float(sums[j, 2]), 1.0)
            out[f"val_loss_{j}"] = float(sums[j, 0]) / count
            out[f"val_acc_{j}"] = float(sums[j, 1]) / count
            total += cfg.step_decay**j * out[f"val_loss_{j}"]
        out["val_loss"], out["val_acc"] = total, out["val_acc_0"]
    else:
        count = max(float(sums[0, 2]), 1.0)
        out["val_loss"] = float(sums[0, 0]) / count
        out["val_acc"] = float(sums[0, 1]) / count
        out["val_loss_reg"], out["val_loss_ce"] = float(sums[0, 3]) / count, float(sums[0, 4]) / count
    out["val_tokens"] = int(sums[0, 2])
    return out
