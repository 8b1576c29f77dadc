"""Validation during training: the head's loss and top-1 accuracy on the validation split, per TTT step, and the
simulated chain acceptance length ``sim_tau``, token-weighted over all processes.
"""

from __future__ import annotations

from typing import Any

import torch

from eagle.lazy_logits import TargetLogits
from train.batching import prepare_batch

# columns of the per-step sums: loss, accuracy, label count, eagle1's two loss terms, simulated chains that
# accept at least j + 1 drafts (over step 0's positions); each a metric times its count
_LOSS, _ACC, _COUNT, _REG, _CE, _CHAIN = range(6)


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
    """Validation loss and top-1 accuracy (per TTT step for eagle3) and the simulated chain acceptance length,
    token-weighted over all processes. ``cfg``: the ``train:`` section (``ttt_steps``, ``step_decay``,
    ``num_workers``).

    ``sim_tau`` is the tau a chain of ``ttt_steps`` drafts would get at temperature 0: at each validation
    position (step 0 has a label), one plus the number of leading TTT steps whose top-1 is the target's next
    token (:func:`train.losses.leading_hits`: the chain ends at the first miss, or at the first step whose label
    lies outside the loss mask or the sequence, so positions near an answer's end can accept only what is left
    of it), averaged over the positions. ``sim_accept_j``: the share of positions whose chain accepts at least
    j + 1 drafts (``sim_tau = 1 + sum_j sim_accept_j``), as ``eagle eval``'s ``per_depth_acceptance`` counts
    verification steps. An eagle1 head is trained one step ahead, so its chain is one draft long: ``sim_tau =
    1 + val_acc``.

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
    sums = torch.zeros(steps, 6, dtype=torch.float64, device=accelerator.device)
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
            sums += _weighted(m, kind, steps, weight, sums.device)
    model.train(was_training)
    return _summary(accelerator.reduce(sums, reduction="sum").cpu(), kind, cfg.step_decay)


def _weighted(m: dict[str, torch.Tensor], kind: str, steps: int, weight: float, device) -> torch.Tensor:
    """One batch's metrics as the per-step sums [steps, 6] (each metric times its label count and ``weight``)."""
    rows = []
    for j in range(steps):
        if kind == "eagle3":
            count = m[f"count_{j}"].double() * weight
            # chain_j is a share of step 0's positions: weighted by step 0's count
            chain = m[f"chain_{j}"].double() * m["count_0"].double() * weight
            parts = [m[f"loss_{j}"], m[f"acc_{j}"], 1.0, 0.0, 0.0]
        else:
            count = m["count"].double() * weight
            chain = m["acc"].double() * count
            parts = [m["loss"], m["acc"], 1.0, m["loss_reg"], m["loss_ce"]]
        row = [torch.as_tensor(p, device=device).double() * count.to(device) for p in parts]
        rows.append(torch.stack(row + [chain.to(device)]))
    return torch.stack(rows)


def _summary(sums: torch.Tensor, kind: str, step_decay: float) -> dict[str, float]:
    """The validation metrics from the per-step sums over every process."""
    out: dict[str, float] = {}
    steps = sums.shape[0]
    if kind == "eagle3":
        total = 0.0
        for j in range(steps):
            count = max(float(sums[j, _COUNT]), 1.0)
            out[f"val_loss_{j}"] = float(sums[j, _LOSS]) / count
            out[f"val_acc_{j}"] = float(sums[j, _ACC]) / count
            total += step_decay**j * out[f"val_loss_{j}"]
        out["val_loss"], out["val_acc"] = total, out["val_acc_0"]
    else:
        count = max(float(sums[0, _COUNT]), 1.0)
        out["val_loss"] = float(sums[0, _LOSS]) / count
        out["val_acc"] = float(sums[0, _ACC]) / count
        out["val_loss_reg"], out["val_loss_ce"] = float(sums[0, _REG]) / count, float(sums[0, _CE]) / count
    positions = max(float(sums[0, _COUNT]), 1.0)
    for j in range(steps):
        out[f"sim_accept_{j}"] = float(sums[j, _CHAIN]) / positions
    out["sim_tau"] = 1.0 + sum(out[f"sim_accept_{j}"] for j in range(steps))
    out["val_tokens"] = int(sums[0, _COUNT])
    return out
