"""Training losses for draft heads (pure functions of a head, a batch and the target's lm_head).

A batch is a dict (docs/ARCHITECTURE.md): ``input_ids`` [B,T] long, ``attention_mask`` [B,T] (optional, 1 =
real token), ``loss_mask`` [B,T], ``aux_hidden`` [B,T,k*h], ``last_hidden`` [B,T,h].

Alignment: at position i the head reads the target feature of x_i and the embedding of x_{i+1} and predicts
the feature at i+1, i.e. the token x_{i+2}; the label is the target's distribution ``lm_head(last_hidden[i+1])``
and counts where ``loss_mask[i+2]`` is set (and every token involved is real, not padding). Every loss is a
mean over those counted positions; metrics come back detached (0-dim tensors), so logging them costs no sync
until the caller asks for a value. Counts are per call: under data parallelism each rank normalises by its
own counts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from eagle.heads import HeadCache


def _shift(x: torch.Tensor, k: int, fill: float | bool | int = 0) -> torch.Tensor:
    """``out[:, i] = x[:, i + k]`` along dim 1, filled with ``fill`` past the end."""
    if k == 0:
        return x
    pad = x.new_full((x.shape[0], min(k, x.shape[1]), *x.shape[2:]), fill)
    return torch.cat([x[:, k:], pad], dim=1)


def _no_autocast(device: torch.device) -> torch.autocast:
    """The target's logits are labels and metrics: computed in the lm_head's own dtype even when the head trains
    under mixed precision (``train.bf16``), where autocast would round them through bf16."""
    return torch.autocast(device_type=device.type, enabled=False)


def _target_logits(target_lm_head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The target's logits (fp32, no grad) from its last feature."""
    weight = getattr(target_lm_head, "weight", None)
    with torch.no_grad(), _no_autocast(hidden.device):
        if weight is not None:
            hidden = hidden.to(device=weight.device, dtype=weight.dtype)
        return target_lm_head(hidden).float()


# fp32 logits per chunk (positions x vocabulary) when the full-vocabulary argmax is needed
_ARGMAX_CHUNK_ELEMENTS = 1 << 25


def _target_logits_at(target_lm_head: nn.Module, hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The target's logits at vocabulary ids ``ids`` only (fp32, no grad): ``hidden @ W[ids].T (+ b[ids])``.

    Equals ``_target_logits(...)[..., ids]`` up to rounding at a fraction of the cost (len(ids) of the
    vocabulary's rows). Falls back to the full logits for an lm_head without a plain ``weight`` matrix."""
    weight = getattr(target_lm_head, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return _target_logits(target_lm_head, hidden)[..., ids.to(hidden.device)]
    bias = getattr(target_lm_head, "bias", None)
    with torch.no_grad(), _no_autocast(weight.device):
        rows = ids.to(weight.device)
        # the gather is a small copy (draft_vocab x h) next to the matmul, so it is redone every call rather
        # than cached: the head's d2t may change (set_draft_vocab, DDP buffer broadcasts)
        w = weight.index_select(0, rows)
        b = None if bias is None else bias.index_select(0, rows)
        hidden = hidden.to(device=weight.device, dtype=weight.dtype)
        post = getattr(target_lm_head, "post", None)  # the target's own scale / soft-cap (TargetLogits)
        logits = F.linear(hidden, w, b).float()
        return post(logits) if post is not None else logits


def target_argmax(target_lm_head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The target's argmax over its full vocabulary, computed a chunk of positions at a time so the fp32 logits
    of the whole batch never exist at once."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    vocab = getattr(getattr(target_lm_head, "weight", None), "shape", (1,))[0]
    chunk = max(1, _ARGMAX_CHUNK_ELEMENTS // max(int(vocab), 1))
    tops = [_target_logits(target_lm_head, part).argmax(-1) for part in flat.split(chunk)]
    if not tops:
        return torch.zeros(hidden.shape[:-1], dtype=torch.long, device=hidden.device)
    return torch.cat(tops).reshape(hidden.shape[:-1]).to(hidden.device)


def add_feature_noise(features: torch.Tensor, noise_std: float) -> torch.Tensor:
    """EAGLE's feature augmentation: uniform noise in [-noise_std/2, noise_std/2)."""
    if noise_std <= 0:
        return features
    return features + (torch.rand_like(features) - 0.5) * noise_std


def _masks(batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    ids = batch["input_ids"]
    am = batch.get("attention_mask")
    am = torch.ones_like(ids, dtype=torch.bool) if am is None else am.to(ids.device).bool()
    return am, batch["loss_mask"].to(ids.device).bool()


def ttt_attention_mask(
    length: int, step: int, key_valid: torch.Tensor | None = None, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention mask and position ids of TTT step ``step`` (docs/ARCHITECTURE.md).

    Keys are laid out as ``[step-0 keys (T), step-1 keys (T), ..., step-``step`` keys (T)]``, as a HeadCache
    holds them after running steps 0..step one after the other. A query at position i may attend to step-0 keys
    at positions <= i (and, when ``key_valid`` [B,T] is given, only valid ones) plus the step-1..step keys at
    position i only: its own chain, as a chain draft rooted at i sees at inference. The query's own step-0 key
    is always allowed so no row is empty (an empty row would make attention NaN on padding).

    Returns ``(mask bool [B|1, 1, T, (step+1)*T], position_ids long [1, T])`` with position ids i + step.
    """
    i = torch.arange(length, device=device)
    diag = i[None, :] == i[:, None]
    step0 = (i[None, :] <= i[:, None])[None]
    if key_valid is not None:
        step0 = (step0 & key_valid.to(device=step0.device, dtype=torch.bool)[:, None, :]) | diag
    mask = torch.cat([step0] + [diag[None].expand(step0.shape[0], -1, -1)] * step, dim=-1)
    return mask[:, None], (i + step)[None]


def ttt_forward(
    head: nn.Module,
    input_ids: torch.Tensor,
    hidden: torch.Tensor,
    steps: int,
    attention_mask: torch.Tensor | None = None,
    chains: torch.Tensor | None = None,
    step0_rows: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """Unrolled test-time-training forward. Step j at position i reads token x_{i+j+1}, the step-(j-1) output
    at i (step 0: ``hidden``, already projected), position id i+j, and attends per :func:`ttt_attention_mask`.
    Returns the out_hidden [B,T,h] of every step; positions whose inputs run past the end are garbage that only
    their own chain sees.

    ``chains`` [B,K] (long, from :func:`chain_positions`) limits steps 1.. to those root positions: step 0 still
    runs over all T positions (every query attends to its keys), the later steps return [B,K,h] rows that equal
    the full computation's rows at ``chains``. Training only needs the chains that reach a loss-masked label,
    so prompt positions cost one step instead of ``steps``.

    ``step0_rows`` [B,K0] (sorted per row, from :func:`chain_positions`, holding every root in ``chains``) limits
    step 0's queries and output to those positions: every position still gives its step-0 key and value, but the
    attention output and MLP run only where a loss or a chain reads the result; step 0 then returns [B,K0,h]."""
    b, t = input_ids.shape
    am = None if attention_mask is None else attention_mask.to(input_ids.device).bool()
    # a step-0 key at p is usable when both of its inputs (x_p's feature, x_{p+1}) are real tokens
    key_valid = None if am is None or bool(am.all()) else am & _shift(am, 1, False)
    if step0_rows is not None and chains is None and steps > 1:
        raise ValueError("step0_rows needs chains: the later steps read step 0's output only at those rows")
    cache = HeadCache()
    outs = []
    for j in range(steps):
        if step0_rows is not None and j == 0:
            mask, _ = _chain_attention_mask(step0_rows, t, 0, key_valid)
            pos = torch.arange(t, device=input_ids.device)[None].expand(b, -1)
            hidden = head(_shift(input_ids, 1, 0), hidden, pos, mask, cache, rows=step0_rows)
            outs.append(hidden)
            continue
        if chains is not None and j > 0:
            mask, pos = _chain_attention_mask(chains, t, j, key_valid)
            if j == 1:
                index = chains if step0_rows is None else _row_index(step0_rows, chains)
                hidden = hidden.gather(1, index[..., None].expand(-1, -1, hidden.shape[-1]))
            ids = _shift(input_ids, j + 1, 0).gather(1, chains)
            hidden = head(ids, hidden, pos, mask, cache)
            outs.append(hidden)
            continue
        mask, pos = ttt_attention_mask(t, j, key_valid, device=input_ids.device)
        if j == 0 and key_valid is None:
            mask = None  # plain causal: lets SDPA pick its fastest kernel
        hidden = head(_shift(input_ids, j + 1, 0), hidden, pos.expand(b, -1), mask, cache)
        outs.append(hidden)
    return outs


def chain_positions(needed: torch.Tensor) -> torch.Tensor:
    """Root positions [B,K] of the chains a loss needs (``needed`` [B,T] bool), each row's in order and padded
    with its last position (T-1) to the longest row's count K (at least 1); padded chains are computed and
    ignored."""
    b, t = needed.shape
    k = max(int(needed.sum(1).max()) if b else 0, 1)
    # stable sort puts each row's needed positions first, in order; the rest are replaced by T-1
    order = torch.sort((~needed).to(torch.int8), dim=1, stable=True).indices[:, :k]
    keep = torch.arange(k, device=needed.device)[None] < needed.sum(1, keepdim=True)
    return torch.where(keep, order, torch.full_like(order, t - 1))


def _row_index(rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Where each of ``positions`` [B,K] sits in ``rows`` [B,K0] (both sorted per row, every real position
    present in ``rows``); padding lands on some row, which is fine since padded chains are ignored."""
    return torch.searchsorted(rows.contiguous(), positions.contiguous()).clamp(max=rows.shape[1] - 1)


def _chain_attention_mask(
    chains: torch.Tensor, length: int, step: int, key_valid: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`ttt_attention_mask` for the chains rooted at ``chains`` [B,K] only: keys are the T step-0 keys and
    then K keys per later step. Returns ``(mask bool [B,1,K,T+step*K], position_ids [B,K])``."""
    keys = torch.arange(length, device=chains.device)
    step0 = keys[None, None, :] <= chains[..., None]
    if key_valid is not None:
        own = keys[None, None, :] == chains[..., None]
        step0 = (step0 & key_valid.to(device=chains.device, dtype=torch.bool)[:, None, :]) | own
    k = chains.shape[1]
    diag = torch.eye(k, dtype=torch.bool, device=chains.device)[None].expand(chains.shape[0], -1, -1)
    mask = torch.cat([step0] + [diag] * step, dim=-1)
    return mask[:, None], chains + step


def eagle3_ttt_loss(
    head: nn.Module,
    batch: dict,
    target_lm_head: nn.Module,
    ttt_steps: int = 3,
    step_decay: float = 0.8,
    noise_std: float = 0.0,
    exact_top1: bool = True,
    top1_weight: float = 0.0,
    accepted: list[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """EAGLE-3 training-time-test loss: ``sum_j step_decay**j * CE_j`` over ``ttt_steps`` unrolled steps.

    CE_j at position i is the cross-entropy of the head's draft-vocab distribution against the target's
    distribution at i+j+1 *restricted to the draft vocabulary and renormalised* (a softmax over the target's
    logits gathered at the draft ids). We keep every position, also where the target's top token is outside the
    draft vocabulary: there the head still learns the best draft-vocab approximation. Counted where
    ``loss_mask[i+j+2]`` is set and tokens i..i+j+2 are real; each step is a mean over its own count.
    ``top1_weight`` w mixes in a hard label: ``(1 - w) * CE_j + w * (-log p_head(top))``, where top is the
    target's most likely draft token. Greedy verification of a chain accepts only that token, so a larger w
    spends the head's capacity on the top-1 path rather than on the rest of the distribution.

    Only the target's logits at the draft ids are computed for the CE (``last_hidden @ W[draft_ids].T``), not
    the full ``lm_head`` over the whole vocabulary, and only at the positions a label is read from; the head's
    logits only where a label counts; step 0's attention output and MLP only at the roots a label or a later
    step reads, and steps 1.. only along the chains that reach a label (:func:`chain_positions`): prompt tokens
    are context, giving keys and values once.

    Metrics: ``loss``, per step ``loss_j``, ``acc_j`` and ``count_j``. ``acc_j``: the head's argmax mapped to
    target ids equals the target's top token. With ``exact_top1`` (evaluation) that is the target's argmax over
    its full vocabulary, computed in chunks, or taken from ``batch["target_top"]`` [B,T] where the caller has
    it (:func:`target_argmax` of the same ``last_hidden``); without it (the training step) it is the argmax of the
    draft-restricted target logits, so the full lm_head is never run. The two agree wherever the target's top
    token is in the draft vocabulary (barring exact ties); elsewhere the exact metric is a miss (the head can
    only predict draft tokens) while the restricted one may count a hit, so the restricted one is an upper bound.

    With ``exact_top1`` also the simulated chain (:func:`leading_hits`): ``chain_j``, the share of step 0's
    counted positions whose chain accepts at least j + 1 drafts (the simulated chain tau is ``1 + sum_j
    chain_j``); a list passed as ``accepted`` receives the accepted drafts per root position ([B,T] long, no
    scalar metric).
    """
    ids = batch["input_ids"]
    am, lm = _masks(batch)
    t = ids.shape[1]
    aux = batch["aux_hidden"].to(ids.device)
    if head.training:
        aux = add_feature_noise(aux.float(), noise_std)
    hidden = head.project(aux)
    counted = _counted(am, lm, ttt_steps)
    labels = _Labels(head, batch, counted, target_lm_head, exact_top1, top1_weight)
    chains, needed = None, counted[0]
    if ttt_steps > 1:  # steps 1.. only along the chains that reach a label
        later = torch.stack(counted[1:]).any(0)
        chains, needed = chain_positions(later), needed | later
    # step 0 queries only the positions a label or a chain reads (prompt tokens only give keys and values)
    rows0 = chain_positions(needed) if ttt_steps > 0 else None
    if rows0 is not None and rows0.shape[1] == t:
        rows0 = None  # every position is needed: plain step 0
    outs = ttt_forward(head, ids, hidden, ttt_steps, None if bool(am.all()) else am, chains, rows0)
    total = hidden.new_zeros((), dtype=torch.float32)
    metrics: dict[str, torch.Tensor] = {}
    every = torch.arange(t, device=ids.device)[None].expand(ids.shape[0], -1)
    hits = []  # per step, [B,T] bool: the head's top-1 at that root is the target's (evaluation only)
    for j, out in enumerate(outs):
        # roots of this step's rows: step 0's queried positions, then the chains
        roots = (every if rows0 is None else rows0) if j == 0 else chains
        mask = counted[j].gather(1, roots)
        loss_j, acc_j, count, hit = labels.step_loss(head, out, roots, mask, j)
        total = total + step_decay**j * loss_j
        metrics[f"loss_{j}"] = loss_j.detach()
        metrics[f"acc_{j}"] = acc_j.detach().float()
        metrics[f"count_{j}"] = count.detach()
        if exact_top1:
            hits.append(_at_roots(hit, roots, mask, counted[j]))
    if not outs:  # ttt_steps == 0: keep the graph connected so backward() still works
        total = total + 0.0 * hidden.sum()
    if hits:
        metrics.update(_chain_metrics(hits, counted, accepted))
    metrics["loss"] = total.detach()
    return total, metrics


def _at_roots(hit: torch.Tensor, roots: torch.Tensor, mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A step's per-row hits (the rows of ``roots[mask]``) laid out per root position: [B,T] bool."""
    rows = torch.arange(roots.shape[0], device=roots.device)[:, None].expand_as(roots)[mask]
    full = torch.zeros_like(like)
    full[rows, roots[mask]] = hit  # padded chains are never counted, so no position is written twice
    return full


def _chain_metrics(hits: list[torch.Tensor], counted: list[torch.Tensor], accepted: list[torch.Tensor] | None
                   ) -> dict[str, torch.Tensor]:
    """``chain_j``: the share of step 0's counted positions whose simulated chain accepts at least j + 1 drafts;
    the per-position counts go to ``accepted`` when it is a list."""
    chain = leading_hits(hits, counted)
    denom = counted[0].sum().clamp(min=1)
    if accepted is not None:
        accepted.append(chain)
    return {f"chain_{j}": ((chain > j).sum() / denom).float() for j in range(len(hits))}


def leading_hits(hits: list[torch.Tensor], counted: list[torch.Tensor]) -> torch.Tensor:
    """The drafts a chain rooted at each position would accept at temperature 0: [B,T] long, the number of
    leading TTT steps j = 0, 1, ... whose top-1 is the target's (``hits[j]`` [B,T] bool) and that have a label
    (``counted[j]``, see :func:`_counted`).

    The chain ends at the first miss, and also at the first step without a label: a label outside the loss
    mask, on padding or past the sequence's end is a token the data cannot check, so a chain is credited only
    with what it could be seen to accept (near the end of an answer it is cut short, as the speculative loop's
    last step is by its token budget). Positions whose step 0 has no label get 0 and are no validation
    positions."""
    alive = torch.ones_like(counted[0])
    accepted = torch.zeros(counted[0].shape, dtype=torch.long, device=counted[0].device)
    for hit, has_label in zip(hits, counted):
        alive = alive & has_label & hit
        accepted += alive
    return accepted


def _counted(am: torch.Tensor, lm: torch.Tensor, ttt_steps: int) -> list[torch.Tensor]:
    """``counted[j][b, i]``: step j's prediction at root i has a label (x_{i+j+2} loss-masked, inputs real)."""
    counted, valid = [], am & _shift(am, 1, False) & _shift(am, 2, False)
    for j in range(ttt_steps):
        counted.append(valid & _shift(lm, j + 2, False))
        valid = valid & _shift(am, j + 3, False)
    return counted


class _Labels:
    """The target's label distributions (over the draft vocabulary) and top tokens, computed only at the positions
    some TTT step reads a label from (the label of root i at step j is the target's distribution at i+j+1)."""

    def __init__(self, head: nn.Module, batch: dict, counted: list[torch.Tensor], target_lm_head: nn.Module,
                 exact_top1: bool, top1_weight: float = 0.0):
        ids = batch["input_ids"]
        t = ids.shape[1]
        labelled = torch.zeros_like(counted[0]) if counted else torch.zeros_like(ids, dtype=torch.bool)
        for j, c in enumerate(counted):
            labelled[:, j + 1 :] |= c[:, : t - j - 1]
        self.t = t
        self.slot = (labelled.flatten().cumsum(0) - 1).view_as(labelled)  # (b, position) -> its row
        draft_ids = torch.arange(head.d2t.numel(), device=ids.device) + head.d2t.to(ids.device)
        label_hidden = batch["last_hidden"][labelled.to(batch["last_hidden"].device)]
        draft_logits = _target_logits_at(target_lm_head, label_hidden, draft_ids).to(ids.device)
        self.top1_weight = top1_weight
        self.top_draft = draft_logits.argmax(-1)  # the target's most likely draft token, as a draft index
        if exact_top1 and "target_top" in batch:  # given by a caller that keeps them (validation)
            self.top = batch["target_top"].to(ids.device)[labelled]
        elif exact_top1:
            self.top = target_argmax(target_lm_head, label_hidden).to(ids.device)
        else:
            self.top = draft_ids[self.top_draft]
        self.logp = torch.log_softmax(draft_logits, dim=-1)  # [N, draft_vocab]

    def step_loss(self, head: nn.Module, out: torch.Tensor, roots: torch.Tensor, mask: torch.Tensor, j: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(cross-entropy against the labels, top-1 accuracy, label count, per-row hits) of TTT step ``j``'s
        outputs ``out`` at ``roots`` where ``mask`` holds (the hits are the rows of ``roots[mask]``)."""
        count = mask.sum()
        if not bool(mask.any()):
            # nothing to learn here, but every parameter stays in the graph (DDP expects gradients for all)
            none = torch.zeros(0, dtype=torch.bool, device=out.device)
            return 0.0 * head.logits(out[:, :1]).float().sum(), out.new_zeros((), dtype=torch.float32), count, none
        logits = head.logits(out[mask]).float()  # logits only where a label counts: [N, draft_vocab]
        label = (roots + j + 1).clamp(max=self.t - 1)[mask]
        rows = torch.arange(roots.shape[0], device=roots.device)[:, None].expand_as(roots)[mask]
        at = self.slot[rows, label]
        logq = torch.log_softmax(logits, dim=-1)
        ce = -(self.logp[at].exp() * logq).sum(-1)
        if self.top1_weight:
            hard = -logq.gather(-1, self.top_draft[at][:, None]).squeeze(-1)
            ce = (1 - self.top1_weight) * ce + self.top1_weight * hard
        hit = head.draft_to_target(logits.argmax(-1)) == self.top[at]
        return ce.sum() / count, hit.sum() / count, count, hit


def eagle1_loss(
    head: nn.Module,
    batch: dict,
    target_lm_head: nn.Module,
    w_reg: float = 1.0,
    w_ce: float = 0.1,
    noise_std: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """EAGLE-1 loss: ``w_reg * SmoothL1(out_i, last_hidden[i+1]) + w_ce * CE(head logits_i, target dist at i+1)``.

    SmoothL1 is averaged over the hidden dimension (as in EAGLE), then both terms are means over the counted
    positions (``loss_mask[i+2]`` set, tokens i..i+2 real). Noise, when training, perturbs the input features only.
    Metrics: ``loss``, ``loss_reg``, ``loss_ce``, ``acc`` (head argmax == target argmax), ``count``.
    """
    ids = batch["input_ids"]
    am, lm = _masks(batch)
    t = ids.shape[1]
    last = batch["last_hidden"].to(ids.device)
    features = add_feature_noise(last.float(), noise_std) if head.training else last
    key_valid = am & _shift(am, 1, False)
    mask = None
    if not bool(am.all()):
        mask, _ = ttt_attention_mask(t, 0, key_valid, device=ids.device)
    pos = torch.arange(t, device=ids.device)[None].expand(ids.shape[0], -1)
    out = head(_shift(ids, 1, 0), head.project(features), pos, mask)

    n = max(t - 2, 0)  # positions i with a label x_{i+2}
    counted = (am & _shift(am, 1, False) & _shift(am, 2, False) & _shift(lm, 2, False))[:, :n]
    count = counted.sum()
    denom = count.clamp(min=1)
    out = out[:, :n]
    target_hidden = last[:, 1 : n + 1].to(out.dtype)
    reg = F.smooth_l1_loss(out.float(), target_hidden.float(), reduction="none").mean(-1)
    target_logits = _target_logits(target_lm_head, target_hidden).to(ids.device)
    logits = head.logits(out).float()
    ce = -(torch.softmax(target_logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    loss_reg = torch.where(counted, reg, 0.0).sum() / denom
    loss_ce = torch.where(counted, ce, 0.0).sum() / denom
    loss = w_reg * loss_reg + w_ce * loss_ce
    if n == 0:  # nothing to learn from: keep the graph connected
        loss = loss + 0.0 * out.sum()
    acc = ((logits.argmax(-1) == target_logits.argmax(-1)) & counted).sum() / denom
    metrics = {
        "loss": loss.detach(),
        "loss_reg": loss_reg.detach(),
        "loss_ce": loss_ce.detach(),
        "acc": acc.detach().float(),
        "count": count.detach(),
    }
    return loss, metrics
