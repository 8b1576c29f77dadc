"""The simulated chain acceptance length of validation (``sim_tau``) and ``train.keep_best``: the value on a
hand-built case, against the chain tau our speculative loop measures, and keeping (and resuming) the best
checkpoint."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file

from eagle.drafter import HeadDrafter
from eagle.errors import EagleError
from eagle.features import default_aux_layers
from eagle.heads import HeadConfig, build_head
from eagle.lazy_logits import TargetLogits
from eagle.speculate import plain_generate, speculative_generate
from eagle.testing import family_model
from eagle.tree import TreeConfig
from train import checkpoint as ck
from train.batching import PreparedSequences
from train.logging import read_metrics
from train.losses import eagle3_ttt_loss, leading_hits
from train.trainer import HeadWithLoss, TrainConfig, improves, train
from train.validation import validate

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")  # tests build Accelerators

# ------------------------------------------------------------------------------------------ hand-built cases


def test_leading_hits_counts_leading_steps_until_a_miss_or_a_missing_label():
    counted = [torch.tensor([[1, 1, 1, 1, 1, 0]]).bool(),
               torch.tensor([[1, 1, 1, 1, 0, 0]]).bool(),
               torch.tensor([[1, 0, 1, 1, 0, 0]]).bool()]
    hits = [torch.tensor([[1, 0, 1, 1, 1, 1]]).bool(),   # root 1 misses at step 0
            torch.tensor([[1, 1, 0, 1, 1, 1]]).bool(),   # root 2 misses at step 1
            torch.tensor([[1, 1, 1, 1, 1, 1]]).bool()]
    # root 0: all three; root 1: broken at step 0; root 2: 1; root 3: all three; root 4: its step 1 has no label
    # (the sequence ends) so 1 although it would hit; root 5: no step-0 label, no position (0)
    assert leading_hits(hits, counted).tolist() == [[3, 0, 1, 3, 1, 0]]
    # a missing label ends a chain that would go on hitting: root 1's step 2 has none
    assert leading_hits([torch.ones(1, 2).bool()] * 3, [torch.ones(1, 2).bool(), torch.ones(1, 2).bool(),
                                                        torch.tensor([[1, 0]]).bool()]).tolist() == [[3, 2]]


def _save_split(folder, ids: list[list[int]], masks: list[list[int]]):
    from datasets import Dataset

    Dataset.from_dict({"input_ids": ids, "loss_mask": masks}).save_to_disk(str(folder / "val"))
    return PreparedSequences(folder, "val")


def test_validate_sim_tau_on_a_hand_built_case(tmp_path, bigram_target):
    """A head that always drafts token 0 (zero lm_head) and a rigged target top-1 (0 = hit, 1 = miss at each
    label position) give known chains; validate() must report exactly their mean."""
    from accelerate import Accelerator

    target = bigram_target
    aux = default_aux_layers(target.num_layers)
    hcfg = HeadConfig.from_target(target.model.config, "eagle3", draft_vocab_size=256, aux_layers=aux)
    head = build_head(hcfg).attach_target(target.model)
    with torch.no_grad():
        head.lm_head.weight.zero_()  # every logit 0: argmax is draft id 0, target token 0 (d2t is 0)
    cfg = TrainConfig(ttt_steps=3)
    model = HeadWithLoss(head, TargetLogits(target.model), "eagle3", cfg)
    # sequence a: a 3-token prompt; sequence b: a loss-mask gap at position 4 and right padding
    source = _save_split(tmp_path, [list(range(3, 13)), list(range(20, 28))],
                         [[0, 0, 0, 1, 1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 0, 1, 1, 1]])
    # label of root i at step j is the target's top-1 at position i + j + 1
    hit_a = {2: 1, 3: 0, 4: 1, 5: 1, 6: 1, 7: 0, 8: 1}
    top = torch.ones(2, 10, dtype=torch.long)  # 1: a miss
    for p, h in hit_a.items():
        top[0, p] = 0 if h else 1
    top[1, :] = 0  # b hits everywhere: only its loss mask and its end cut chains
    # a: roots 1..7 accept 1, 0 (broken at step 0), 3, 2, 1, 0, 1 (root 7: its step 1 is past the end)
    # b: roots 0, 1, 3, 4, 5 accept 2, 1 (the gap at 4 ends both), 3, 2, 1 (the end); root 2 has no step-0 label
    accepted = [1, 0, 3, 2, 1, 0, 1] + [2, 1, 3, 2, 1]
    out = validate(model, source, [[0, 1]], Accelerator(cpu=True), cfg, "eagle3", True, target, aux,
                   top1_cache={0: top})
    assert out["val_tokens"] == len(accepted) == 12
    assert out["sim_tau"] == pytest.approx(1 + sum(accepted) / 12)  # 2.4167
    for j in range(3):
        assert out[f"sim_accept_{j}"] == pytest.approx(sum(a > j for a in accepted) / 12)
    assert out["sim_accept_0"] == pytest.approx(out["val_acc_0"])


# ------------------------------------------------------------------------------- against the speculative loop

AUX, K = [1, 2, 3], 3


def _features(model, ids: torch.Tensor, start: int) -> dict:
    """A one-sequence batch with the target's exact features, labels counted from position ``start``."""
    with torch.no_grad():
        hs = model(ids[None], output_hidden_states=True).hidden_states
    mask = torch.zeros(1, ids.numel(), dtype=torch.long)
    mask[:, start:] = 1
    return {"input_ids": ids[None], "loss_mask": mask, "aux_hidden": torch.cat([hs[i] for i in AUX], -1),
            "last_hidden": hs[-1]}


def _partly_trained_head(model, texts: list[torch.Tensor], start: int, steps: int = 40):
    """An eagle3 head trained briefly (hard labels) on the target's own greedy texts: it drafts some chains
    whole, some in part, some not at all."""
    cfg = HeadConfig.from_target(model.config, "eagle3", draft_vocab_size=model.config.vocab_size,
                                 aux_layers=AUX)
    torch.manual_seed(1)
    head = build_head(cfg).attach_target(model).double()
    batches = [_features(model, t, start) for t in texts]
    optimizer = torch.optim.Adam(head.parameters(), lr=3e-3)
    for i in range(steps):
        loss, _ = eagle3_ttt_loss(head.train(), batches[i % len(batches)], model.lm_head, K, exact_top1=False,
                                  top1_weight=1.0)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return head.eval()


def test_sim_tau_chains_are_the_chains_the_speculative_loop_accepts():
    """On the target's own greedy text with exact features (float64, no rounding ties), the chain validation
    simulates at every position is the chain the loop drafts there: at every verification step of
    speculative_generate (a chain of ttt_steps drafts, T=0) the accepted drafts equal validation's count at
    that step's root. So the loop's chain tau is validation's per-position counts averaged over the roots the
    loop stops at; sim_tau averages them over every position, which is not the same average (a position the
    loop jumps over counts in sim_tau only), hence no equality there, only closeness."""
    model = family_model("llama", vocab_size=32).double()  # wide init: sharp, varied greedy text
    n_prompt, n_new = 8, 40
    prompts = [torch.randint(3, 32, (1, n_prompt), generator=torch.Generator().manual_seed(s)) for s in range(3)]
    # the texts run K + 2 tokens past what the loop generates, so every chain it drafts has its labels
    texts = [torch.cat([p[0], torch.tensor(plain_generate(model, p, n_new + K + 2).tokens)]) for p in prompts]
    # labels from the second generated token: the first is the loop's first root token, never drafted
    head = _partly_trained_head(model, texts, n_prompt + 1)
    loop_lengths, walked, sim = [], [], []
    for prompt, text in zip(prompts, texts):
        counts: list[torch.Tensor] = []
        with torch.no_grad():
            eagle3_ttt_loss(head, _features(model, text, n_prompt + 1), model.lm_head, K, accepted=counts)
        chain = counts[0][0]
        result = speculative_generate(model, HeadDrafter(head), prompt, n_new,
                                      TreeConfig("chain", depth=K, lookup_ngram=0))
        assert result.tokens == text[n_prompt:n_prompt + n_new].tolist()
        root = n_prompt - 1  # the head's entry of the last prompt token drafts first
        for length in result.accept_lengths:
            walked.append(1 + int(chain[root]))
            root += length  # accepted drafts + the target's own token
        loop_lengths += result.accept_lengths
        sim += (1 + chain[n_prompt - 1 : n_prompt - 1 + n_new]).tolist()
    assert walked == loop_lengths  # every step of the loop, exactly
    assert len(set(loop_lengths)) == K + 1  # chains broken at every depth and accepted whole
    loop_tau, sim_tau = sum(loop_lengths) / len(loop_lengths), sum(sim) / len(sim)
    assert 1.5 < loop_tau < K + 0.5
    assert sim_tau == pytest.approx(loop_tau, abs=0.15), (sim_tau, loop_tau)  # 2.37 and 2.33 here


# ------------------------------------------------------------------------------------------ train.keep_best

# a bigram head (tests/_train_worker.py) learns in ~80 steps and then plateaus, where sim_tau goes up and down by a
# few validation positions: the best validation is not the last one
REFERENCE = dict(epochs=100, batch_size=8, lr=1e-2, warmup_steps=5, log_every=10, eval_every=10, save_every=10,
                 max_steps=150, keep_last=None, keep_best="sim_tau", progress=False, bf16=False, deterministic=True)


def _train(out, bigram_data, bigram_target, on_checkpoint=None, **kw):
    cfg = TrainConfig(**{**REFERENCE, "output_dir": str(out), **kw})
    return train(target=bigram_target, features_dir=bigram_data[1], head=HeadConfig(draft_vocab_size=256), cfg=cfg,
                 on_checkpoint=on_checkpoint)


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, bigram_data, bigram_target):
    """One uninterrupted keep_best run (read-only: a test that changes it copies it first)."""
    from accelerate.state import AcceleratorState, GradientState

    out = tmp_path_factory.mktemp("keep-best") / "reference"
    try:
        result = _train(out, bigram_data, bigram_target, report_to=["tensorboard"])
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    return out, result


def _evals(out) -> dict[int, dict]:
    return {e["step"]: e for e in read_metrics(out / "metrics.jsonl") if e["event"] == "eval"}


def _weights(folder) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_improves_goes_the_metrics_way():
    assert improves("sim_tau", 2.5, None) and improves("val_loss", 2.5, None)  # the first validation
    assert improves("sim_tau", 2.5, 2.4) and not improves("sim_tau", 2.4, 2.5)
    assert improves("val_loss", 2.4, 2.5) and not improves("val_loss", 2.5, 2.4)
    assert not improves("sim_tau", 2.5, 2.5) and not improves("val_loss", 2.5, 2.5)  # ties keep the earlier
    assert not improves("val_loss", float("nan"), None) and not improves("val_loss", float("inf"), 3.0)


def test_keep_best_values_are_checked():
    with pytest.raises(EagleError, match=r"train.keep_best must be one of \['sim_tau', 'val_loss'\].*'foo'"):
        TrainConfig(keep_best="foo").validate()
    for good in (None, "sim_tau", "val_loss"):
        TrainConfig(keep_best=good).validate()


def test_keep_best_needs_validation_data(tmp_path, bigram_target):
    import _train_worker as W

    prepared = W.make_prepared(tmp_path / "prepared", n_train=32, n_val=0, length=16)
    cfg = TrainConfig(output_dir=str(tmp_path / "run"), mode="online", max_steps=2, keep_best="sim_tau",
                      progress=False)
    with pytest.raises(EagleError, match="no validation data.*keep_best=null"):
        train(target=bigram_target, data_dir=prepared, head=HeadConfig(draft_vocab_size=64), cfg=cfg)


def test_keep_best_makes_final_the_best_validation(reference_run):
    out, result = reference_run
    evals = _evals(out)
    assert sorted(evals) == list(range(10, 151, 10))
    taus = {step: e["sim_tau"] for step, e in evals.items()}
    best_step = min(taus, key=lambda s: (-taus[s], s))  # the highest, the earliest of equals
    assert best_step < 150, taus  # the test's premise: a later validation was worse
    best = {"metric": "sim_tau", "value": taus[best_step], "step": best_step}
    assert result.best == best and ck.read_info(out / "best")["best"] == best
    info = ck.read_info(out / "final")
    assert info["best"] == best and info["checkpoint"] == "best" and info["global_step"] == 150
    assert info["eval"]["sim_tau"] == taus[best_step] and info["last_eval"]["sim_tau"] == taus[150]
    assert _same(_weights(out / "final"), _weights(out / "best"))
    assert _same(_weights(out / "final"), _weights(out / "checkpoints" / f"step-{best_step:07d}"))
    assert not _same(_weights(out / "final"), _weights(out / "checkpoints" / "step-0000150"))
    # every checkpoint records the best so far, for a resumed run to compare against
    for step in (best_step, 150):
        assert ck.read_state(out / "checkpoints" / f"step-{step:07d}")["best"] == best


def test_an_interrupted_run_keeps_the_best_it_had(tmp_path, reference_run, bigram_data, bigram_target):
    """Stopped right after the checkpoint of its best validation and resumed, a run ends with the same best as
    the uninterrupted one: the later, worse validations do not replace it, since the resumed run compares them
    with the best value the checkpoint recorded."""
    ref, ref_result = reference_run
    best_step = ref_result.best["step"]

    class Interrupted(Exception):
        pass

    def stop(path, step):
        if step == best_step:
            raise Interrupted

    out = tmp_path / "run"
    with pytest.raises(Interrupted):
        _train(out, bigram_data, bigram_target, on_checkpoint=stop)
    assert ck.read_info(out / "best")["best"]["step"] == best_step
    result = _train(out, bigram_data, bigram_target)
    assert result.resumed_from.name == f"step-{best_step:07d}"
    assert {s: e["sim_tau"] for s, e in _evals(out).items()} == {s: e["sim_tau"] for s, e in _evals(ref).items()}
    assert result.best == ref_result.best and ck.read_info(out / "final")["best"] == ref_result.best
    a, b = _weights(out / "final"), _weights(ref / "final")
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_resume_takes_a_best_written_after_its_checkpoint(tmp_path, reference_run, bigram_data, bigram_target):
    """Resumed from a checkpoint older than best/ (written after it, before an interruption), best/ and its value
    are the run's best so far: final/ is best/, not the checkpoint's weights."""
    ref, ref_result = reference_run
    best_step = ref_result.best["step"]
    out = tmp_path / "run"
    shutil.copytree(ref, out)
    before = out / "checkpoints" / f"step-{best_step - 10:07d}"
    result = _train(out, bigram_data, bigram_target, resume=str(before), max_steps=best_step - 10)
    assert result.resumed_from == before and result.global_step == best_step - 10
    assert result.best == ref_result.best
    assert _same(_weights(out / "final"), _weights(ref / "best"))


def test_sim_tau_is_logged_plotted_and_on_the_model_card(tmp_path, reference_run):
    """Every validation logs sim_tau = 1 + the sum of sim_accept_j (non-increasing, sim_accept_0 = val_acc_0)
    to metrics.jsonl and TensorBoard; the curves PNG has its panel; the card's rows carry the exported weights'
    sim_tau and say which step they are."""
    import matplotlib.image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from recipes.config import load_config
    from recipes.export import training_summary

    out, result = reference_run
    evals = _evals(out)
    for e in evals.values():
        accept = [e[f"sim_accept_{j}"] for j in range(3)]
        assert e["sim_tau"] == pytest.approx(1 + sum(accept))
        assert accept == sorted(accept, reverse=True) and accept[0] == pytest.approx(e["val_acc_0"])
        assert all(a <= e[f"val_acc_{j}"] + 1e-9 for j, a in enumerate(accept))
    assert evals[150]["sim_tau"] > 3.0  # the bigram head drafts most chains of 3 whole
    tags = EventAccumulator(str(out / "tb")).Reload().Tags()["scalars"]
    assert "eval/sim_tau" in tags and "eval/sim_accept_2" in tags
    assert matplotlib.image.imread(str(out / "training_curves.png")).shape[1] == 1600  # three panels of 5.3"
    cfg = load_config(None, [f"run_dir={tmp_path}"])
    rows = training_summary(cfg, out / "final")
    assert rows["validation sim tau (a chain of 3 drafts, T=0)"] == f"{result.best['value']:.3f}"
    assert rows["weights"] == f"step {result.best['step']} of 150: the best validation sim_tau (train.keep_best)"


def test_eagle1_sim_tau_is_one_plus_its_top1(tmp_path, bigram_data, bigram_target):
    result = train(target=bigram_target, features_dir=bigram_data[1], head=HeadConfig(kind="eagle1"),
                   cfg=TrainConfig(**{**REFERENCE, "output_dir": str(tmp_path / "e1"), "max_steps": 8,
                                      "eval_every": 8}))
    metrics = result.val_metrics
    assert metrics["sim_tau"] == pytest.approx(1 + metrics["val_acc"])
    assert metrics["sim_accept_0"] == pytest.approx(metrics["val_acc"])
    assert result.best["step"] == 8 and ck.read_info(tmp_path / "e1" / "final")["checkpoint"] == "best"
