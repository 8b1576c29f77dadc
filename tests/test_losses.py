"""Training losses, the TTT mask and the draft vocabulary, checked against naive hand computations."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from eagle.errors import EagleError
from eagle.heads import HeadCache, HeadConfig, build_head
from eagle.testing import tiny_model
from train.losses import chain_positions, eagle1_loss, eagle3_ttt_loss, ttt_attention_mask, ttt_forward
from train.vocab import build_draft_vocab, check_vocab, count_tokens, load_vocab, save_vocab

AUX = [1, 2, 3]
VOCAB, HID = 256, 64


def setup(kind: str, draft_vocab_size: int = 40, seed: int = 0):
    target = tiny_model("llama", seed=seed)
    cfg = HeadConfig.from_target(target.config, kind=kind, draft_vocab_size=draft_vocab_size, aux_layers=AUX)
    torch.manual_seed(seed + 1)
    head = build_head(cfg).attach_target(target).eval()
    if kind == "eagle3":
        counts = torch.randint(0, 50, (VOCAB,), generator=torch.Generator().manual_seed(seed))
        head.set_draft_vocab(*build_draft_vocab(counts, draft_vocab_size, VOCAB))
    return head, target


def make_batch(target, lengths: list[int], t: int, left_pad: bool = False, seed: int = 0) -> dict:
    """Padded batch of random sequences with the target's real features; loss mask set on ~70% of tokens."""
    g = torch.Generator().manual_seed(seed)
    b = len(lengths)
    ids = torch.zeros(b, t, dtype=torch.long)
    am = torch.zeros(b, t, dtype=torch.long)
    lm = torch.zeros(b, t, dtype=torch.long)
    for r, n in enumerate(lengths):
        sl = slice(t - n, t) if left_pad else slice(0, n)
        ids[r, sl] = torch.randint(3, VOCAB, (n,), generator=g)
        am[r, sl] = 1
        lm[r, sl] = (torch.rand(n, generator=g) < 0.7).long()
    with torch.no_grad():
        out = target(input_ids=ids, attention_mask=am, output_hidden_states=True)
    hs = out.hidden_states
    return {
        "input_ids": ids,
        "attention_mask": am,
        "loss_mask": lm,
        "aux_hidden": torch.cat([hs[i] for i in AUX], dim=-1),
        "last_hidden": hs[-1],
    }


def real_slice(batch: dict, r: int) -> slice:
    idx = batch["attention_mask"][r].nonzero().flatten()
    return slice(int(idx[0]), int(idx[-1]) + 1)


def naive_chain_logits(head, ids: torch.Tensor, hidden0: torch.Tensor, steps: int) -> dict:
    """{(i, j): logits} from running, for every root position i of ONE unpadded sequence, step 0 causally over
    positions 0..i and then steps 1.. as a chain that appends one key per step to a HeadCache."""
    t = ids.shape[0]
    out = {}
    with torch.no_grad():
        for i in range(t - 1):
            cache = HeadCache()
            prefix = head(
                ids[None, 1 : i + 2], hidden0[None, : i + 1], torch.arange(i + 1)[None], cache=cache
            )
            h = prefix[:, -1:]
            out[(i, 0)] = head.logits(h)[0, 0].float()
            for j in range(1, steps):
                if i + j + 1 >= t:
                    break
                h = head(ids[None, i + j + 1 : i + j + 2], h, torch.tensor([[i + j]]), cache=cache)
                assert cache.length == i + 1 + j
                out[(i, j)] = head.logits(h)[0, 0].float()
    return out


def test_ttt_attention_mask_small_case():
    mask, pos = ttt_attention_mask(3, 2)
    expected = torch.tensor(
        [
            [1, 0, 0, 1, 0, 0, 1, 0, 0],
            [1, 1, 0, 0, 1, 0, 0, 1, 0],
            [1, 1, 1, 0, 0, 1, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert mask.shape == (1, 1, 3, 9) and torch.equal(mask[0, 0], expected)
    assert pos.tolist() == [[2, 3, 4]]
    # invalid step-0 keys are hidden from everyone but their own query
    mask, pos = ttt_attention_mask(3, 1, key_valid=torch.tensor([[False, True, True]]))
    assert torch.equal(mask[0, 0, :, :3], torch.tensor([[1, 0, 0], [0, 1, 0], [0, 1, 1]], dtype=torch.bool))
    assert pos.tolist() == [[1, 2, 3]]


@pytest.mark.parametrize("left_pad", [False, True])
def test_ttt_forward_equals_naive_chains(left_pad):
    head, target = setup("eagle3")
    steps, t = 3, 9
    batch = make_batch(target, [9, 6], t, left_pad=left_pad)
    with torch.no_grad():
        hidden = head.project(batch["aux_hidden"])
        outs = ttt_forward(head, batch["input_ids"], hidden, steps, batch["attention_mask"])
    assert len(outs) == steps
    checked = 0
    for r in range(2):
        sl = real_slice(batch, r)
        naive = naive_chain_logits(head, batch["input_ids"][r, sl], hidden[r, sl], steps)
        for (i, j), logits in naive.items():
            torch.testing.assert_close(head.logits(outs[j][r, sl.start + i]), logits, atol=1e-4, rtol=1e-4)
            checked += 1
    assert checked == (8 + 7 + 6) + (5 + 4 + 3)


def test_chain_positions_keep_each_rows_order_and_pad_with_the_last_position():
    needed = torch.tensor([[0, 1, 0, 1, 1], [1, 0, 0, 0, 0], [0, 0, 0, 0, 0]], dtype=torch.bool)
    assert chain_positions(needed).tolist() == [[1, 3, 4], [0, 4, 4], [4, 4, 4]]
    assert chain_positions(torch.zeros(2, 3, dtype=torch.bool)).tolist() == [[2], [2]]  # K is at least 1


@pytest.mark.parametrize("left_pad", [False, True])
def test_ttt_forward_on_chosen_chains_equals_the_full_rows(left_pad):
    # steps 1.. run only along some chains; their rows must equal the all-positions computation's
    head, target = setup("eagle3")
    steps, t = 4, 9
    batch = make_batch(target, [9, 6], t, left_pad=left_pad, seed=2)
    am = batch["attention_mask"]
    needed = torch.zeros(2, t, dtype=torch.bool)
    needed[0, [1, 4, 5, 7]] = True
    needed[1, [3, 6] if left_pad else [0, 2]] = True
    chains = chain_positions(needed)
    with torch.no_grad():
        hidden = head.project(batch["aux_hidden"])
        full = ttt_forward(head, batch["input_ids"], hidden, steps, am)
        sparse = ttt_forward(head, batch["input_ids"], hidden, steps, am, chains)
    torch.testing.assert_close(sparse[0], full[0])
    for j in range(1, steps):
        assert sparse[j].shape == (2, 4, full[j].shape[-1])
        for r in range(2):
            n = int(needed[r].sum())
            torch.testing.assert_close(sparse[j][r, :n], full[j][r, chains[r, :n]], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("left_pad", [False, True])
def test_step0_on_chosen_rows_equals_the_full_rows_and_gradients(left_pad):
    # step 0 queried only at some positions (every position still gives keys/values), the later steps along
    # chains among them: outputs and parameter gradients equal the all-positions computation's
    head, target = setup("eagle3")
    head.train()
    steps, t = 3, 10
    batch = make_batch(target, [10, 7], t, left_pad=left_pad, seed=3)
    am = batch["attention_mask"]
    chain_set = torch.zeros(2, t, dtype=torch.bool)
    chain_set[0, [2, 5, 6]] = True
    chain_set[1, [4, 8] if left_pad else [1, 3]] = True
    extra = torch.zeros_like(chain_set)
    extra[0, [7, 9]] = True
    extra[1, [5] if left_pad else [0]] = True
    chains, rows0 = chain_positions(chain_set), chain_positions(chain_set | extra)

    def run(sparse: bool) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
        head.zero_grad()
        hidden = head.project(batch["aux_hidden"])
        outs = ttt_forward(head, batch["input_ids"], hidden, steps, am, chains, rows0 if sparse else None)
        picked = [outs[0] if sparse else outs[0].gather(1, rows0[..., None].expand(-1, -1, outs[0].shape[-1]))]
        picked += outs[1:]
        weights = torch.linspace(0.5, 1.5, outs[0].shape[-1])
        sum((p * weights).sum() for p in picked).backward()
        return picked, {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}

    full, full_grads = run(False)
    sparse, sparse_grads = run(True)
    assert sparse[0].shape == (2, rows0.shape[1], full[0].shape[-1]) and rows0.shape[1] < t
    for j in range(steps):
        torch.testing.assert_close(sparse[j], full[j], atol=1e-5, rtol=1e-5)
    assert full_grads.keys() == sparse_grads.keys() and "fc.weight" in full_grads
    for name, grad in full_grads.items():
        torch.testing.assert_close(sparse_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)
    with pytest.raises(ValueError, match="step0_rows needs chains"):
        ttt_forward(head, batch["input_ids"], head.project(batch["aux_hidden"]), steps, am, None, rows0)


@pytest.mark.parametrize("w", [0.0, 0.5, 1.0])
def test_eagle3_loss_matches_hand_computation(w):
    head, target = setup("eagle3")
    steps, decay, t = 3, 0.8, 8
    batch = make_batch(target, [8, 6], t, seed=1)
    loss, metrics = eagle3_ttt_loss(head, batch, target.lm_head, ttt_steps=steps, step_decay=decay, top1_weight=w)
    draft_ids = torch.arange(40) + head.d2t
    with torch.no_grad():
        hidden = head.project(batch["aux_hidden"])
        target_logits = target.lm_head(batch["last_hidden"])
    expected = 0.0
    for j in range(steps):
        total, count, hits = 0.0, 0, 0
        for r in range(2):
            n = int(batch["attention_mask"][r].sum())
            naive = naive_chain_logits(head, batch["input_ids"][r, :n], hidden[r, :n], steps)
            for i in range(n):
                if i + j + 2 >= n or not batch["loss_mask"][r, i + j + 2]:
                    continue
                tl = target_logits[r, i + j + 1]
                p = torch.softmax(tl[draft_ids], -1)  # restricted to the draft vocab, renormalised
                logits = naive[(i, j)]
                log_q = logits - torch.logsumexp(logits, -1)
                soft = -sum(float(p[v]) * float(log_q[v]) for v in range(40))
                total += (1 - w) * soft - w * float(log_q[int(p.argmax())])  # w on the top draft token alone
                count += 1
                hits += int(int(draft_ids[int(logits.argmax())]) == int(tl.argmax()))
        assert count > 0
        assert int(metrics[f"count_{j}"]) == count
        assert metrics[f"loss_{j}"].item() == pytest.approx(total / count, rel=1e-4)
        assert metrics[f"acc_{j}"].item() == pytest.approx(hits / count)
        expected += decay**j * total / count
    assert loss.item() == pytest.approx(expected, rel=1e-4)
    assert metrics["loss"].item() == pytest.approx(expected, rel=1e-4)
    assert not metrics["loss"].requires_grad and loss.requires_grad


@torch.no_grad()
def old_full_logit_loss(head, batch, lm_head, steps: int, decay: float) -> tuple[float, list[float]]:
    """The former computation: full target logits over the whole vocabulary, then gathered at the draft ids."""
    ids, am, lm = batch["input_ids"], batch["attention_mask"].bool(), batch["loss_mask"].bool()
    t = ids.shape[1]
    full = lm_head(batch["last_hidden"]).float()
    logp = torch.log_softmax(full[..., torch.arange(head.d2t.numel()) + head.d2t], -1)
    outs = ttt_forward(head, ids, head.project(batch["aux_hidden"]), steps, am)

    def shift(x, k):
        return torch.cat([x[:, k:], torch.zeros_like(x[:, :k])], 1)

    valid = am & shift(am, 1) & shift(am, 2)
    total, accs = 0.0, []
    for j, out in enumerate(outs):
        n = t - j - 1
        mask = (valid & shift(lm, j + 2))[:, :n]
        logits = head.logits(out[:, :n]).float()
        ce = -(logp[:, j + 1 :].exp() * torch.log_softmax(logits, -1)).sum(-1)
        total += decay**j * float(ce[mask].sum() / mask.sum())
        hit = head.draft_to_target(logits.argmax(-1)) == full.argmax(-1)[:, j + 1 :]
        accs.append(float((hit & mask).sum() / mask.sum()))
        valid = valid & shift(am, j + 3)
    return total, accs


def test_restricted_target_logits_match_full_logits_and_top1_modes():
    head, target = setup("eagle3")
    with torch.no_grad():
        target.lm_head.weight.mul_(20.0)  # peaked, so a few training steps give the head some hits
    batch = make_batch(target, [12, 9, 12], 12, seed=4)
    # a draft vocabulary holding every top token of the batch
    with torch.no_grad():
        tops = target.lm_head(batch["last_hidden"]).argmax(-1).flatten()
    counts = torch.zeros(VOCAB, dtype=torch.long)
    counts[tops] = 1000
    assert int((counts > 0).sum()) <= 40
    head.set_draft_vocab(*build_draft_vocab(counts, 40, VOCAB))
    opt = torch.optim.Adam(head.parameters(), lr=3e-3)
    for _ in range(20):
        loss, _ = eagle3_ttt_loss(head.train(), batch, target.lm_head, ttt_steps=3, exact_top1=False)
        opt.zero_grad()
        loss.backward()
        opt.step()
    head.eval()

    loss, exact = eagle3_ttt_loss(head, batch, target.lm_head, ttt_steps=3)
    old_loss, old_accs = old_full_logit_loss(head, batch, target.lm_head, 3, 0.8)
    assert loss.item() == pytest.approx(old_loss, abs=1e-5)
    assert [exact[f"acc_{j}"].item() for j in range(3)] == pytest.approx(old_accs)
    assert sum(old_accs) > 0  # a comparison of something, not of zeros
    _, approx = eagle3_ttt_loss(head, batch, target.lm_head, ttt_steps=3, exact_top1=False)
    assert approx["loss"].item() == loss.item()
    for j in range(3):  # every top token is a draft token: both metrics agree
        assert approx[f"acc_{j}"].item() == exact[f"acc_{j}"].item()

    # a draft vocabulary missing some top tokens: the restricted metric can only add hits there
    counts[tops[:4]] = 0
    head.set_draft_vocab(*build_draft_vocab(counts, 40, VOCAB))
    loss, exact = eagle3_ttt_loss(head, batch, target.lm_head, ttt_steps=3)
    old_loss, old_accs = old_full_logit_loss(head, batch, target.lm_head, 3, 0.8)
    assert loss.item() == pytest.approx(old_loss, abs=1e-5)
    assert [exact[f"acc_{j}"].item() for j in range(3)] == pytest.approx(old_accs)
    _, approx = eagle3_ttt_loss(head, batch, target.lm_head, ttt_steps=3, exact_top1=False)
    assert all(approx[f"acc_{j}"] >= exact[f"acc_{j}"] for j in range(3))


def test_exact_top1_argmax_in_chunks(monkeypatch):
    import train.losses as losses

    head, target = setup("eagle3")
    batch = make_batch(target, [10, 10], 10, seed=5)
    _, whole = eagle3_ttt_loss(head, batch, target.lm_head, ttt_steps=2)
    # 3 positions per chunk, a ragged last one
    monkeypatch.setattr(losses, "_ARGMAX_CHUNK_ELEMENTS", 3 * VOCAB)
    _, chunked = eagle3_ttt_loss(head, batch, target.lm_head, ttt_steps=2)
    assert whole == chunked


def test_target_labels_ignore_autocast():
    """train.bf16 runs the loss under bf16 autocast: the target's logits (labels, exact top-1) must still be the
    lm_head's own fp32 numbers, bit for bit."""
    import train.losses as losses

    _, target = setup("eagle3")
    batch = make_batch(target, [12, 9], 12, seed=6)
    hidden, ids = batch["last_hidden"], torch.arange(0, VOCAB, 3)
    plain_at = losses._target_logits_at(target.lm_head, hidden, ids)
    plain_full = losses._target_logits(target.lm_head, hidden)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert target.lm_head(hidden).dtype == torch.bfloat16  # autocast is on here
        at = losses._target_logits_at(target.lm_head, hidden, ids)
        full = losses._target_logits(target.lm_head, hidden)
    assert at.dtype == full.dtype == torch.float32
    assert torch.equal(at, plain_at) and torch.equal(full, plain_full)


def test_eagle1_loss_matches_hand_computation():
    head, target = setup("eagle1")
    w_reg, w_ce, t = 1.0, 0.1, 7
    batch = make_batch(target, [7, 5], t, seed=2)
    loss, metrics = eagle1_loss(head, batch, target.lm_head, w_reg=w_reg, w_ce=w_ce)
    reg_sum = ce_sum = 0.0
    count = hits = 0
    for r in range(2):
        n = int(batch["attention_mask"][r].sum())
        ids, last = batch["input_ids"][r, :n], batch["last_hidden"][r, :n]
        with torch.no_grad():  # the head on the unpadded sequence, plain causal
            out = head(ids[None, 1:], last[None, :-1], torch.arange(n - 1)[None])[0]
        for i in range(n - 2):
            if not batch["loss_mask"][r, i + 2]:
                continue
            diffs = [float(out[i, k] - last[i + 1, k]) for k in range(HID)]
            reg_sum += sum(0.5 * d * d if abs(d) < 1 else abs(d) - 0.5 for d in diffs) / HID
            tl = target.lm_head(last[i + 1])
            hl = target.lm_head(out[i])
            p, log_q = torch.softmax(tl, -1), hl - torch.logsumexp(hl, -1)
            ce_sum += -sum(float(p[v]) * float(log_q[v]) for v in range(VOCAB))
            hits += int(int(hl.argmax()) == int(tl.argmax()))
            count += 1
    assert count > 0 and int(metrics["count"]) == count
    assert metrics["loss_reg"].item() == pytest.approx(reg_sum / count, rel=1e-4)
    assert metrics["loss_ce"].item() == pytest.approx(ce_sum / count, rel=1e-4)
    assert metrics["acc"].item() == pytest.approx(hits / count)
    assert loss.item() == pytest.approx((w_reg * reg_sum + w_ce * ce_sum) / count, rel=1e-4)


def test_losses_without_labels_are_zero_and_backward():
    head, target = setup("eagle3")
    batch = make_batch(target, [5], 5)
    batch["loss_mask"].zero_()
    loss, metrics = eagle3_ttt_loss(head.train(), batch, target.lm_head, ttt_steps=2, noise_std=0.1)
    assert loss.item() == 0.0 and int(metrics["count_0"]) == 0
    loss.backward()  # still connected to the graph


def test_noise_only_when_training():
    head, target = setup("eagle1")
    batch = make_batch(target, [6, 6], 6)
    a, _ = eagle1_loss(head.eval(), batch, target.lm_head, noise_std=0.5)
    b, _ = eagle1_loss(head.eval(), batch, target.lm_head)
    c, _ = eagle1_loss(head.train(), batch, target.lm_head, noise_std=0.5)
    assert a.item() == b.item() and c.item() != b.item()


def test_eagle3_overfits_tiny_batch():
    head, target = setup("eagle3", draft_vocab_size=128)
    with torch.no_grad():
        target.lm_head.weight.mul_(20.0)  # a peaked target distribution, so there is something to learn
    batch = make_batch(target, [24, 24, 20, 16], 24, seed=3)
    head.train()
    opt = torch.optim.Adam(head.parameters(), lr=3e-3)
    first = None
    for _ in range(50):
        loss, metrics = eagle3_ttt_loss(head, batch, target.lm_head, ttt_steps=2)
        opt.zero_grad()
        loss.backward()
        opt.step()
        first = metrics if first is None else first
    assert metrics["loss"].item() < 0.6 * first["loss"].item()
    assert metrics["acc_0"].item() > first["acc_0"].item() + 0.2


def test_count_tokens_uses_loss_mask():
    counts = count_tokens([([5, 6, 6, 7], [0, 1, 1, 1]), (torch.tensor([7, 9]), torch.tensor([1, 0]))], 12)
    assert counts.tolist() == [0, 0, 0, 0, 0, 0, 2, 2, 0, 0, 0, 0]
    grown = count_tokens([([5, 6], [1, 1])])
    assert grown.tolist() == [0, 0, 0, 0, 0, 1, 1]
    with pytest.raises(EagleError, match="outside the vocabulary"):
        count_tokens([([5, 20], [1, 1])], 12)


def test_build_draft_vocab_order_ties_and_padding():
    counts = Counter({7: 5, 3: 5, 9: 1, 1: 9})
    d2t, t2d = build_draft_vocab(counts, 3, 12)
    ids = (torch.arange(3) + d2t).tolist()
    assert ids == [1, 3, 7]  # 1 (9), then the tie 3/7 (5 each); 9 (1) is left out
    assert t2d.tolist() == [i in ids for i in range(12)]
    # fewer distinct tokens than the draft size: pad with the lowest unseen ids, deterministically
    d2t, t2d = build_draft_vocab(counts, 7, 12)
    ids = (torch.arange(7) + d2t).tolist()
    assert ids == [0, 1, 2, 3, 4, 7, 9]
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert bool(t2d[torch.arange(7) + d2t].all()) and int(t2d.sum()) == 7
    tensor_counts = torch.zeros(12, dtype=torch.long)
    for k, v in counts.items():
        tensor_counts[k] = v
    assert torch.equal(build_draft_vocab(tensor_counts, 7, 12)[0], d2t)
    full_d2t, full_t2d = build_draft_vocab(counts, 12, 12)
    assert full_d2t.tolist() == [0] * 12 and bool(full_t2d.all())


@pytest.mark.parametrize("size", [0, -1, 13])
def test_build_draft_vocab_rejects_bad_sizes(size):
    with pytest.raises(EagleError, match="draft vocabulary size"):
        build_draft_vocab(Counter({1: 1}), size, 12)


def test_vocab_save_load_roundtrip(tmp_path):
    d2t, t2d = build_draft_vocab(torch.arange(20), 5, 20)
    assert (torch.arange(5) + d2t).tolist() == [15, 16, 17, 18, 19]
    save_vocab(tmp_path / "vocab.safetensors", d2t, t2d)
    d2t2, t2d2 = load_vocab(tmp_path / "vocab.safetensors")
    assert torch.equal(d2t, d2t2) and torch.equal(t2d, t2d2)
    bad = t2d.clone()
    bad[0] = True
    with pytest.raises(EagleError, match="do not describe the same"):
        check_vocab(d2t, bad)
    with pytest.raises(EagleError, match="not found"):
        load_vocab(tmp_path / "missing.safetensors")


def test_exact_top1_taken_from_the_batch_when_given():
    """``batch["target_top"]`` (kept by the trainer's validation) replaces the argmax: the same labels give the
    same metrics, other labels other accuracies."""
    import train.losses as losses

    head, target = setup("eagle3")
    batch = make_batch(target, [10, 10], 10, seed=7)
    _, computed = eagle3_ttt_loss(head, batch, target.lm_head, ttt_steps=2)
    tops = losses.target_argmax(target.lm_head, batch["last_hidden"])
    _, given = eagle3_ttt_loss(head, {**batch, "target_top": tops}, target.lm_head, ttt_steps=2)
    assert given == computed
    # labels rigged to the head's own step-0 predictions (the one at i is scored against the label at i + 1)
    out = losses.ttt_forward(head, batch["input_ids"], head.project(batch["aux_hidden"]), 1, batch["attention_mask"])[0]
    rigged_top = torch.full_like(tops, -1)
    rigged_top[:, 1:] = head.draft_to_target(head.logits(out).argmax(-1))[:, :-1]
    _, rigged = eagle3_ttt_loss(head, {**batch, "target_top": rigged_top}, target.lm_head, ttt_steps=2)
    assert rigged["acc_0"].item() == 1.0 and computed["acc_0"].item() < 1.0


def test_trainer_passes_top1_weight_to_the_loss_and_checks_it():
    from train.trainer import HeadWithLoss, TrainConfig

    head, target = setup("eagle3")
    batch = make_batch(target, [8, 6], 8, seed=2)
    losses = {}
    for w in (0.0, 1.0):
        module = HeadWithLoss(head, target.lm_head, "eagle3", TrainConfig(ttt_steps=2, top1_weight=w)).eval()
        losses[w] = module(batch)[0].item()
        expected = eagle3_ttt_loss(head, batch, target.lm_head, ttt_steps=2, top1_weight=w)[0].item()
        assert losses[w] == pytest.approx(expected)
    assert losses[0.0] != pytest.approx(losses[1.0])
    with pytest.raises(EagleError, match="train.top1_weight"):
        TrainConfig(top1_weight=1.5).validate()
    eagle1, _ = setup("eagle1")
    with pytest.raises(EagleError, match="train.top1_weight applies to eagle3"):  # not silently ignored
        HeadWithLoss(eagle1, target.lm_head, "eagle1", TrainConfig(top1_weight=0.5))


@pytest.mark.parametrize("name", ["granite", "cohere2", "gemma2", "falcon_h1"])
def test_labels_are_the_targets_own_logits_scale_and_cap_included(name):
    """Families that scale or soft-cap lm_head(h) in their forward: the training labels (whole vocabulary and
    draft-vocabulary rows) are those logits, not the raw lm_head's."""
    import train.losses as losses
    from eagle.lazy_logits import TargetLogits
    from eagle.testing import family_model

    model = family_model(name)
    ids = torch.randint(3, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    hidden, labels, rows = out.hidden_states[-1], TargetLogits(model), torch.arange(0, 256, 5)
    torch.testing.assert_close(losses._target_logits(labels, hidden), out.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(losses._target_logits_at(labels, hidden, rows), out.logits[..., rows],
                               rtol=1e-5, atol=1e-5)
    assert not torch.allclose(model.lm_head(hidden), out.logits, atol=1e-2)  # the family does post-process
