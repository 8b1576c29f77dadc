"""Features kept from regeneration (data.capture_features): what generation captures, that collection copies
them for the rows they fit and computes the rest, and that the losses never read what a capture leaves out."""

from __future__ import annotations

import json
import re

import pytest
import torch
from datasets import load_from_disk
from safetensors.torch import load_file

from eagle.features import capture_features
from eagle.targets import Target
from eagle.testing import tiny_model
from train import chat_template as CT
from train import collect as C
from train import regenerate as R
from train.collect import CollectConfig, collect
from train.losses import eagle1_loss, eagle3_ttt_loss
from train.prepare import DataConfig, prepare
from train.regen_features import FeatureCapture, last_loss_position
from train.shards import FeatureShards

AUX = [1, 2, 3]


@pytest.fixture(scope="module")
def model(tok):
    return tiny_model("llama", vocab_size=len(tok), hidden_size=32, num_layers=3, seed=3).eval()


def _prompts(tok, texts):
    return [
        tok(CT.render(tok, [{"role": "user", "content": t}], add_generation_prompt=True),
            add_special_tokens=False)["input_ids"]
        for t in texts
    ]  # fmt: skip


def _generate(model, tok, prompts, cfg, stops):
    grab = FeatureCapture(model, AUX, torch.float32)
    answers = R.generate_batch(model, tok, prompts, cfg, stops, seed=0, capture=grab)
    return answers, grab.rows()


def test_capture_holds_what_a_plain_forward_gives_and_changes_no_answer(tok, model):
    prompts = _prompts(tok, ["Hi", "Tell me about the sea and the long coast line, please", "Write a poem", "ok"])
    cfg = DataConfig(regen_max_new_tokens=10)
    _, free = _generate(model, tok, prompts, cfg, set())
    for p, (ids, _, _) in zip(prompts, free):  # no stop token: every answer is cut at 10 tokens, all 10 read
        assert ids[: len(p)].tolist() == p and len(ids) == len(p) + 10
    # a stop token that ends row 0 early (at its 4th answer token) and does not occur in row 1's answer
    stop = int(free[0][0][len(prompts[0]) + 3])
    assert stop not in free[1][0][len(prompts[1]):].tolist(), "pick another seed: the stop occurs in row 1"
    answers, rows = _generate(model, tok, prompts, cfg, {stop})
    assert answers == R.generate_batch(model, tok, prompts, cfg, {stop}, seed=0)  # capturing changes nothing
    answer0 = free[0][0][len(prompts[0]):].tolist()
    first = answer0.index(stop)
    # the stopped row's tokens up to the stop are read, the stop itself is not; the other row runs to the end
    assert rows[0][0].tolist() == prompts[0] + answer0[:first]
    assert rows[1][0].tolist() == free[1][0].tolist()
    for ids, aux, last in rows:
        aux_ref, last_ref = capture_features(model, ids[None], None, AUX)
        assert aux.dtype == torch.float32 and aux.shape == (len(ids), 3 * 32) and last.shape == (len(ids), 32)
        torch.testing.assert_close(aux, aux_ref[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(last, last_ref[0], rtol=1e-4, atol=1e-5)


def test_capture_is_the_same_with_a_cache_that_cannot_drop_rows(tok, model, monkeypatch):
    """Where the cache cannot drop finished rows they stay in the batch: capture must skip them all the same."""
    import transformers

    class KeepRows(transformers.DynamicCache):
        def __getattribute__(self, name):
            if name == "batch_select_indices":
                raise AttributeError(name)
            return super().__getattribute__(name)

    prompts = _prompts(tok, ["Hi", "Tell me about the sea and the long coast line, please", "ok"])
    cfg = DataConfig(regen_max_new_tokens=10)
    _, free = _generate(model, tok, prompts, cfg, set())
    stop = int(free[0][0][len(prompts[0]) + 2])  # ends row 0 at its 3rd answer token
    dropping = _generate(model, tok, prompts, cfg, {stop})
    assert not hasattr(KeepRows(), "batch_select_indices")
    monkeypatch.setattr(transformers, "DynamicCache", KeepRows)
    keeping = _generate(model, tok, prompts, cfg, {stop})
    assert keeping[0] == dropping[0]
    assert len(keeping[1][0][0]) < len(keeping[1][1][0])  # row 0 did stop early
    for (ids_k, aux_k, last_k), (ids_d, aux_d, last_d) in zip(keeping[1], dropping[1]):
        assert ids_k.tolist() == ids_d.tolist()
        torch.testing.assert_close(aux_k, aux_d, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(last_k, last_d, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("loss", ["eagle3", "eagle1"])
def test_losses_never_read_features_from_the_last_label_on(loss):
    """What lets a capture stop short: zeroing every feature from the last loss-masked position on changes
    neither the loss nor any metric."""
    from eagle.heads import HeadConfig, build_head
    from train.vocab import build_draft_vocab

    target = tiny_model("llama", seed=1)
    cfg = HeadConfig.from_target(target.config, kind=loss, draft_vocab_size=40, aux_layers=AUX)
    torch.manual_seed(2)
    head = build_head(cfg).attach_target(target).eval()
    if loss == "eagle3":
        head.set_draft_vocab(*build_draft_vocab(torch.arange(256) % 7, 40, 256))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 256, (3, 30), generator=g)
    lm = torch.zeros(3, 30, dtype=torch.long)
    lm[0, 10:22] = 1  # an answer that ends well before the row does
    lm[1, 5:29] = 1
    lm[2, [8, 12, 13]] = 1
    aux, last = capture_features(target, ids, None, AUX)
    batch = {"input_ids": ids, "loss_mask": lm, "aux_hidden": aux, "last_hidden": last}
    cut = {k: v.clone() for k, v in batch.items()}
    for r in range(3):
        end = last_loss_position(lm[r])
        cut["aux_hidden"][r, end:] = 0
        cut["last_hidden"][r, end:] = 0
    fn = eagle3_ttt_loss if loss == "eagle3" else eagle1_loss
    with torch.no_grad():
        want, want_m = fn(head, batch, target.lm_head)
        got, got_m = fn(head, cut, target.lm_head)
    assert float(want) > 0 and torch.equal(want, got)
    assert want_m.keys() == got_m.keys() and all(torch.equal(want_m[k], got_m[k]) for k in want_m)
    # and the claim has teeth: zeroing from one position earlier on does change the loss
    cut["aux_hidden"][0, last_loss_position(lm[0]) - 1] = 0
    cut["last_hidden"][0, last_loss_position(lm[0]) - 1] = 0
    with torch.no_grad():
        assert not torch.equal(fn(head, cut, target.lm_head)[0], want)


def _chat(tmp_path, n=6):
    path = tmp_path / "prompts.jsonl"
    topics = ["cats", "the sea", "a long walk along the coast line", "bread", "rain in spring", "chess openings"]
    with path.open("w") as fh:
        for t in topics[:n]:
            fh.write(json.dumps({"messages": [{"role": "user", "content": f"Tell me about {t}"}]}) + "\n")
    return str(path)


def _copied(capsys) -> int:
    """Tokens the last collect copied from captures, from its summary line."""
    line = [x for x in capsys.readouterr().out.splitlines() if " tokens in " in x and "/s on this process" in x][-1]
    found = re.search(r"([\d,]+) of them copied", line)
    return int(found.group(1).replace(",", "")) if found else 0


def test_collect_copies_captured_features_and_computes_the_rest(tmp_path, tok, model, monkeypatch, capsys):
    data = DataConfig(
        sources=[_chat(tmp_path)], regenerate=True, capture_features=True, regen_max_new_tokens=8,
        regen_batch_size=4, val_fraction=0.34, output_dir=str(tmp_path / "data"),
    )  # fmt: skip
    spec = CollectConfig(output_dir=str(tmp_path / "f1"), dtype="float32", shard_tokens=200, batch_tokens=256)
    summary = prepare(data, "tiny", tokenizer=tok, model=model, collect=spec)
    kept = summary["captured_features"]
    assert kept and list(kept["spec"]["aux_layers"]) == [1, 2, 3] and kept["spec"]["dtype"] == "float32"
    files = sorted((tmp_path / "data" / kept["dir"]).glob("batch-*.safetensors"))
    assert len(files) == 2  # 6 prompts in batches of 4
    sizes = [len(load_file(str(f))["offsets"]) - 1 for f in files]
    assert sorted(sizes) == [2, 4]
    files[sizes.index(2)].unlink()  # as if a kill had come between a batch's answers and its features

    target = Target.from_model(model, name="tiny")
    manifest = collect(spec, tmp_path / "data", target)
    copied = _copied(capsys)
    total = sum(split["num_tokens"] for split in manifest["splits"].values())
    assert 0 < copied < total  # four rows copied, two computed
    # the same data collected by the target alone
    with monkeypatch.context() as m:
        m.setattr(C, "_captured_lookup", lambda *a, **k: {})
        plain = collect(CollectConfig(**{**spec.__dict__, "output_dir": str(tmp_path / "f2")}), tmp_path / "data", target)
    assert _copied(capsys) == 0 and plain["splits"] == {  # the manifests differ only in the shards' checksums
        k: {**v, "shards": [{**s, "sha256": t["sha256"]} for s, t in zip(v["shards"], plain["splits"][k]["shards"])]}
        for k, v in manifest["splits"].items()
    }
    for split in ("train", "val"):
        a = FeatureShards(tmp_path / "f1", split)
        b = FeatureShards(tmp_path / "f2", split)
        ds = load_from_disk(str(tmp_path / "data" / split))
        assert a.seq_indices() == b.seq_indices() and len(a) == len(ds)
        for i in range(len(a)):
            x, y = a[i], b[i]
            assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["loss_mask"], y["loss_mask"])
            end = last_loss_position(x["loss_mask"])
            torch.testing.assert_close(x["aux_hidden"][:end], y["aux_hidden"][:end], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(x["last_hidden"][:end], y["last_hidden"][:end], rtol=1e-4, atol=1e-5)

    # features for another layout are not used: another storage dtype computes everything
    collect(CollectConfig(output_dir=str(tmp_path / "f3"), dtype="bfloat16"), tmp_path / "data", target)
    assert _copied(capsys) == 0
    collect(CollectConfig(output_dir=str(tmp_path / "f4"), dtype="float32"), tmp_path / "data", target)
    assert _copied(capsys) == copied  # ... and the same layout copies again


def test_a_capture_is_used_only_for_the_row_it_fits(tmp_path, tok, model):
    from train.regen_features import CapturedFeatures, CaptureSpec, write_batch

    spec = CaptureSpec("fp", "float32", tuple(AUX), "float32")
    ids = torch.arange(10, 20)
    aux, last = torch.randn(10, 96), torch.randn(10, 32)
    write_batch(tmp_path / "cap", "batch-0-00000", [("a", 0)], [(ids, aux, last)], spec)
    kept = CapturedFeatures(tmp_path / "cap", spec)
    mask = [0] * 8 + [1, 1, 1, 0]  # a 12-token row: label at 10, features needed up to 9: all captured
    row = list(range(10, 20)) + [5, 6]
    got = kept.for_row("a", row, mask)
    assert got is not None and got[0].shape == (12, 96)
    assert torch.equal(got[0][:10], aux) and not got[0][10:].any() and torch.equal(got[1][:10], last)
    assert kept.for_row("a", row, [0] * 11 + [1]) is None  # the label at 11 needs the feature at 10
    assert kept.for_row("a", [10, 11, 99] + row[3:], mask) is None  # other tokens
    assert kept.for_row("b", row, mask) is None  # another conversation
    assert kept.for_row("a", row[:6], [0, 0, 1, 1, 1, 1]) is not None  # a truncated row
    assert len(CapturedFeatures(tmp_path / "cap", CaptureSpec("fp", "bfloat16", tuple(AUX), "float32"))) == 0


def test_a_bf16_regeneration_keeps_features_for_a_bf16_collection(tmp_path, tok, model, capsys):
    """data.regen_dtype and collect.target_dtype alike: the bf16 target's features are kept and copied; a
    collection in another dtype than regeneration's keeps nothing (it could not use it)."""
    import copy

    base = dict(
        sources=[_chat(tmp_path, n=4)], regenerate=True, capture_features=True, regen_max_new_tokens=6,
        regen_batch_size=4, val_fraction=0.25, regen_dtype="bfloat16",
    )  # fmt: skip
    apart = prepare(DataConfig(**base, output_dir=str(tmp_path / "d0")), "tiny", tokenizer=tok, model=model,
                    collect=CollectConfig(dtype="float32"))  # collection would run the fp32 target
    assert apart["captured_features"] is None
    spec = CollectConfig(output_dir=str(tmp_path / "f"), dtype="float32", target_dtype="bfloat16")
    summary = prepare(DataConfig(**base, output_dir=str(tmp_path / "d1")), "tiny", tokenizer=tok, model=model,
                      collect=spec)
    assert summary["captured_features"]["spec"]["model_dtype"] == "bfloat16"
    assert next(model.parameters()).dtype == torch.float32  # the caller's model was not converted

    bf16 = Target.from_model(copy.deepcopy(model).to(torch.bfloat16), name="tiny")
    manifest = collect(spec, tmp_path / "d1", bf16)
    total = sum(split["num_tokens"] for split in manifest["splits"].values())
    assert _copied(capsys) == total  # every row's features were kept
    row = FeatureShards(tmp_path / "f", "train")[0]
    end = last_loss_position(row["loss_mask"])
    aux, last = capture_features(bf16.model, row["input_ids"][None], None, AUX)
    torch.testing.assert_close(row["aux_hidden"][:end], aux[0, :end].float(), rtol=0.05, atol=0.05)
    torch.testing.assert_close(row["last_hidden"][:end], last[0, :end].float(), rtol=0.05, atol=0.05)
    # the fp32 target does not take the bf16 target's features
    collect(CollectConfig(output_dir=str(tmp_path / "f32"), dtype="float32"), tmp_path / "d1",
            Target.from_model(model, name="tiny"))
    assert _copied(capsys) == 0
