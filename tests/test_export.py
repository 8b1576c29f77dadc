"""Export / import of draft heads: layouts, configs, round trips, target checks, failure modes."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

import eagle.export as export_mod
from eagle.errors import EagleError
from eagle.export import check_target_match, export_head, load_exported_head
from eagle.heads import HeadConfig, build_head
from eagle.targets import Target
from eagle.testing import tiny_config, tiny_model

AUX = [1, 2, 3]
DRAFT_VOCAB = 64


@pytest.fixture(scope="module")
def target() -> Target:
    return Target.from_model(tiny_model("llama", seed=0), name="tiny-llama-a")


@pytest.fixture(scope="module")
def other_target() -> Target:
    """Same shapes, other weights: only the fingerprint tells them apart."""
    return Target.from_model(tiny_model("llama", seed=1), name="tiny-llama-b")


def _perturb(head: torch.nn.Module, seed: int = 0) -> None:
    """Move every weight off its initial value and install a non-identity draft vocabulary."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
        if head.config.kind == "eagle3":
            ids = (
                torch.randperm(head.config.vocab_size, generator=g)[: head.config.draft_vocab_size]
                .sort()
                .values
            )
            t2d = torch.zeros(head.config.vocab_size, dtype=torch.bool)
            t2d[ids] = True
            head.set_draft_vocab(ids - torch.arange(len(ids)), t2d)


def _head(target: Target, kind: str = "eagle3", **cfg_changes) -> torch.nn.Module:
    cfg = HeadConfig.from_target(
        target.config,
        kind,
        draft_vocab_size=DRAFT_VOCAB if kind == "eagle3" else None,
        aux_layers=AUX if kind == "eagle3" else None,
        target_name=target.name,
        target_fingerprint=target.fingerprint,
    )
    head = build_head(dataclasses.replace(cfg, **cfg_changes))
    _perturb(head)
    return head.attach_target(target.model).eval()


def _outputs(head: torch.nn.Module, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft logits and the target ids of their argmax for fixed random inputs."""
    g = torch.Generator().manual_seed(seed)
    cfg = head.config
    ids = torch.randint(0, cfg.vocab_size, (1, 7), generator=g)
    width = len(cfg.aux_layers) * cfg.target_hidden_size if cfg.kind == "eagle3" else cfg.hidden_size
    feats = torch.randn(1, 7, width, generator=g)
    with torch.no_grad():
        dtype = next(head.parameters()).dtype
        out = head(ids, head.project(feats.to(dtype)), torch.arange(7)[None])
        logits = head.logits(out)
    return logits, head.draft_to_target(logits.argmax(-1))


def _assert_same_state(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype, k
        assert torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("layout", ["eagle3", "speculators"])
def test_eagle3_round_trip_is_bit_exact(tmp_path, target, layout):
    head = _head(target)
    out = export_head(head, tmp_path / "draft", layout=layout, dtype="float32", target=target)
    assert sorted(os.listdir(out)) == ["README.md", "config.json", "eagle_head.json", "model.safetensors"]
    loaded = load_exported_head(out, target)
    assert loaded.config == head.config
    _assert_same_state(head, loaded)
    (la, ta), (lb, tb) = _outputs(head), _outputs(loaded)
    assert torch.equal(la, lb) and torch.equal(ta, tb)
    assert loaded.d2t.any()  # a real (non-identity) draft vocabulary went through the round trip


@pytest.mark.parametrize("fc_bias", [True, False])
def test_eagle1_round_trip_is_bit_exact(tmp_path, target, fc_bias):
    head = _head(target, "eagle1", fc_bias=fc_bias)
    out = export_head(head, tmp_path / "draft", layout="eagle1", dtype="float32", target=target)
    loaded = load_exported_head(out, target.model)  # a bare HF model works as well as a Target
    assert loaded.config == head.config
    _assert_same_state(head, loaded)
    assert torch.equal(_outputs(head)[0], _outputs(loaded)[0])


def test_bf16_export_is_exact_at_the_export_dtype(tmp_path, target):
    head = _head(target)
    out = export_head(head, tmp_path / "draft", dtype="bfloat16", target=target)
    stored = load_file(str(out / "model.safetensors"))
    assert {t.dtype for k, t in stored.items() if k not in ("d2t", "t2d")} == {torch.bfloat16}
    loaded = load_exported_head(out)
    for k, v in head.state_dict().items():
        want = v.to(torch.bfloat16) if v.is_floating_point() else v
        assert torch.equal(loaded.state_dict()[k], want), k
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_eagle3_layout_matches_design(tmp_path, target):
    """docs/ARCHITECTURE.md ("Export layouts"): keys, shapes and dtypes of the EAGLE-3 export, written out by hand."""
    out = export_head(_head(target), tmp_path / "draft", layout="eagle3", dtype="bfloat16", target=target)
    h, k, inter, q, kv, bf = 64, 3, 128, 4 * 16, 2 * 16, torch.bfloat16
    expected = {
        "fc.weight": ((h, k * h), bf),
        "midlayer.self_attn.q_proj.weight": ((q, 2 * h), bf),
        "midlayer.self_attn.k_proj.weight": ((kv, 2 * h), bf),
        "midlayer.self_attn.v_proj.weight": ((kv, 2 * h), bf),
        "midlayer.self_attn.o_proj.weight": ((h, q), bf),
        "midlayer.mlp.gate_proj.weight": ((inter, h), bf),
        "midlayer.mlp.up_proj.weight": ((inter, h), bf),
        "midlayer.mlp.down_proj.weight": ((h, inter), bf),
        "midlayer.hidden_norm.weight": ((h,), bf),
        "midlayer.input_layernorm.weight": ((h,), bf),
        "midlayer.post_attention_layernorm.weight": ((h,), bf),
        "norm.weight": ((h,), bf),
        "lm_head.weight": ((DRAFT_VOCAB, h), bf),
        "d2t": ((DRAFT_VOCAB,), torch.int64),
        "t2d": ((256,), torch.bool),
    }
    stored = load_file(str(out / "model.safetensors"))
    assert {n: (tuple(t.shape), t.dtype) for n, t in stored.items()} == expected
    # d2t semantics: target id = i + d2t[i], and t2d marks exactly those ids
    targets = torch.arange(DRAFT_VOCAB) + stored["d2t"]
    assert torch.equal(stored["t2d"].nonzero().flatten(), targets)


def test_eagle3_config_json(tmp_path, target):
    out = export_head(_head(target), tmp_path / "draft", layout="eagle3", target=target)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["draft_vocab_size"] == DRAFT_VOCAB and cfg["vocab_size"] == 256
    assert cfg["num_hidden_layers"] == 1 and cfg["tie_word_embeddings"] is False
    assert cfg["rope_theta"] == 10000.0 and cfg["rope_parameters"]["rope_theta"] == 10000.0
    assert "target_hidden_size" not in cfg  # same as hidden_size
    assert cfg["eagle_aux_hidden_state_layer_ids"] == AUX  # vLLM numbering = HF hidden_states index
    assert cfg["eagle_config"] == {
        "use_aux_hidden_state": True,
        "eagle_aux_hidden_state_layer_ids": [0, 1, 2],
    }
    assert cfg["norm_before_residual"] is False
    assert cfg["bos_token_id"] == 1 and cfg["eos_token_id"] == 2
    hf = AutoConfig.from_pretrained(out)
    assert hf.model_type == "llama" and hf.hidden_size == 64 and hf.rope_parameters["rope_theta"] == 10000.0


def test_config_carries_rope_scaling_and_target_hidden_size(tmp_path):
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 1024,
    }
    tcfg = tiny_config("llama")
    tcfg.rope_parameters = dict(rope)
    base = HeadConfig.from_target(
        tcfg, "eagle3", draft_vocab_size=DRAFT_VOCAB, aux_layers=AUX, target_name="t"
    )
    # a draft narrower than its target: fc maps 3 * 64 target features to 32
    cfg = dataclasses.replace(base, hidden_size=32, intermediate_size=64, num_attention_heads=4, head_dim=8)
    head = build_head(cfg)
    _perturb(head)
    out = export_head((head.state_dict(), cfg), tmp_path / "draft", dtype="float32", target_config=tcfg)
    j = json.loads((out / "config.json").read_text())
    assert j["rope_theta"] == 500000.0
    assert j["rope_scaling"]["rope_type"] == "llama3" and j["rope_scaling"]["factor"] == 8.0
    assert j["rope_parameters"] == rope
    assert j["target_hidden_size"] == 64 and j["hidden_size"] == 32
    assert load_file(str(out / "model.safetensors"))["fc.weight"].shape == (32, 3 * 64)
    assert AutoConfig.from_pretrained(out).rope_parameters == rope
    loaded = load_exported_head(out)
    assert loaded.config == cfg
    _assert_same_state(head, loaded)
    (out / "eagle_head.json").unlink()  # rebuilt from config.json alone, as a runtime would
    rebuilt = load_exported_head(out)
    assert (rebuilt.config.rope_theta, rebuilt.config.rope_scaling) == (cfg.rope_theta, cfg.rope_scaling)
    assert rebuilt.config.target_hidden_size == 64 and rebuilt.config.aux_layers == AUX
    _assert_same_state(head, rebuilt)


def test_speculators_config_and_keys(tmp_path, target):
    out = export_head(
        _head(target), tmp_path / "draft", layout="speculators", target=target, speculative_tokens=5
    )
    j = json.loads((out / "config.json").read_text())
    assert j["architectures"] == ["Eagle3Speculator"] and j["speculators_model_type"] == "eagle3"
    assert j["draft_vocab_size"] == DRAFT_VOCAB and j["norm_before_residual"] is False
    assert j["eagle_aux_hidden_state_layer_ids"] == AUX
    tl = j["transformer_layer_config"]
    assert tl["vocab_size"] == 256 and tl["hidden_size"] == 64 and tl["num_hidden_layers"] == 1
    sc = j["speculators_config"]
    assert sc["algorithm"] == "eagle3" and sc["default_proposal_method"] == "greedy"
    assert sc["proposal_methods"][0] == {
        "proposal_type": "greedy",
        "speculative_tokens": 5,
        "verifier_accept_k": 1,
        "accept_tolerance": 0.0,
    }
    assert sc["verifier"]["name_or_path"] == "tiny-llama-a"
    keys = set(load_file(str(out / "model.safetensors")))
    assert not any(k.startswith("midlayer.") for k in keys)
    assert {"layers.0.hidden_norm.weight", "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} <= keys


def test_eagle1_layout_and_config(tmp_path, target):
    out = export_head(_head(target, "eagle1"), tmp_path / "draft", layout="eagle1", dtype="float16")
    stored = load_file(str(out / "model.safetensors"))
    assert set(stored) == {
        "fc.weight",
        "fc.bias",
        "layers.0.self_attn.q_proj.weight",
        "layers.0.self_attn.k_proj.weight",
        "layers.0.self_attn.v_proj.weight",
        "layers.0.self_attn.o_proj.weight",
        "layers.0.mlp.gate_proj.weight",
        "layers.0.mlp.up_proj.weight",
        "layers.0.mlp.down_proj.weight",
        "layers.0.post_attention_layernorm.weight",  # EAGLE-1's first layer has no input_layernorm
    }
    assert stored["fc.weight"].shape == (64, 128) and stored["fc.weight"].dtype == torch.float16
    j = json.loads((out / "config.json").read_text())
    assert j["architectures"] == ["LlamaForCausalLM"] and j["bias"] is True and j["vocab_size"] == 256
    assert "draft_vocab_size" not in j


@pytest.mark.parametrize("layout", ["eagle3", "speculators", "eagle1"])
def test_import_from_runtime_config_alone(tmp_path, target, layout):
    """Without eagle_head.json (a draft exported elsewhere) config.json + tensors suffice."""
    head = _head(target, "eagle1" if layout == "eagle1" else "eagle3")
    out = export_head(head, tmp_path / "draft", layout=layout, dtype="float32")
    (out / "eagle_head.json").unlink()
    loaded = load_exported_head(out, target)
    assert loaded.config.target_fingerprint == ""  # unknown without our file
    assert dataclasses.replace(
        loaded.config, target_fingerprint=head.config.target_fingerprint, target_name=""
    ) == (dataclasses.replace(head.config, target_name=""))
    assert torch.equal(_outputs(head)[0], _outputs(loaded)[0])


def test_head_for_another_target_is_refused(tmp_path, target, other_target):
    head = _head(target)
    with pytest.raises(EagleError, match="tiny-llama-a.*tiny-llama-b.*fingerprint"):
        export_head(head, tmp_path / "draft", target=other_target)
    assert not (tmp_path / "draft").exists()
    out = export_head(head, tmp_path / "ok", target=target)
    with pytest.raises(EagleError, match="--target tiny-llama-a"):
        load_exported_head(out, other_target)
    bigger_vocab = tiny_model("llama", vocab_size=320)
    with pytest.raises(EagleError, match="vocab 256.*vocab 320"):
        check_target_match(head.config, bigger_vocab)
    check_target_match(head.config, target.model)  # the same target as a bare HF model passes


def test_truncated_or_corrupt_weights_name_the_file(tmp_path, target):
    out = export_head(_head(target), tmp_path / "draft", target=target)
    path = out / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(EagleError, match="model.safetensors"):
        load_exported_head(out)
    path.write_bytes(b"\x00" * 64)
    with pytest.raises(EagleError, match="model.safetensors.*corrupt"):
        load_exported_head(out)


def test_missing_or_unexpected_keys_are_listed(tmp_path, target):
    out = export_head(_head(target), tmp_path / "draft", dtype="float32", target=target)
    path = out / "model.safetensors"
    tensors = load_file(str(path))
    tensors.pop("midlayer.hidden_norm.weight")
    tensors["extra.weight"] = torch.zeros(3)
    save_file(tensors, str(path))
    with pytest.raises(EagleError, match=r"missing keys \['midlayer.hidden_norm.weight'\].*extra.weight"):
        load_exported_head(out)
    tensors = load_file(str(path))
    tensors.pop("extra.weight")
    tensors["midlayer.hidden_norm.weight"] = torch.ones(65)
    save_file(tensors, str(path))
    with pytest.raises(EagleError, match=r"hidden_norm.weight has shape \[65\], expected \[64\]"):
        load_exported_head(out)


def test_pickle_checkpoints_are_not_loaded(tmp_path, target):
    out = export_head(_head(target), tmp_path / "draft", target=target)
    (out / "model.safetensors").rename(out / "pytorch_model.bin")
    with pytest.raises(EagleError, match="pickle"):
        load_exported_head(out)


def test_failed_export_leaves_nothing_half_written(tmp_path, target, monkeypatch):
    head = _head(target)
    old = export_head(head, tmp_path / "draft", dtype="float32", target=target)
    before = {p.name: p.read_bytes() for p in old.iterdir()}

    def broken_save(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export_mod, "save_file", broken_save)
    other = _head(target)
    _perturb(other, seed=5)
    with pytest.raises(EagleError, match="No space left"):
        export_head(other, tmp_path / "draft", dtype="float32")
    with pytest.raises(EagleError, match="No space left"):
        export_head(other, tmp_path / "fresh", dtype="float32")
    assert sorted(os.listdir(tmp_path)) == ["draft"]  # no temporary or half-written folders
    assert {p.name: p.read_bytes() for p in old.iterdir()} == before
    monkeypatch.undo()
    _assert_same_state(head, load_exported_head(old))
    # a successful re-export replaces the earlier one
    export_head(other, tmp_path / "draft", dtype="float32")
    _assert_same_state(other, load_exported_head(tmp_path / "draft"))
    assert sorted(os.listdir(tmp_path)) == ["draft"]


def test_refuses_to_replace_a_folder_that_is_not_an_export(tmp_path, target):
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "notes.txt").write_text("keep me")
    with pytest.raises(EagleError, match="not an exported draft directory"):
        export_head(_head(target), folder)
    assert os.listdir(folder) == ["notes.txt"]


def test_kind_and_layout_must_agree(tmp_path, target):
    with pytest.raises(EagleError, match="use layout eagle1"):
        export_head(_head(target, "eagle1"), tmp_path / "a", layout="eagle3")
    with pytest.raises(EagleError, match="eagle3 or speculators"):
        export_head(_head(target), tmp_path / "b", layout="eagle1")
    with pytest.raises(EagleError, match="unknown export layout"):
        export_head(_head(target), tmp_path / "c", layout="medusa")
    assert not any(tmp_path.iterdir())


def test_export_records_its_target_and_writes_a_model_card(tmp_path, target):
    info = {"name": "tiny-llama-a", "path": "/models/tiny", "fingerprint": target.fingerprint, "dtype": "bfloat16",
            "weights": "a dequantized GGUF", "original": "org/tiny"}
    training = {"training steps": 30, "training time": "1.5 min"}
    out = export_head(_head(target), tmp_path / "draft", target=target, target_info=info, training=training)
    assert json.loads((out / "config.json").read_text())["eagle_target"] == info
    assert json.loads((out / "eagle_head.json").read_text())["target"] == info
    card = (out / "README.md").read_text()
    for text in ("/models/tiny", target.fingerprint, "a dequantized GGUF", "org/tiny", "1.5 min",
                 "vllm serve /models/tiny", '"method": "eagle3"', "--speculative-algorithm EAGLE3",
                 "Not evaluated yet"):
        assert text in card, text
    # re-exporting over our own card works; the card is rewritten
    again = export_head(_head(target), tmp_path / "draft", target=target, target_info={**info, "dtype": "float32"})
    assert "float32" in (again / "README.md").read_text()
    # a folder with someone else's README is not ours to replace
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "README.md").write_text("# my notes\n")
    with pytest.raises(EagleError, match="not an exported draft directory"):
        export_head(_head(target), theirs, target=target)
    assert (theirs / "README.md").read_text() == "# my notes\n"


def test_eval_fills_in_the_cards_evaluation_section(tmp_path, target):
    from eagle.model_card import update_eval_section

    out = export_head(_head(target), tmp_path / "draft", target=target)
    section = {"num_prompts": 4, "acceptance_length_mean": 2.5, "chain_acceptance_length_mean": 1.75,
               "speedup": 1.4, "greedy_match_rate": 1.0}
    report = {"engine": "hf", "device": "cpu", "dtype": "float32", "date": "2026-12-04T00:00:00",
              "settings": {"max_new_tokens": 32, "temperature": 0.0}, "tree": {"policy": "dynamic", "depth": 5},
              "prompt_sets": {"dev-chat": section}, "overall": section}
    assert update_eval_section(out, report)
    card = (out / "README.md").read_text()
    assert "| dev-chat | 4 | 2.50 | 1.75 | 1.40x | 100% |" in card and "Not evaluated yet" not in card
    assert card.count("## Serving") == 1
    # a vLLM report with a batch-size sweep: the card says where the head pays and the schedule to serve it with
    from eagle.batch_schedule import fit_schedule, sweep_row

    rows = [sweep_row(b, int(100 * x), 1.0, 100, 1.0, [True]) for b, x in ((1, 1.5), (2, 1.2), (4, 0.8))]
    vllm = {**report, "engine": "vllm", "tree": {"policy": "chain", "depth": 3}, "batch_sweep": fit_schedule(rows, 3)}
    assert update_eval_section(out, vllm)
    card = (out / "README.md").read_text()
    assert "Speedup by concurrent requests (1: 1.50x" in card and "up to 2 requests at once" in card and '"num_speculative_tokens_per_batch_size": [[1, 2, 3], [3, 1024, 0]]' in card
    (out / "README.md").write_text("# someone else's card\n")
    assert not update_eval_section(out, report)  # not ours: left alone
