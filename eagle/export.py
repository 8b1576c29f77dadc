"""Export trained draft heads for SGLang / vLLM / speculators, and load exported heads back.

An exported draft directory holds ``model.safetensors`` + ``config.json`` (what the serving runtimes read)
and ``eagle_head.json`` (our exact :class:`~eagle.heads.HeadConfig`, with the target's name and
fingerprint, so that importing is exact). Three layouts:

``eagle3`` -- the EAGLE-3 layout SGLang (``LlamaForCausalLMEagle3``) and vLLM (``Eagle3LlamaForCausalLM``)
    load: our parameter names unchanged (``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``).
``speculators`` -- vLLM's ``speculators`` format (``Eagle3Speculator``): the same tensors with
    ``midlayer.`` renamed to ``layers.0.``, and a config with ``transformer_layer_config`` +
    ``speculators_config``.
``eagle1`` -- the EAGLE-1/2 layout of the EAGLE repository (``LlamaForCausalLM`` config): ``fc`` (+ bias)
    and the decoder layer as ``layers.0.*``; no norm, no lm_head (the target's lm_head is reused), and no
    ``layers.0.input_layernorm`` because EAGLE-1's first layer skips its input norm -- our eagle1 head has
    none either (``eagle.heads.DecoderLayer``), so the mapping is a plain rename.

The field-by-field mapping to each engine's loader (fc input width and bias, norm order, aux-layer numbering,
``d2t``, rope spellings) is in docs/ARCHITECTURE.md, "Export layouts". Where the engines number aux layers
differently, config.json carries each engine's key in its own numbering; ``eagle eval --engine both`` checks
that vLLM reads an export the way it was trained (:mod:`eagle.vllm_eval`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from eagle.devices import model_device
from eagle.errors import EagleError
from eagle.fileio import fsync_dir, write_json_atomic, write_text_atomic
from eagle.heads import HeadConfig, build_head
from eagle.model_card import CARD_FILE, render_card

LAYOUTS = ("eagle3", "eagle1", "speculators")
MODEL_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
HEAD_FILE = "eagle_head.json"
EXPORT_FILES = frozenset({MODEL_FILE, CONFIG_FILE, HEAD_FILE})  # and our model card (eagle.model_card)
HEAD_FILE_FORMAT = 1
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
EAGLE1_ARCHITECTURES = ("LlamaForCausalLM", "LlamaForCausalLMEagle", "EagleLlamaForCausalLM")
# keys some third-party checkpoints carry for modules we borrow from the target: ignored on import
BORROWED_KEYS = frozenset({"embed_tokens.weight"})

TensorSpec = tuple[tuple[int, ...], torch.dtype]


# ------------------------------------------------------------------------------------------- layouts


def _layer_prefix(layout: str) -> str:
    """Where the decoder layer lives in ``layout``."""
    return "midlayer." if layout == "eagle3" else "layers.0."


def to_layout_name(name: str, layout: str) -> str:
    """Our state_dict name -> the tensor name in ``layout``."""
    if name.startswith("midlayer."):
        return _layer_prefix(layout) + name[len("midlayer.") :]
    return name


def from_layout_name(name: str, layout: str) -> str:
    """A tensor name in ``layout`` -> our state_dict name (vLLM accepts both decoder prefixes for EAGLE-3,
    and so do we)."""
    if name.startswith("layers.0."):
        return "midlayer." + name[len("layers.0.") :]
    return name


def _kind_for(layout: str) -> str:
    return "eagle1" if layout == "eagle1" else "eagle3"


def _check_layout(layout: str, cfg: HeadConfig | None = None) -> None:
    if layout not in LAYOUTS:
        raise EagleError(f"unknown export layout {layout!r}: use one of {', '.join(LAYOUTS)}")
    if cfg is not None and cfg.kind != _kind_for(layout):
        fits = [x for x in LAYOUTS if _kind_for(x) == cfg.kind]
        raise EagleError(
            f"layout {layout!r} holds {_kind_for(layout)} heads but this head is {cfg.kind}: "
            f"use layout {' or '.join(fits)} (or train a {_kind_for(layout)} head)"
        )


def expected_layout(
    cfg: HeadConfig, layout: str, float_dtype: torch.dtype = torch.float32
) -> dict[str, TensorSpec]:
    """Every tensor of ``layout`` for a head shaped by ``cfg``: name -> (shape, dtype).

    Written from the layout definitions (docs/ARCHITECTURE.md), not from the head module, so that
    comparing a head's export against it checks the head too.
    """
    _check_layout(layout, cfg)
    h, inter = cfg.hidden_size, cfg.intermediate_size
    q_out = cfg.num_attention_heads * cfg.head_dim
    kv_out = cfg.num_key_value_heads * cfg.head_dim
    attn_in = 2 * h if cfg.kind == "eagle3" else h
    f = float_dtype
    layer = {
        "self_attn.q_proj.weight": ((q_out, attn_in), f),
        "self_attn.k_proj.weight": ((kv_out, attn_in), f),
        "self_attn.v_proj.weight": ((kv_out, attn_in), f),
        "self_attn.o_proj.weight": ((h, q_out), f),
        "mlp.gate_proj.weight": ((inter, h), f),
        "mlp.up_proj.weight": ((inter, h), f),
        "mlp.down_proj.weight": ((h, inter), f),
        "post_attention_layernorm.weight": ((h,), f),
    }
    if cfg.kind == "eagle3":
        layer["hidden_norm.weight"] = ((h,), f)
        layer["input_layernorm.weight"] = ((h,), f)
    prefix = _layer_prefix(layout)
    out = {prefix + k: v for k, v in layer.items()}
    if cfg.kind == "eagle3":
        out["fc.weight"] = ((h, len(cfg.aux_layers) * cfg.target_hidden_size), f)
        out["norm.weight"] = ((h,), f)
        out["lm_head.weight"] = ((cfg.draft_vocab_size, h), f)
        out["d2t"] = ((cfg.draft_vocab_size,), torch.int64)
        out["t2d"] = ((cfg.vocab_size,), torch.bool)
    else:
        out["fc.weight"] = ((h, 2 * h), f)
        if cfg.fc_bias:
            out["fc.bias"] = ((h,), f)
    return out


def validate_layout(tensors: dict[str, torch.Tensor], cfg: HeadConfig, layout: str, what: str = "") -> None:
    """Raise EagleError unless ``tensors`` has exactly the keys, shapes and dtypes of ``layout`` for ``cfg``.

    Floating tensors must all share one float dtype (the export dtype); ``d2t`` is int64, ``t2d`` bool.
    """
    floats = {t.dtype for t in tensors.values() if t.is_floating_point()}
    if len(floats) > 1:
        names = ", ".join(sorted(str(d).removeprefix("torch.") for d in floats))
        raise EagleError(f"{what or 'the head'} mixes float dtypes ({names}): export it again with one dtype")
    spec = expected_layout(cfg, layout, floats.pop() if floats else torch.float32)
    problems = _diff(tensors, spec)
    if problems:
        raise EagleError(
            f"{what or 'the head'} does not match the {layout} layout of a {cfg.kind} head "
            f"(hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, draft vocab {cfg.draft_vocab_size}): "
            f"{'; '.join(problems)}. Re-export it from the training checkpoint, or check its config"
        )


def _diff(tensors: dict[str, torch.Tensor], spec: dict[str, TensorSpec]) -> list[str]:
    """Human-readable differences between tensors and a layout spec (empty when they agree)."""
    problems = []
    missing = sorted(set(spec) - set(tensors))
    unexpected = sorted(set(tensors) - set(spec))
    if missing:
        problems.append(f"missing keys {missing}")
    if unexpected:
        problems.append(f"unexpected keys {unexpected}")
    for name in sorted(set(spec) & set(tensors)):
        shape, dtype = spec[name]
        t = tensors[name]
        if tuple(t.shape) != shape:
            problems.append(f"{name} has shape {list(t.shape)}, expected {list(shape)}")
        elif t.dtype != dtype:
            problems.append(f"{name} has dtype {t.dtype}, expected {dtype}")
    return problems


# ----------------------------------------------------------------------------------- target matching


def _target_facts(target: Any) -> dict[str, Any]:
    """name, fingerprint, hidden/vocab size, layer count and HF config of a ``Target`` or an HF model."""
    from eagle.targets import Target, fingerprint

    if isinstance(target, Target):
        return dict(
            name=target.name,
            fingerprint=target.fingerprint,
            hidden_size=target.hidden_size,
            vocab_size=target.vocab_size,
            num_layers=target.num_layers,
            config=target.config,
        )
    if isinstance(target, nn.Module) and hasattr(target, "config"):
        text = target.config.get_text_config()
        out_emb = target.get_output_embeddings()
        vocab = out_emb.weight.shape[0] if out_emb is not None else text.vocab_size
        return dict(
            name=getattr(target.config, "_name_or_path", "") or "in-memory model",
            fingerprint=fingerprint(target),
            hidden_size=int(text.hidden_size),
            vocab_size=int(vocab),
            num_layers=int(text.num_hidden_layers),
            config=target.config,
        )
    raise EagleError(
        f"expected a target (eagle.targets.Target or an HF causal LM), got {type(target).__name__}"
    )


def check_target_match(head_cfg: HeadConfig, target: Any) -> None:
    """Raise EagleError when the head was not trained for ``target`` (a ``Target`` or an HF model).

    Compares the target fingerprint (when the head records one), the hidden size, the vocabulary size and
    the captured layer ids against the target's layer count.
    """
    t = _target_facts(target)
    problems = []
    if head_cfg.target_fingerprint and head_cfg.target_fingerprint != t["fingerprint"]:
        problems.append("fingerprint")
    if head_cfg.target_hidden_size != t["hidden_size"]:
        problems.append(f"hidden size {head_cfg.target_hidden_size} vs {t['hidden_size']}")
    if head_cfg.vocab_size != t["vocab_size"]:
        problems.append(f"vocab size {head_cfg.vocab_size} vs {t['vocab_size']}")
    too_deep = [i for i in head_cfg.aux_layers if i > t["num_layers"]]
    if too_deep:
        problems.append(f"layers {too_deep} beyond the target's {t['num_layers']}")
    if problems:
        trained = head_cfg.target_name or "an unrecorded target"
        raise EagleError(
            f"this head was trained for target {trained} (fingerprint {head_cfg.target_fingerprint or '?'}, "
            f"vocab {head_cfg.vocab_size}, hidden {head_cfg.target_hidden_size}), but the target given is "
            f"{t['name']} (fingerprint {t['fingerprint']}, vocab {t['vocab_size']}, hidden {t['hidden_size']}); "
            f"mismatch: {', '.join(problems)}. Pass --target {head_cfg.target_name or '<its target>'} "
            f"or retrain the head for this target"
        )


# ------------------------------------------------------------------------------------- config files


def _rope_fields(cfg: HeadConfig) -> dict[str, Any]:
    """The head's (= the target's) rope settings in both the legacy and the transformers-5 spelling."""
    scaling = dict(cfg.rope_scaling) if cfg.rope_scaling else None
    params = {"rope_type": "default", **(scaling or {}), "rope_theta": float(cfg.rope_theta)}
    return {"rope_theta": float(cfg.rope_theta), "rope_scaling": scaling, "rope_parameters": params}


def _rope_from_json(d: dict[str, Any]) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) in HeadConfig's form from any of the config spellings."""
    params = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", d.get("rope_theta", 10000.0)))
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type == "default" and not params:
        return theta, None
    return theta, {"rope_type": rope_type, **params}


def _llama_fields(cfg: HeadConfig, dtype_name: str, target_config: Any) -> dict[str, Any]:
    """The llama config fields of a one-layer draft (vocab_size is the TARGET's vocabulary)."""
    out: dict[str, Any] = {
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        **_rope_fields(cfg),
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": dtype_name,  # transformers 4 / SGLang / vLLM
        "dtype": dtype_name,  # transformers 5
    }
    text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(text, key, None) if text is not None else None
        if value is not None:
            out[key] = value
    return out


def _sglang_layer_ids(cfg: HeadConfig) -> list[int]:
    """SGLang numbers an aux layer by the decoder layer whose OUTPUT it is: our id minus 1."""
    return [i - 1 for i in cfg.aux_layers]


def build_config(
    cfg: HeadConfig,
    layout: str,
    dtype_name: str,
    target_config: Any = None,
    speculative_tokens: int = 3,
    verifier_name: str | None = None,
) -> dict[str, Any]:
    """config.json of ``layout`` for a head shaped by ``cfg``."""
    _check_layout(layout, cfg)
    llama = _llama_fields(cfg, dtype_name, target_config)
    if layout == "eagle1":
        # the EAGLE repository reads "bias" (default true); vLLM's EAGLE-1 model ignores fc.bias
        return {"architectures": ["LlamaForCausalLM"], **llama, "bias": cfg.fc_bias}
    eagle3 = {
        "draft_vocab_size": cfg.draft_vocab_size,
        "norm_before_residual": False,  # residual = hidden before hidden_norm (vLLM speculators default: true)
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layers),  # vLLM: id k = HF hidden_states[k]
    }
    if cfg.target_hidden_size != cfg.hidden_size:
        eagle3["target_hidden_size"] = cfg.target_hidden_size
    if layout == "eagle3":
        eagle_config = {
            "use_aux_hidden_state": True,
            "eagle_aux_hidden_state_layer_ids": _sglang_layer_ids(cfg),
        }
        return {"architectures": ["LlamaForCausalLMEagle3"], **llama, **eagle3, "eagle_config": eagle_config}
    verifier_arch = list(getattr(target_config, "architectures", None) or []) if target_config else []
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": llama,
        **eagle3,
        "torch_dtype": dtype_name,
        "dtype": dtype_name,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": int(speculative_tokens),
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier_name or cfg.target_name, "architectures": verifier_arch},
        },
    }


# ------------------------------------------------------------------------------------------- export


def _parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        if dtype is not None and dtype not in DTYPES.values():
            raise EagleError(f"unsupported export dtype {dtype}: use one of {', '.join(DTYPES)}")
        return dtype
    if dtype not in DTYPES:
        raise EagleError(
            f"unknown export dtype {dtype!r}: use one of {', '.join(DTYPES)} (or none to keep it)"
        )
    return DTYPES[dtype]


def _state_and_config(head_or_state_and_cfg: Any) -> tuple[dict[str, torch.Tensor], HeadConfig]:
    """(state_dict, HeadConfig) from a head module or a ``(state_dict, HeadConfig | dict)`` pair."""
    if isinstance(head_or_state_and_cfg, nn.Module):
        cfg = getattr(head_or_state_and_cfg, "config", None)
        if not isinstance(cfg, HeadConfig):
            raise EagleError("export needs a draft head from eagle.heads.build_head (it has no HeadConfig)")
        state = head_or_state_and_cfg.state_dict()
    elif isinstance(head_or_state_and_cfg, tuple | list) and len(head_or_state_and_cfg) == 2:
        state, cfg = head_or_state_and_cfg
        if isinstance(cfg, dict):
            cfg = HeadConfig.from_dict(cfg)
        if not isinstance(cfg, HeadConfig) or not isinstance(state, dict):
            raise EagleError("export takes a head module or a (state_dict, HeadConfig) pair")
    else:
        raise EagleError(
            f"export takes a head module or a (state_dict, HeadConfig) pair, got {type(head_or_state_and_cfg).__name__}"
        )
    return {k: v.detach().to("cpu") for k, v in state.items()}, cfg.validate()


def _layout_tensors(
    state: dict[str, torch.Tensor], cfg: HeadConfig, layout: str, dtype: torch.dtype | None
) -> tuple[dict[str, torch.Tensor], torch.dtype]:
    """Rename to the layout, cast floating tensors to ``dtype``; returns the tensors and the float dtype."""
    floats = {t.dtype for t in state.values() if t.is_floating_point()}
    out_dtype = dtype or (floats.pop() if len(floats) == 1 else torch.float32)
    out = {}
    for name, t in state.items():
        if t.is_floating_point():
            t = t.to(out_dtype)
        out[to_layout_name(name, layout)] = t.contiguous().clone()  # own storage: safetensors refuses views
    return out, out_dtype


def _dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, d in DTYPES.items() if d == dtype)


def _replaceable(out: Path) -> bool:
    """An existing path we may replace: an empty folder or an earlier export (nothing but our files: the
    exported files and a model card we wrote)."""
    from eagle.model_card import CARD_FILE, is_our_card

    return out.is_dir() and all(
        p.name in EXPORT_FILES or (p.name == CARD_FILE and is_our_card(p)) for p in out.iterdir()
    )


def _write_atomically(out: Path, write: Callable[[Path], None]) -> None:
    """Call ``write(tmp_dir)`` in a fresh sibling folder, then swap it in for ``out``.

    A failure leaves ``out`` as it was (absent, or the previous export) and no temporary folder behind.
    """
    if out.exists() and not _replaceable(out):
        raise EagleError(
            f"{out} exists and is not an exported draft directory (it holds other files): choose another "
            f"output directory or remove it"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        write(tmp)
        if out.exists():
            old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(out, old)
            try:
                os.replace(tmp, out)
            except BaseException:
                os.replace(old, out)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except OSError as e:
        raise EagleError(
            f"could not write the export to {out}: {e}; free disk space or choose another folder"
        ) from e
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    fsync_dir(out.parent)


def export_head(
    head_or_state_and_cfg: Any,
    out_dir: str | os.PathLike,
    layout: str = "eagle3",
    dtype: str | torch.dtype | None = "bfloat16",
    target_config: Any = None,
    target: Any = None,
    speculative_tokens: int = 3,
    verifier_name: str | None = None,
    target_info: dict[str, Any] | None = None,
    training: dict[str, Any] | None = None,
) -> Path:
    """Write ``model.safetensors`` + ``config.json`` (+ our ``eagle_head.json``) of ``layout`` to ``out_dir``.

    ``head_or_state_and_cfg`` is a head (``eagle.heads.build_head``) or a ``(state_dict, HeadConfig)`` pair.
    ``dtype`` casts the floating tensors (None keeps the head's dtype; float32 if it mixes several). ``target_config`` (the target's HF config) adds
    its special token ids and architectures; ``target`` (a ``Target`` or HF model) is checked against the
    head's recorded target first, and supplies ``target_config`` when that is not given. The folder appears
    complete or not at all; an existing export there is replaced, any other existing folder is refused.
    ``speculative_tokens`` / ``verifier_name`` go into the speculators config (default: the head's target).
    ``target_info`` (:func:`eagle.targets.provenance`: the exact target the head was trained against) is recorded
    in config.json (``eagle_target``) and eagle_head.json (``target``), and with ``training`` (what the run
    recorded) it makes the model card, README.md. Returns the output path.
    """
    _check_layout(layout)
    torch_dtype = _parse_dtype(dtype)
    state, cfg = _state_and_config(head_or_state_and_cfg)
    _check_layout(layout, cfg)
    if target is not None:
        check_target_match(cfg, target)
        if target_config is None:
            target_config = _target_facts(target)["config"]
    tensors, out_dtype = _layout_tensors(state, cfg, layout, torch_dtype)
    # checked against the layout definition, not the module: a head that drifted from it is refused here
    validate_layout(tensors, cfg, layout, what=f"the {layout} export of this head")
    dtype_name = _dtype_name(out_dtype)
    config = build_config(cfg, layout, dtype_name, target_config, speculative_tokens, verifier_name)
    head_info = {"format": HEAD_FILE_FORMAT, "layout": layout, "dtype": dtype_name, "head": cfg.to_dict()}
    target_info = target_info or {"name": cfg.target_name, "fingerprint": cfg.target_fingerprint}
    config["eagle_target"] = head_info["target"] = target_info
    out = Path(out_dir)
    card = render_card(cfg.to_dict(), layout, dtype_name, target_info, str(out.resolve()), training)

    def write(folder: Path) -> None:
        save_file(tensors, str(folder / MODEL_FILE), metadata={"format": "pt"})
        write_json_atomic(config, folder / CONFIG_FILE)
        write_json_atomic(head_info, folder / HEAD_FILE)
        write_text_atomic(card, folder / CARD_FILE)

    _write_atomically(out, write)
    return out


# ------------------------------------------------------------------------------------------- import


def _read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise EagleError(f"could not read {path}: {e}; re-export the head") from e
    if not isinstance(data, dict):
        raise EagleError(f"{path} is not a JSON object; re-export the head")
    return data


def detect_layout(config: dict[str, Any]) -> str:
    """The layout of an exported config.json: speculators, eagle3 or eagle1."""
    if "speculators_model_type" in config:
        if config["speculators_model_type"] != "eagle3":
            raise EagleError(
                f"speculators model type {config['speculators_model_type']!r} is not supported: only eagle3"
            )
        return "speculators"
    archs = config.get("architectures") or []
    # some EAGLE-3 drafts keep the plain llama architecture; only EAGLE-3 configs name a draft vocabulary
    if any(a in EAGLE3_ARCHITECTURES for a in archs) or "draft_vocab_size" in config:
        return "eagle3"
    if any(a in EAGLE1_ARCHITECTURES for a in archs):
        return "eagle1"
    raise EagleError(
        f"config.json architectures {archs} is not an EAGLE draft: expected one of "
        f"{list(EAGLE3_ARCHITECTURES + EAGLE1_ARCHITECTURES)} or a speculators eagle3 config"
    )


def _config_from_runtime_json(
    config: dict[str, Any], layout: str, tensors: dict[str, torch.Tensor], target: Any
) -> HeadConfig:
    """A HeadConfig from a runtime config.json alone (a draft exported elsewhere, without eagle_head.json)."""
    tl = config.get("transformer_layer_config", {}) if layout == "speculators" else config
    theta, scaling = _rope_from_json(tl)
    try:
        hidden, heads = int(tl["hidden_size"]), int(tl["num_attention_heads"])
        fields: dict[str, Any] = dict(
            kind=_kind_for(layout),
            hidden_size=hidden,
            intermediate_size=int(tl["intermediate_size"]),
            num_attention_heads=heads,
            num_key_value_heads=int(tl.get("num_key_value_heads") or heads),
            head_dim=int(tl.get("head_dim") or hidden // heads),
            vocab_size=int(tl["vocab_size"]),
            rms_norm_eps=float(tl.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(tl.get("max_position_embeddings", 4096)),
            hidden_act=str(tl.get("hidden_act", "silu")),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise EagleError(f"config.json lacks a usable llama field ({e}); re-export the head") from e
    if layout == "eagle1":
        fields["fc_bias"] = "fc.bias" in tensors
    else:
        fields["draft_vocab_size"] = config.get("draft_vocab_size") or tl.get("draft_vocab_size")
        fields["target_hidden_size"] = config.get("target_hidden_size") or tl.get("target_hidden_size")
        fields["aux_layers"] = _aux_layers_from_json(config, target)
    if layout == "speculators":
        fields["target_name"] = str(
            ((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path") or ""
        )
    return HeadConfig(**fields).validate()


def _aux_layers_from_json(config: dict[str, Any], target: Any) -> list[int]:
    """Our layer ids from vLLM's top-level ids (same numbering), SGLang's eagle_config ids (+1), or the
    target's defaults."""
    if config.get("eagle_aux_hidden_state_layer_ids"):
        return [int(i) for i in config["eagle_aux_hidden_state_layer_ids"]]
    nested = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if nested:
        return [int(i) + 1 for i in nested]
    if target is None:
        raise EagleError(
            "the draft's config.json does not name its captured layers: pass the target so that its default "
            "layers [2, L//2, L-3] can be used"
        )
    n = _target_facts(target)["num_layers"]
    return [2, n // 2, n - 3]


def _load_tensors(path: Path) -> dict[str, torch.Tensor]:
    """safetensors only: a pickle checkpoint could run code when loaded."""
    if not path.is_file():
        found = sorted(p.name for p in path.parent.iterdir()) if path.parent.is_dir() else []
        hint = (
            " (pickle checkpoints such as .bin/.pt are not loaded: convert them to safetensors)"
            if any(n.endswith((".bin", ".pt", ".pth")) for n in found)
            else ""
        )
        raise EagleError(f"{path} not found; the folder holds {found}{hint}: export the head again")
    try:
        return load_file(str(path), device="cpu")
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise EagleError(
            f"could not read {path}: {e}; the file is truncated or corrupt: export the head again"
        ) from e


def load_exported_head(
    directory: str | os.PathLike, target_model: Any = None, dtype: str | torch.dtype | None = None
) -> nn.Module:
    """Rebuild a head from an exported draft directory (any of the three layouts), in eval mode.

    The layout is detected from config.json; the HeadConfig comes from ``eagle_head.json`` when present
    (exact), else from config.json. Tensors are read with safetensors only and must match the layout key
    for key (EagleError lists missing / unexpected / mis-shaped ones). ``dtype`` None keeps the stored
    dtype. With ``target_model`` (a ``Target`` or HF model) the head is checked against it, attached to it
    and moved to its device.
    """
    folder = Path(directory)
    if not (folder / CONFIG_FILE).is_file():
        raise EagleError(
            f"{folder} is not an exported draft directory (no {CONFIG_FILE}): pass the export folder"
        )
    config = _read_json(folder / CONFIG_FILE)
    layout = detect_layout(config)
    raw = _load_tensors(folder / MODEL_FILE)
    tensors = {k: v for k, v in raw.items() if k not in BORROWED_KEYS}
    if (folder / HEAD_FILE).is_file():
        info = _read_json(folder / HEAD_FILE)
        if not isinstance(info.get("head"), dict):
            raise EagleError(f"{folder / HEAD_FILE} has no 'head' section; re-export the head")
        cfg = HeadConfig.from_dict(info["head"])
        _check_layout(layout, cfg)
    else:
        cfg = _config_from_runtime_json(config, layout, tensors, target_model)
    _check_config_agrees(config, layout, cfg, folder)
    if layout != "eagle1" and cfg.draft_vocab_size == cfg.vocab_size:
        # runtimes accept a full-vocabulary EAGLE-3 draft without the identity d2t / t2d: fill them in
        defaults = build_head(cfg).state_dict()
        for key in ("d2t", "t2d"):
            tensors.setdefault(key, defaults[key])
    validate_layout(tensors, cfg, layout, what=str(folder / MODEL_FILE))
    if target_model is not None:
        check_target_match(cfg, target_model)
    floats = {t.dtype for t in tensors.values() if t.is_floating_point()}
    head_dtype = _parse_dtype(dtype) or (floats.pop() if floats else torch.float32)
    head = build_head(cfg).to(head_dtype)
    head.load_state_dict({from_layout_name(k, layout): v for k, v in tensors.items()}, strict=True)
    head.eval()
    if target_model is not None:
        from eagle.targets import Target

        # an HF CausalLM also has a ``.model`` (its backbone): only a Target is unwrapped
        model = target_model.model if isinstance(target_model, Target) else target_model
        head.attach_target(model)
        head.to(model_device(model))
    return head


def _check_config_agrees(config: dict[str, Any], layout: str, cfg: HeadConfig, folder: Path) -> None:
    """config.json and eagle_head.json must describe the same head (one may have been edited by hand)."""
    tl = config.get("transformer_layer_config", {}) if layout == "speculators" else config
    pairs = [
        ("hidden_size", tl.get("hidden_size"), cfg.hidden_size),
        ("vocab_size", tl.get("vocab_size"), cfg.vocab_size),
    ]
    if layout != "eagle1" and config.get("draft_vocab_size") is not None:
        pairs.append(("draft_vocab_size", config.get("draft_vocab_size"), cfg.draft_vocab_size))
    bad = [f"{k} {a} vs {b}" for k, a, b in pairs if a is not None and int(a) != int(b)]
    if bad:
        raise EagleError(
            f"{folder / CONFIG_FILE} disagrees with {folder / HEAD_FILE} ({', '.join(bad)}): export the head again"
        )


__all__ = [
    "LAYOUTS",
    "build_config",
    "check_target_match",
    "detect_layout",
    "expected_layout",
    "export_head",
    "load_exported_head",
    "validate_layout",
]
