"""Data preparation (``eagle prepare``): chat sources -> token ids + assistant loss masks, saved as HF datasets.

Pipeline: load every source (``train/sources.py``), shuffle them together with the seed, cap at
``max_conversations``, optionally **regenerate** the assistant turns with the target itself, render each
conversation with the target's chat template, mask everything but the assistant turns, apply ``max_length``,
split train/val, and write ``<output_dir>/{train,val}`` (``save_to_disk``; columns ``input_ids``, ``loss_mask``),
``split_ids.json`` and ``prepare_meta.json`` atomically.

The loss mask and the rendering are :mod:`train.chat_template`'s; regeneration (``regenerate: true``, the target
writes the answers) is :mod:`train.regenerate`'s. Its answers are kept in ``<output_dir>/regen-<key>.jsonl``:
re-preparing with another ``val_fraction`` or ``on_overlong`` reuses them.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import logging
import os
import random
import shutil
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from eagle.deadline import Deadline, check_minutes
from eagle.devices import model_device, model_dtype
from eagle.errors import EagleError
from eagle.fileio import write_json_atomic
from eagle.records import Message
from eagle.targets import resolve_target
from eagle.vllm_engine import VllmConfig
from train.chat_template import check_template, drop_thinking, special_token_ids, tokenize_conversation
from train.collect import CollectConfig
from train.launch import process_state
from train.regen_features import CaptureSpec, capture_dir
from train.regenerate import regenerate
from train.sources import Conversation, load_source, parse_source_spec, source_stamp

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
ON_OVERLONG = ("truncate", "skip", "error")
THINKING = ("keep", "drop")
ON_CUT_ANSWER = ("keep", "drop", "error")
# apply_chat_template's own arguments: data.chat_template_kwargs must not set them
_TEMPLATE_ARGS = ("conversation", "tools", "documents", "chat_template", "add_generation_prompt",
                  "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
                  "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs")
REGEN_DTYPES = ("float32", "bfloat16", "float16")
REGEN_ENGINES = ("hf", "vllm")


@dataclass
class DataConfig:
    """The ``data:`` section of a run config."""

    sources: list[str] = field(default_factory=lambda: ["chitchat"])  # files (ShareGPT/OpenAI JSON or JSONL), hf:<dataset>[:split], chitchat[:N], stdlib-code[:N]
    max_conversations: int | None = None  # total cap, after shuffling all sources together
    max_length: int = 1024  # tokens per conversation
    val_fraction: float = 0.05  # share of the conversations held out for validation
    seed: int = 0  # shuffling, the split and regeneration batches
    output_dir: str = "runs/demo/data"  # where the prepared datasets go
    regenerate: bool = False  # replace assistant turns by the target's own answers
    regen_max_new_tokens: int = 256  # longest regenerated answer (tokens)
    regen_temperature: float = 0.0  # 0 = greedy
    regen_top_p: float = 1.0  # nucleus sampling for regeneration (with regen_temperature > 0)
    regen_batch_size: int = 16  # conversations answered together
    regen_max_turns: int = 1  # keep (and regenerate) only the first K assistant turns; 0 = all
    # the dtype the target answers in (null = as loaded). "bfloat16" on a CPU with bf16 units (prepacked) answers
    # ~2x faster than fp32 with answers of the same kind; the features and labels still come
    # from the target as loaded for collect/train
    regen_dtype: str | None = None
    # stop regenerating once prepare has run this long and keep the conversations answered so far (batches run
    # in a seeded random order, so the kept ones are a random subset); null = no limit. The demo sets it from
    # its time budget. Not part of the output's identity: a cut output is reused by runs with a limit.
    regen_max_minutes: float | None = None
    on_overlong: str = "truncate"  # truncate: keep the first max_length tokens | skip: drop | error: raise
    # keep the target's hidden states while it regenerates (the collect section's aux layers and dtype), so that
    # `eagle collect` copies them instead of running the target over the data again (train/regen_features.py);
    # costs the features' disk space twice until the regeneration folder is deleted
    capture_features: bool = False
    # who writes the answers: hf (our batched loop, which can keep the features) or vllm (its continuous
    # batching; eagle collect then computes the features); data.vllm: tensor / data parallel sizes on GPUs
    regen_engine: str = "hf"
    vllm: VllmConfig = field(default_factory=VllmConfig)
    # assistant thinking (reasoning_content, or <think>...</think> opening the content): keep trains it where the
    # target's chat template renders it (a reasoning target emits it when served) | drop removes it before rendering
    thinking: str = "keep"
    # keyword arguments for the target's chat template wherever data is rendered (prepare and regeneration), such
    # as {enable_thinking: false} for Qwen3 without thinking
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # a regenerated answer that reached regen_max_new_tokens without ending (cut; counted in the summary's
    # cut_answers): keep trains it, without the end-of-turn token the target never wrote | drop leaves it and the
    # rest of its conversation out | error stops prepare
    on_cut_answer: str = "keep"

    def validate(self) -> DataConfig:
        """Raise EagleError naming the bad field; return self when all is well."""

        def bad(name: str, rule: str) -> EagleError:
            return EagleError(f"data.{name} must be {rule} (got {getattr(self, name)!r})")

        if (
            not isinstance(self.sources, list)
            or not self.sources
            or not all(isinstance(s, str) and s.strip() for s in self.sources)
        ):
            raise bad("sources", "a non-empty list of source specs such as ['chitchat', 'stdlib-code:500']")
        if self.max_conversations is not None and (
            not isinstance(self.max_conversations, int) or self.max_conversations < 1
        ):
            raise bad("max_conversations", "a positive integer or null (no cap)")
        if not isinstance(self.max_length, int) or self.max_length < 8:
            raise bad("max_length", "an integer >= 8")
        if not isinstance(self.val_fraction, int | float) or not 0.0 <= self.val_fraction < 1.0:
            raise bad("val_fraction", "a number in [0, 1)")
        if not isinstance(self.seed, int):
            raise bad("seed", "an integer")
        if not isinstance(self.output_dir, str) or not self.output_dir.strip():
            raise bad("output_dir", "a non-empty path")
        if not isinstance(self.regenerate, bool):
            raise bad("regenerate", "true or false")
        if not isinstance(self.capture_features, bool):
            raise bad("capture_features", "true or false")
        if not isinstance(self.regen_max_new_tokens, int) or self.regen_max_new_tokens < 1:
            raise bad("regen_max_new_tokens", "a positive integer")
        if not isinstance(self.regen_temperature, int | float) or self.regen_temperature < 0:
            raise bad("regen_temperature", "a number >= 0 (0 = greedy)")
        if not isinstance(self.regen_top_p, int | float) or not 0.0 < self.regen_top_p <= 1.0:
            raise bad("regen_top_p", "a number in (0, 1]")
        if not isinstance(self.regen_batch_size, int) or self.regen_batch_size < 1:
            raise bad("regen_batch_size", "a positive integer")
        if not isinstance(self.regen_max_turns, int) or self.regen_max_turns < 0:
            raise bad("regen_max_turns", "an integer >= 0 (0 = regenerate every assistant turn)")
        if self.regen_dtype is not None and self.regen_dtype not in REGEN_DTYPES:
            raise bad("regen_dtype", f"null (the target's own dtype) or one of {list(REGEN_DTYPES)}")
        check_minutes(self.regen_max_minutes, "data.regen_max_minutes")
        if self.regen_engine not in REGEN_ENGINES:
            raise bad("regen_engine", f"one of {list(REGEN_ENGINES)}")
        self.vllm.validate("data.vllm")
        if self.on_overlong not in ON_OVERLONG:
            raise bad("on_overlong", f"one of {list(ON_OVERLONG)}")
        if self.thinking not in THINKING:
            raise bad("thinking", f"one of {list(THINKING)}")
        if self.on_cut_answer not in ON_CUT_ANSWER:
            raise bad("on_cut_answer", f"one of {list(ON_CUT_ANSWER)}")
        kwargs = self.chat_template_kwargs
        if not isinstance(kwargs, dict) or not all(isinstance(k, str) and k.isidentifier() for k in kwargs):
            raise bad("chat_template_kwargs", "a mapping of the chat template's variable names to values, such as "
                      "{enable_thinking: true}")
        if set(kwargs) & set(_TEMPLATE_ARGS):
            raise bad("chat_template_kwargs", f"free of apply_chat_template's own arguments {sorted(_TEMPLATE_ARGS)}")
        return self


def _sha(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _tokenizer_identity(tokenizer: Any) -> dict[str, Any]:
    return {
        "name": str(getattr(tokenizer, "name_or_path", "")),
        "vocab": len(tokenizer),
        "chat_template_sha256": hashlib.sha256((tokenizer.chat_template or "").encode()).hexdigest()[:16],
    }


def _model_fingerprint(model: torch.nn.Module | None) -> str | None:
    if model is None:
        return None
    from eagle.targets import fingerprint

    return fingerprint(model)


def _target_name(target: Any) -> str:
    return str(getattr(target, "name", target))


def _load_models(cfg: DataConfig, target: Any, tokenizer: Any, model: Any) -> tuple[Any, Any]:
    """Tokenizer (always) and model (only for regeneration), loaded through eagle.targets when not given."""
    from eagle import targets

    if cfg.regenerate and model is None:
        if isinstance(target, targets.TargetConfig):
            local_rank = os.environ.get("LOCAL_RANK")
            if local_rank is not None and target.device.startswith("cuda"):
                target = dataclasses.replace(target, device=f"cuda:{local_rank}")  # one GPU per process
            loaded = targets.load_target(target)
        else:
            cuda = torch.cuda.is_available()
            loaded = targets.load_target(
                target, dtype="bfloat16" if cuda else "float32", device="cuda" if cuda else "cpu"
            )
        model = loaded.model
        tokenizer = tokenizer if tokenizer is not None else loaded.tokenizer
    if tokenizer is None:
        name = target.name if isinstance(target, targets.TargetConfig) else target
        trust = bool(getattr(target, "trust_remote_code", False))
        tokenizer = targets.load_tokenizer(name, trust_remote_code=trust)
    return tokenizer, model


# settings that say where or how long to work, not what to produce
_NOT_IDENTITY = ("output_dir", "regen_max_minutes", "vllm")


def _config_hash(cfg: DataConfig, target: str, tokenizer: Any, model_fp: str | None) -> str:
    settings = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in _NOT_IDENTITY}
    stamps = [source_stamp(s) for s in cfg.sources]  # an edited data file must not count as up to date
    return _sha([FORMAT_VERSION, settings, stamps, target, _tokenizer_identity(tokenizer), model_fp])


def _regen_key(cfg: DataConfig, target: str, tokenizer: Any, model_fp: str | None) -> str:
    """What the regenerated answers depend on (not the split or the overlong policy)."""
    # the prompts' rendering counts (template arguments, earlier turns' thinking); "cut-marks": answers files
    # written before cut answers were marked are not reused, as their cut answers would pass as finished
    keys = ("sources", "max_conversations", "seed", "max_length", "chat_template_kwargs", "thinking")
    settings: dict[str, Any] = {k: getattr(cfg, k) for k in keys}
    settings["answers"] = "cut-marks"
    settings.update(
        {k: v for k, v in dataclasses.asdict(cfg).items() if k.startswith("regen_") and k not in _NOT_IDENTITY}
    )
    stamps = [source_stamp(s) for s in cfg.sources]
    return _sha([FORMAT_VERSION, settings, stamps, target, _tokenizer_identity(tokenizer), model_fp])


def _capture_plan(
    cfg: DataConfig,
    collect: CollectConfig | None,
    model: Any,
    model_fp: str | None,
    out: Path,
    regen_key: str,
) -> tuple[Path, CaptureSpec] | None:
    """Where and what ``cfg.capture_features`` keeps, or None when it is off or cannot match collection:
    regeneration must run the target in the dtype collection will (``data.regen_dtype`` and
    ``collect.target_dtype``, each defaulting to the target's own)."""
    if not cfg.capture_features:
        return None
    from eagle.features import check_aux_layers, default_aux_layers

    collect = collect if collect is not None else CollectConfig()
    own = str(model_dtype(model)).removeprefix("torch.")
    regen_dtype, collect_dtype = cfg.regen_dtype or own, collect.target_dtype or own
    if regen_dtype != collect_dtype:
        log.warning(
            "data.capture_features: not capturing, the target answers in %s (data.regen_dtype) but collects its "
            "features in %s (collect.target_dtype); `eagle collect` computes them. Set both alike to capture",
            regen_dtype, collect_dtype,
        )
        return None
    num_layers = int(model.config.get_text_config().num_hidden_layers)
    layers = default_aux_layers(num_layers) if collect.aux_layers is None else list(collect.aux_layers)
    spec = CaptureSpec.of(str(model_fp), getattr(torch, regen_dtype), check_aux_layers(layers, num_layers),
                          collect.dtype)
    return capture_dir(out, regen_key, spec), spec


def _select(cfg: DataConfig) -> tuple[list[Conversation], dict[str, dict[str, int]]]:
    """All sources, shuffled together with the seed and capped at ``max_conversations``."""
    pool: list[Conversation] = []
    stats: dict[str, dict[str, int]] = {}
    for spec in cfg.sources:
        conversations = load_source(spec, regenerate=cfg.regenerate)
        stats[spec] = {"loaded": len(conversations)}
        pool.extend(conversations)
    ids = Counter(c.id for c in pool)
    if len(ids) < len(pool):
        dup = next(i for i, n in ids.items() if n > 1)
        raise EagleError(f"conversation {dup!r} comes from more than one source; list each source only once")
    random.Random(cfg.seed).shuffle(pool)
    if cfg.max_conversations is not None:
        pool = pool[: cfg.max_conversations]
    for spec in cfg.sources:
        stats[spec]["selected"] = sum(c.source == spec for c in pool)
    return pool, stats


def _with_cut_policy(conv: Conversation, cfg: DataConfig, counts: Counter) -> list[Message]:
    """The conversation under ``data.on_cut_answer``: as it is (its cut answers marked, trained without an end of
    turn), up to its first cut answer, or an error. ``counts["cut_answers"]`` counts the cut answers met."""
    cut = [i for i, m in enumerate(conv.messages) if m.get("cut")]
    if not cut:
        return conv.messages
    counts["cut_answers"] += len(cut)
    if cfg.on_cut_answer == "error":
        turn = sum(m["role"] == "assistant" for m in conv.messages[: cut[0]]) + 1
        raise EagleError(
            f"conversation {conv.id}: the target's answer to assistant turn {turn} reached data.regen_max_new_tokens"
            f"={cfg.regen_max_new_tokens} without ending (cut); raise data.regen_max_new_tokens (a reasoning target "
            "needs room to think), or set data.on_cut_answer to drop (leave such answers out) or keep (train them "
            "as cut)"
        )
    return conv.messages if cfg.on_cut_answer == "keep" else conv.messages[: cut[0]]


def _encode_all(
    conversations: list[Conversation], tokenizer: Any, cfg: DataConfig
) -> tuple[list[tuple[Conversation, list[int], list[int]]], Counter]:
    """Render + mask + apply max_length; returns kept rows and counts of dropped/truncated conversations."""
    from tqdm.auto import tqdm

    specials = special_token_ids(tokenizer)
    rows = []
    counts: Counter = Counter()
    for conv in tqdm(conversations, unit="conv", desc="tokenizing", mininterval=2.0, disable=None):
        messages = _with_cut_policy(conv, cfg, counts)
        if not any(m["role"] == "assistant" for m in messages):
            counts["cut_answer" if len(messages) < len(conv.messages) else "no_assistant_turn"] += 1
            continue
        messages = drop_thinking(messages) if cfg.thinking == "drop" else messages
        ids, mask = tokenize_conversation(tokenizer, messages, specials, where=conv.id,
                                          template_kwargs=cfg.chat_template_kwargs)
        if not any(mask):
            counts["no_assistant_token"] += 1  # e.g. only empty answers without an end-of-turn token
            continue
        if len(ids) > cfg.max_length:
            if cfg.on_overlong == "error":
                raise EagleError(
                    f"conversation {conv.id} from {conv.source!r} has {len(ids)} tokens > data.max_length="
                    f"{cfg.max_length}; raise max_length, or set data.on_overlong to truncate or skip"
                )
            if cfg.on_overlong == "skip":
                counts["overlong_skipped"] += 1
                continue
            ids, mask = ids[: cfg.max_length], mask[: cfg.max_length]
            if not any(mask):  # the first answer starts beyond max_length: nothing left to learn from
                counts["overlong_no_assistant_in_window"] += 1
                continue
            counts["truncated"] += 1
        rows.append((conv, ids, mask))
    return rows, counts


def _save_atomic(
    out: Path, splits: dict[str, list[tuple[Conversation, list[int], list[int]]]], meta: dict
) -> None:
    """Write both splits, the id lists and the meta file; meta is removed first and written last (the marker)."""
    import datasets

    features = datasets.Features(
        {
            "input_ids": datasets.List(datasets.Value("int32")),
            "loss_mask": datasets.List(datasets.Value("uint8")),
        }
    )
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".tmp-prepare-{uuid.uuid4().hex[:8]}"
    try:
        for name, rows in splits.items():
            ds = datasets.Dataset.from_dict(
                {"input_ids": [r[1] for r in rows], "loss_mask": [r[2] for r in rows]}, features=features
            )
            ds.save_to_disk(str(tmp / name))
        ids = {name: [r[0].id for r in rows] for name, rows in splits.items()}
        write_json_atomic(ids, tmp / "split_ids.json")
        write_json_atomic(meta, tmp / "prepare_meta.json")
        (out / "prepare_meta.json").unlink(missing_ok=True)  # the old marker must not vouch for mixed output
        for name in (*splits, "split_ids.json"):
            dest = out / name
            if dest.is_dir():
                trash = out / f".old-{name}-{uuid.uuid4().hex[:8]}"
                dest.rename(trash)
                shutil.rmtree(trash, ignore_errors=True)
            os.replace(tmp / name, dest)
        os.replace(tmp / "prepare_meta.json", out / "prepare_meta.json")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _split(rows: list, val_fraction: float) -> tuple[list, list]:
    """Val = the first share of the (already shuffled) rows; at least one of each when there are two or more."""
    n = len(rows)
    n_val = int(round(n * val_fraction))
    if val_fraction > 0 and n >= 2:
        n_val = min(max(n_val, 1), n - 1)
    return rows[n_val:], rows[:n_val]


def _up_to_date(out: Path, config_hash: str, limited: bool) -> dict[str, Any] | None:
    """The earlier summary when ``out`` holds data prepared with the same settings (and not cut by a time limit
    that is now lifted), else None."""
    meta_path = out / "prepare_meta.json"
    if not (meta_path.is_file() and (out / "train").is_dir() and (out / "val").is_dir()):
        return None
    try:
        old = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    if old.get("config_hash") != config_hash:
        return None
    if (old.get("dropped") or {}).get("regen_time_limit") and not limited:
        log.info("prepare: %s was cut by a time limit; answering the rest (no limit now)", out)
        return None
    return old


def _regenerate_all(cfg: DataConfig, target_name: Any, conversations: list[Conversation], tokenizer: Any,
                    model: torch.nn.Module, loads_model: bool, ids: dict[str, Any], deadline: Deadline,
                    state: Any) -> tuple[list[Conversation], dict[str, Any] | None]:
    """The conversations with the target's answers (:mod:`train.regenerate`), and what features were captured.

    ``ids``: the target's name, its fingerprint and the answers' key (``name``, ``fp``, ``key``)."""
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    partial = out / f"regen-{ids['key']}.jsonl"
    if cfg.regen_engine == "vllm":
        if cfg.capture_features:
            log.warning("data.capture_features: vLLM keeps no hidden states; `eagle collect` computes them")
        engine_target = (resolve_target(ids["name"]), str(model_dtype(model)).removeprefix("torch."))
        return regenerate(conversations, tokenizer, None, cfg, partial, deadline, engine_target=engine_target), None
    capture = _capture_plan(cfg, ids["collect"], model, ids["fp"],
                            out, ids["key"])
    if cfg.regen_dtype is not None and model_dtype(model) != getattr(torch, cfg.regen_dtype):
        if not loads_model:
            model = copy.deepcopy(model)  # the caller's model stays as it was
        model = model.to(getattr(torch, cfg.regen_dtype))
        loads_model = True
    if loads_model and getattr(target_name, "cpu_prepack", True):
        from eagle.targets import prepack_for_cpu

        # our own copy, fingerprinted already: regeneration ~1.5x faster on a CPU (fp32), ~2x more in bf16
        prepack_for_cpu(model, dtypes=(torch.float32, torch.bfloat16))
    answered = regenerate(conversations, tokenizer, model, cfg, partial, deadline, capture, state=state)
    captured = {"dir": capture[0].name, "spec": dataclasses.asdict(capture[1])} if capture is not None else None
    return answered, captured


def _check_kept(cfg: DataConfig, stats: dict[str, dict[str, int]], rows: list, dropped: Counter) -> None:
    """Every source must leave something to train on, and so must the whole."""
    for spec in cfg.sources:
        stats[spec]["kept"] = sum(r[0].source == spec for r in rows)
        if stats[spec]["selected"] and not stats[spec]["kept"]:
            raise EagleError(
                f"data source {spec!r} has no assistant turns to train on after filtering ({dict(dropped)} of "
                f"{stats[spec]['selected']} conversations); give data with answers, set data.regenerate=true, "
                "or raise data.max_length"
            )
    if not rows:
        raise EagleError(
            f"no conversation with assistant turns is left ({dict(dropped)}); check data.sources "
            "or set data.regenerate=true"
        )


def _meta(cfg: DataConfig, ids: dict[str, Any], tokenizer: Any, stats: dict, splits: dict, dropped: Counter,
          captured: dict | None, started: float) -> dict[str, Any]:
    """``prepare_meta.json``: what was prepared, from what, and what was left out."""
    truncated = dropped.pop("truncated", 0)
    cut = dropped.pop("cut_answers", 0)
    settings = dataclasses.asdict(cfg)
    return {
        "format": FORMAT_VERSION,
        "config_hash": ids["hash"],
        "target": ids["name"],
        "target_fingerprint": ids["fp"],
        "tokenizer": _tokenizer_identity(tokenizer),
        "config": settings,
        "sources": stats,
        "max_length": cfg.max_length,
        "on_overlong": cfg.on_overlong,
        "regenerate": cfg.regenerate,
        "regen": {k: v for k, v in settings.items() if k.startswith("regen_")} if cfg.regenerate else None,
        "captured_features": captured,
        "counts": {k: len(v) for k, v in splits.items()},
        "dropped": dict(dropped),
        "truncated": truncated,
        # answers that reached regen_max_new_tokens unfinished, and what became of them (data.on_cut_answer)
        "cut_answers": {"count": cut, "policy": cfg.on_cut_answer},
        "tokens": {k: sum(len(r[1]) for r in v) for k, v in splits.items()},
        "assistant_tokens": {k: sum(sum(r[2]) for r in v) for k, v in splits.items()},
        "seconds": round(time.time() - started, 1),
    }


def prepare(
    cfg: DataConfig,
    target_name: Any,
    *,
    tokenizer: Any = None,
    model: torch.nn.Module | None = None,
    collect: CollectConfig | None = None,
) -> dict[str, Any]:
    """Prepare training data for a target; returns the summary (also written to ``prepare_meta.json``).

    ``target_name`` is a target name (or a ``TargetConfig``); ``tokenizer`` / ``model`` may be given to skip
    loading (the model is only used with ``cfg.regenerate``). An output with the same settings is kept as is
    (the summary then has ``skipped: true``). ``collect`` names the features that ``cfg.capture_features``
    keeps (its aux layers and storage dtype; default: the collect defaults).
    """
    cfg.validate()
    for spec in cfg.sources:  # fail on a bad source before any model is loaded
        if parse_source_spec(spec).needs_regeneration and not cfg.regenerate:
            load_source(spec, regenerate=False)  # raises the explanatory error
    started = time.time()
    deadline = Deadline(cfg.regen_max_minutes)  # counts model loading too: the limit is for prepare as a whole
    loads_model = model is None
    tokenizer, model = _load_models(cfg, target_name, tokenizer, model)
    check_template(tokenizer)
    ids: dict[str, Any] = {"name": _target_name(target_name), "collect": collect}
    ids["fp"] = _model_fingerprint(model) if cfg.regenerate else None
    ids["hash"] = _config_hash(cfg, ids["name"], tokenizer, ids["fp"])
    old = _up_to_date(Path(cfg.output_dir), ids["hash"], cfg.regen_max_minutes is not None)
    if old is not None:
        log.info("prepare: %s is up to date (same settings); skipping", cfg.output_dir)
        return {**old, "skipped": True}

    conversations, stats = _select(cfg)
    selected, captured = len(conversations), None
    state = process_state(model_device(model) if model is not None else torch.device("cpu"))
    if cfg.regenerate:
        ids["key"] = _regen_key(cfg, ids["name"], tokenizer, ids["fp"])
        conversations, captured = _regenerate_all(cfg, target_name, conversations, tokenizer, model, loads_model,
                                                  ids, deadline, state)
    if state.is_main_process:  # every process holds the same conversations now; one writes them
        rows, dropped = _encode_all(conversations, tokenizer, cfg)
        if selected > len(conversations):
            dropped["regen_time_limit"] = selected - len(conversations)
        _check_kept(cfg, stats, rows, dropped)
        train, val = _split(rows, cfg.val_fraction)
        splits = {"train": train, "val": val}
        meta = _meta(cfg, ids, tokenizer, stats, splits, dropped, captured, started)
        _save_atomic(Path(cfg.output_dir), splits, meta)
        log.info("prepare: wrote %s (%s)", cfg.output_dir, meta["counts"])
    state.wait_for_everyone()
    if not state.is_main_process:
        meta = json.loads((Path(cfg.output_dir) / "prepare_meta.json").read_text(encoding="utf-8"))
    return {**meta, "skipped": False}
