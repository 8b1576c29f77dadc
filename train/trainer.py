"""The training loop (``eagle train``): a draft head on a frozen target, offline (feature shards) or online.

One entry point for every launcher: ``python -m train.trainer --config run.yaml key=value ...`` (or ``eagle
train``) runs as one process, under ``torchrun`` / ``accelerate launch`` (DDP, gloo on CPU), under
``accelerate launch --use_deepspeed`` or the ``deepspeed`` launcher with ``train.deepspeed=<json>`` (ZeRO-2/3).

Every process loads the frozen target (its embeddings and lm_head feed the loss; online mode also runs it inside
the step). Batches are planned globally (:mod:`train.batching`), so N processes with ``batch_size`` b train on
exactly the data of one process with N*b. Checkpoints (:mod:`train.checkpoint`) are atomic and restore the data
position, optimizer, scheduler and RNG states, so a resumed run continues the interrupted loss curve.

Gradient averaging: each micro-batch's loss is a mean over its own counted tokens, and micro-batches (across
grad_accum and processes) are weighted equally -- as in most trainers.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import random
import shutil
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from eagle.deadline import Deadline, check_minutes
from eagle.errors import EagleError

REPORTERS = ("none", "tensorboard", "wandb")
MIN_LENGTH = 3  # tokens a sequence needs to give one training label


@dataclass
class HeadSpec:
    """The ``head:`` section: what kind of head to train (its shapes come from the target)."""

    kind: Literal["eagle3", "eagle1"] = "eagle3"
    draft_vocab_size: int = 8192  # eagle3 only: most frequent loss-masked training tokens
    aux_layers: list[int] | None = None  # eagle3: None = the features' layers (offline) or the target default
    init_from: str | None = None  # a head folder (model.safetensors + head_config.json) to start from
    # eagle1 only: EAGLE-1/2 (the EAGLE repository, SGLang) give fc a bias; vLLM's EAGLE-1 model has none and
    # drops it silently, so train without one for vLLM
    fc_bias: bool = True

    def validate(self) -> HeadSpec:
        """Raise EagleError on values that cannot work; returns self."""
        if self.kind not in ("eagle3", "eagle1"):
            raise EagleError(f"head.kind must be eagle3 or eagle1, got {self.kind!r}")
        if self.draft_vocab_size < 1:
            raise EagleError(f"head.draft_vocab_size must be >= 1, got {self.draft_vocab_size}")
        if self.aux_layers is not None and (
            not self.aux_layers or len(set(self.aux_layers)) != len(self.aux_layers)
        ):
            raise EagleError(
                f"head.aux_layers must list distinct hidden-state ids, got {self.aux_layers}: "
                "or leave it unset for the default"
            )
        return self


@dataclass
class TrainConfig:
    """The ``train:`` section."""

    mode: Literal["offline", "online"] = "offline"
    output_dir: str = "{run_dir}/train"  # checkpoints/, final/, metrics.jsonl, curves, tb/, wandb/
    epochs: int = 1
    max_steps: int | None = None  # optimizer steps; caps ``epochs`` when set
    # wall-time limit for this invocation: the schedule (cosine included) is shortened to end in time; null = none
    max_minutes: float | None = None
    batch_size: int = 8  # sequences per process per micro-step
    # when set: batches of about this many padded tokens per process (replaces batch_size)
    batch_tokens: int | None = None
    max_length: int | None = None  # truncate longer sequences
    grad_accum: int = 1
    lr: float = 3e-4
    weight_decay: float = 0.0
    warmup_steps: int | None = None
    warmup_ratio: float = 0.02
    min_lr_ratio: float = 0.1
    max_grad_norm: float = 1.0
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    ttt_steps: int = 3
    step_decay: float = 0.8
    noise_std: float = 0.0
    ce_weight: float = 0.1  # eagle1
    reg_weight: float = 1.0  # eagle1
    bf16: bool | Literal["auto"] = "auto"  # mixed precision; auto: on GPUs with bf16 and CPUs with bf16 units
    eval_every: int = 200  # 0: only at the end
    eval_max_sequences: int | None = None
    save_every: int = 500
    keep_last: int | None = 3
    resume: str = "auto"  # auto | never | <checkpoint dir>
    seed: int = 0
    deterministic: bool = False
    report_to: list[str] = field(default_factory=lambda: ["none"])
    wandb_project: str = "eagle-heads"
    run_name: str | None = None
    log_every: int = 10
    num_workers: int = 0
    on_nonfinite: Literal["skip", "stop"] = "skip"
    deepspeed: str | None = None  # DeepSpeed JSON (e.g. configs/deepspeed/zero2.json)
    progress: bool = True

    def validate(self) -> TrainConfig:
        """Raise EagleError on values that cannot work; returns self."""
        positive = ("epochs", "batch_size", "grad_accum", "log_every", "save_every", "ttt_steps")
        for name in positive:
            if getattr(self, name) < 1:
                raise EagleError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_steps", "batch_tokens", "max_length", "eval_max_sequences"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise EagleError(f"train.{name} must be >= 1 or unset, got {value}")
        check_minutes(self.max_minutes, "train.max_minutes")
        if self.mode not in ("offline", "online"):
            raise EagleError(
                f"train.mode must be offline (from collected features) or online, got {self.mode!r}"
            )
        if self.lr <= 0:
            raise EagleError(f"train.lr must be positive, got {self.lr}")
        if self.weight_decay < 0 or self.max_grad_norm < 0 or self.noise_std < 0:
            raise EagleError("train.weight_decay, train.max_grad_norm and train.noise_std must be >= 0")
        if not 0 <= self.warmup_ratio < 1:
            raise EagleError(f"train.warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        if self.warmup_steps is not None and self.warmup_steps < 0:
            raise EagleError(f"train.warmup_steps must be >= 0 or unset, got {self.warmup_steps}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise EagleError(f"train.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not 0 < self.step_decay <= 1:
            raise EagleError(f"train.step_decay must be in (0, 1], got {self.step_decay}")
        if len(self.adam_betas) != 2 or not all(0 <= b < 1 for b in self.adam_betas):
            raise EagleError(f"train.adam_betas must be two numbers in [0, 1), got {self.adam_betas}")
        if self.eval_every < 0:
            raise EagleError(f"train.eval_every must be >= 0 (0: only at the end), got {self.eval_every}")
        if self.keep_last is not None and self.keep_last < 1:
            raise EagleError(f"train.keep_last must be >= 1 or unset (keep all), got {self.keep_last}")
        if self.num_workers < 0:
            raise EagleError(f"train.num_workers must be >= 0, got {self.num_workers}")
        if not isinstance(self.resume, str) or not self.resume.strip():
            raise EagleError("train.resume must be auto, never or a checkpoint directory")
        bad = [r for r in self.report_to if r not in REPORTERS]
        if bad or not self.report_to:
            raise EagleError(f"train.report_to must list some of {list(REPORTERS)}, got {self.report_to}")
        if self.bf16 not in (True, False, "auto"):
            raise EagleError(f"train.bf16 must be auto, true or false, got {self.bf16!r}")
        if self.on_nonfinite not in ("skip", "stop"):
            raise EagleError(f"train.on_nonfinite must be skip or stop, got {self.on_nonfinite!r}")
        if self.deepspeed is not None and not Path(self.deepspeed).is_file():
            raise EagleError(
                f"train.deepspeed {self.deepspeed!r} does not exist: point it at a DeepSpeed JSON such as "
                "configs/deepspeed/zero2.json, or unset it"
            )
        return self


@dataclass
class TrainResult:
    """What :func:`train` returns (on every process)."""

    output_dir: Path
    final_dir: Path
    global_step: int
    last_checkpoint: Path | None
    eval_metrics: dict[str, float] = field(default_factory=dict)
    resumed_from: Path | None = None


class HeadWithLoss(nn.Module):
    """The head plus its loss as one module, so DDP / DeepSpeed see a normal ``forward(batch) -> loss``.

    The target's lm_head is held outside the module tree (it is frozen and never wrapped or saved).
    """

    def __init__(self, head: nn.Module, target_lm_head: nn.Module, kind: str, cfg: TrainConfig):
        super().__init__()
        self.head = head
        self.config = head.config  # accelerate reads model.config.hidden_size for DeepSpeed "auto" buckets
        self.kind = kind
        self._lm_head = (target_lm_head,)  # a tuple is not registered as a submodule
        self.cfg = cfg

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        from train.losses import eagle1_loss, eagle3_ttt_loss

        cfg = self.cfg
        if self.kind == "eagle3":
            # training: accuracy against the draft-restricted target argmax (no full lm_head); eval: exact
            return eagle3_ttt_loss(
                self.head,
                batch,
                self._lm_head[0],
                cfg.ttt_steps,
                cfg.step_decay,
                cfg.noise_std,
                exact_top1=not self.training,
            )
        return eagle1_loss(self.head, batch, self._lm_head[0], cfg.reg_weight, cfg.ce_weight, cfg.noise_std)

    def zero_loss(self) -> torch.Tensor:
        """A zero loss that still reaches every parameter (skipping a bad batch without desyncing DDP)."""
        return sum((p * 0).sum() for p in self.parameters())


# ------------------------------------------------------------------------------------------------- setup


def _mixed_precision(cfg: TrainConfig) -> str:
    """``train.bf16``: auto = bf16 autocast on a GPU with bf16, and on a CPU with bf16 instructions (AVX512-BF16 /
    AMX), where it trains the SmolLM2 demo head ~1.7x faster with the same accuracy (TUNING.md run 35)."""
    if cfg.bf16 == "auto":
        if torch.cuda.is_available():
            return "bf16" if torch.cuda.is_bf16_supported() else "no"
        from eagle.targets import cpu_has_fast_bf16

        return "bf16" if cpu_has_fast_bf16() else "no"
    return "bf16" if cfg.bf16 else "no"


def _make_accelerator(cfg: TrainConfig):
    """An Accelerator for this launch: plain / DDP (gloo on CPU) / DeepSpeed (from train.deepspeed or from
    ``accelerate launch --use_deepspeed``)."""
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs

    cuda = torch.cuda.is_available()
    kwargs: dict[str, Any] = dict(
        gradient_accumulation_steps=cfg.grad_accum,
        mixed_precision=_mixed_precision(cfg),
    )
    use_ds = cfg.deepspeed is not None or os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true"
    if use_ds:
        # accelerate only turns DeepSpeed on from this flag (the deepspeed launcher does not set it)
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        if cfg.deepspeed is not None:
            try:
                ds_config = json.loads(Path(cfg.deepspeed).read_text(encoding="utf-8"))
            except ValueError as exc:
                raise EagleError(
                    f"train.deepspeed {cfg.deepspeed} is not valid JSON ({exc}): fix the file"
                ) from exc
            kwargs["deepspeed_plugin"] = DeepSpeedPlugin(hf_ds_config=ds_config)
        if not cuda:  # DeepSpeed on CPU processes: accelerate must be told to use gloo
            kwargs["kwargs_handlers"] = [InitProcessGroupKwargs(backend="gloo")]
    else:
        kwargs["cpu"] = not cuda
    accelerator = Accelerator(**kwargs)
    from eagle.targets import avoid_cudnn_attention

    avoid_cudnn_attention(accelerator.device)  # batches of varying length would each set up a cuDNN plan
    if accelerator.distributed_type.name == "DEEPSPEED":
        _fill_deepspeed_config(accelerator.state.deepspeed_plugin.deepspeed_config, cfg)
    return accelerator


def _fill_deepspeed_config(ds: dict, cfg: TrainConfig) -> None:
    """Fill the DeepSpeed config's ``auto`` values from train.* (and refuse contradicting fixed values)."""
    fixed = ds.get("gradient_accumulation_steps", "auto")
    if fixed != "auto" and int(fixed) != cfg.grad_accum:
        raise EagleError(
            f"the DeepSpeed config sets gradient_accumulation_steps={fixed} but train.grad_accum={cfg.grad_accum}: "
            'set it to "auto" in the JSON (train.grad_accum then decides)'
        )
    ds["gradient_accumulation_steps"] = cfg.grad_accum
    if ds.get("train_micro_batch_size_per_gpu", "auto") == "auto":
        # token-budget batches vary in size; DeepSpeed only uses this number for bookkeeping
        ds["train_micro_batch_size_per_gpu"] = cfg.batch_size if cfg.batch_tokens is None else 1
    if ds.get("gradient_clipping", "auto") == "auto":
        ds["gradient_clipping"] = cfg.max_grad_norm
    ds.setdefault("zero_allow_untested_optimizer", True)


def _seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def _load_target(target: Any, accelerator) -> Any:
    """A ``Target``: as given, or loaded from a TargetConfig / name onto this process's device."""
    from eagle.targets import Target, TargetConfig, load_target

    if isinstance(target, Target):
        return target
    if target is None:
        raise EagleError("no target given: set target.name in the run config")
    tcfg = target if isinstance(target, TargetConfig) else TargetConfig(name=str(target))
    if accelerator.device.type == "cuda":
        # one full copy per process, on its own GPU (DDP / ZeRO shard only the head)
        tcfg = dataclasses.replace(tcfg, device=f"cuda:{accelerator.device.index or 0}")
    with _without_zero3_init(accelerator):
        return load_target(tcfg)


@contextlib.contextmanager
def _without_zero3_init(accelerator):
    """Under ZeRO-3 accelerate makes transformers build models partitioned (zero.Init); the frozen target must
    stay whole on every process, so that is switched off while it loads."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    from transformers.integrations import is_deepspeed_zero3_enabled, unset_hf_deepspeed_config

    if plugin is None or not is_deepspeed_zero3_enabled():
        yield
        return
    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        plugin.set_deepspeed_weakref()


def _resolve_resume(cfg: TrainConfig, root: Path) -> Path | None:
    """The checkpoint to resume from (None: a fresh start)."""
    from train import checkpoint as ck

    if cfg.resume == "never":
        return None
    if cfg.resume == "auto":
        return ck.find_latest(root)
    path = Path(cfg.resume)
    if path.is_dir() and ck.is_complete(path):
        return path
    for candidate in (path, path / "checkpoints"):
        found = ck.find_latest(candidate) if candidate.is_dir() else None
        if found is not None:
            return found
    raise EagleError(
        f"train.resume={cfg.resume!r} is neither a complete checkpoint nor a folder holding one: pass a "
        "checkpoints/step-* folder, or use train.resume=auto / never"
    )


def _open_data(cfg: TrainConfig, data_dir, features_dir, fingerprint: str):
    """(train source, val source or None) for the mode."""
    from train.batching import PreparedSequences, ShardSequences

    if cfg.mode == "offline":
        if not features_dir:
            raise EagleError(
                "train.mode=offline needs collected features: set collect.output_dir (or train online)"
            )
        train_src = ShardSequences(features_dir, "train", fingerprint, cfg.max_length)
        has_val = "val" in train_src.shards.manifest.get("splits", {})
        val_src = ShardSequences(features_dir, "val", fingerprint, cfg.max_length) if has_val else None
        return train_src, val_src
    if not data_dir:
        raise EagleError("train.mode=online needs prepared data: set data.output_dir (run `eagle prepare`)")
    train_src = PreparedSequences(data_dir, "train", cfg.max_length)
    val_src = None
    if (Path(data_dir) / "val").is_dir():
        try:
            val_src = PreparedSequences(data_dir, "val", cfg.max_length)
        except EagleError as exc:
            # e.g. an empty split (datasets cannot reload one): train without evaluation
            warnings.warn(f"no usable validation split, training without evaluation: {exc}", stacklevel=3)
    return train_src, val_src


def _aux_layers(spec: HeadSpec, train_src, target) -> list[int]:
    from eagle.targets import check_aux_layers, default_aux_layers

    stored = getattr(train_src, "aux_layers", None)
    if stored is not None:  # offline: the features decide
        if spec.aux_layers is not None and list(spec.aux_layers) != list(stored):
            raise EagleError(
                f"head.aux_layers {spec.aux_layers} differ from the collected features' layers {stored}: "
                "unset head.aux_layers, or collect features for those layers"
            )
        return list(stored)
    if spec.aux_layers is not None:
        return check_aux_layers(list(spec.aux_layers), target.num_layers)
    return default_aux_layers(target.num_layers)


def _count_training_tokens(train_src, vocab_size: int) -> torch.Tensor:
    from train.vocab import count_tokens

    return count_tokens(train_src.token_pairs(), vocab_size)


def _draft_vocab(
    spec: HeadSpec, hcfg, train_src, out: Path, resume_path: Path | None, accelerator, init_state: dict | None
) -> tuple[tuple[torch.Tensor, torch.Tensor], str | None]:
    """The eagle3 draft vocabulary: loaded from the checkpoint on resume (never rebuilt), taken from
    ``init_from`` when that head has one, else built from the training data's loss-masked token counts (on the
    main process) and saved as ``<output_dir>/draft_vocab.safetensors``. Returns (d2t, t2d), data fingerprint."""
    from train import checkpoint as ck
    from train.batching import counts_fingerprint
    from train.vocab import build_draft_vocab, check_vocab, load_vocab, save_vocab

    main = accelerator.is_main_process
    vocab_file = out / ck.VOCAB_FILE
    if resume_path is not None:
        d2t, t2d = load_vocab(resume_path / ck.VOCAB_FILE)
        saved_fp = ck.read_state(resume_path).get("vocab_data_fingerprint")
        if main and saved_fp is not None:
            now = counts_fingerprint(_count_training_tokens(train_src, hcfg.vocab_size))
            if now != saved_fp:
                warnings.warn(
                    "the training data changed since the draft vocabulary was built; keeping the checkpoint's "
                    "vocabulary (start a fresh run with train.resume=never to rebuild it)",
                    stacklevel=3,
                )
        return (d2t, t2d), saved_fp
    if init_state is not None and "d2t" in init_state and "t2d" in init_state:
        d2t, t2d = init_state["d2t"].long(), init_state["t2d"].bool()
        check_vocab(d2t, t2d)
        return (d2t, t2d), None
    # every process counts (cheap next to training, and no process waits on another's failure); main saves
    counts = _count_training_tokens(train_src, hcfg.vocab_size)
    if int(counts.sum()) == 0:
        raise EagleError(
            "the training data has no loss-masked tokens, so there is nothing to learn: check the loss masks "
            "of the prepared data (assistant turns) and rerun `eagle prepare`"
        )
    d2t, t2d = build_draft_vocab(counts, hcfg.draft_vocab_size, hcfg.vocab_size)
    fingerprint = counts_fingerprint(counts)
    if main:
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / f".{ck.VOCAB_FILE}.tmp"
        save_vocab(tmp, d2t, t2d)
        os.replace(tmp, vocab_file)
        info = {
            "data_fingerprint": fingerprint,
            "loss_tokens": int(counts.sum()),
            "draft_vocab_size": hcfg.draft_vocab_size,
            "coverage": float(counts[t2d].sum() / counts.sum()),
        }
        ck.write_json_atomic(info, out / "draft_vocab.json")
    return (d2t, t2d), fingerprint


def _check_checkpoint_head(saved: dict, hcfg, path: Path) -> None:
    """A checkpoint must belong to this target and have this head's shapes."""
    if saved.get("target_fingerprint") != hcfg.target_fingerprint:
        raise EagleError(
            f"checkpoint {path} was trained for target {saved.get('target_name')!r} (fingerprint "
            f"{saved.get('target_fingerprint')}), not for {hcfg.target_name!r} ({hcfg.target_fingerprint}): "
            "use another train.output_dir, or start fresh with train.resume=never"
        )
    current = hcfg.to_dict()
    for key in ("kind", "hidden_size", "draft_vocab_size", "vocab_size", "aux_layers", "intermediate_size"):
        if saved.get(key) != current.get(key):
            raise EagleError(
                f"checkpoint {path} has head.{key}={saved.get(key)!r} but this run has {current.get(key)!r}: "
                "resume with the same head settings, use another train.output_dir, or train.resume=never"
            )


def _lr_lambda(total: int, warmup: int, min_ratio: float):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def _optimizer(head: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    decay = [p for p in head.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in head.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(
        [g for g in groups if g["params"]], lr=cfg.lr, betas=tuple(cfg.adam_betas), eps=1e-8
    )


# -------------------------------------------------------------------------------------------- the loop


class _Window:
    """Per-process sums of the step metrics since the last log (kept as tensors: no host sync per step)."""

    def __init__(self):
        self.sums: dict[str, torch.Tensor] = {}
        self.n = 0

    def add(self, metrics: dict[str, torch.Tensor]) -> None:
        if not metrics:  # a skipped batch
            return
        for key, value in metrics.items():
            if key.startswith("count"):
                continue
            value = value.detach().float().reshape(())
            self.sums[key] = self.sums[key] + value if key in self.sums else value.clone()
        self.n += 1

    def reduce(self, accelerator) -> dict[str, float]:
        if not self.n:
            return {}
        keys = sorted(self.sums)
        stacked = torch.stack([self.sums[k] for k in keys]) / self.n
        stacked = accelerator.reduce(stacked.to(accelerator.device), reduction="mean")
        self.sums, self.n = {}, 0
        return dict(zip(keys, stacked.tolist()))


def _to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def _add_features(batch: dict[str, torch.Tensor], target, aux_layers: list[int]) -> None:
    """Online mode: run the frozen target on the batch and add its features."""
    from eagle.targets import capture_features

    with torch.no_grad():
        ids = batch["input_ids"].to(target.device)
        aux, last = capture_features(target.model, ids, batch["attention_mask"].to(target.device), aux_layers)
    device = batch["input_ids"].device
    batch["aux_hidden"], batch["last_hidden"] = aux.to(device), last.to(device)


def _prepare_batch(batch, accelerator, online: bool, target, aux_layers) -> dict[str, torch.Tensor]:
    batch = _to_device(batch, accelerator.device)
    if online:
        _add_features(batch, target, aux_layers)
    return batch


def evaluate(
    model,
    source,
    plan: list[list[int]],
    accelerator,
    cfg: TrainConfig,
    kind: str,
    online: bool,
    target,
    aux_layers,
    top1_cache: dict[int, torch.Tensor] | None = None,
) -> dict[str, float]:
    """Validation loss and top-1 accuracy (per TTT step for eagle3), token-weighted over all processes.

    Every process runs the same number of forwards (a process without data in the last global batch runs a
    dummy with weight 0), which DDP's buffer broadcast and ZeRO-3's parameter gathering need.

    ``top1_cache`` (eagle3): the target's full-vocabulary argmax of every validation batch, by batch index, kept
    by the caller from one evaluation to the next. The labels never change while the head trains, and that argmax
    (a 49k-row fp32 lm_head over every position, for SmolLM2) was ~3/4 of an evaluation's time; the plan
    yields the same batches in the same order every time, so an index names a batch."""
    from train.batching import batch_loader, rank_slice
    from train.losses import target_argmax

    rank, world = accelerator.process_index, accelerator.num_processes
    mine, weights = [], []
    for gb in plan:
        part = rank_slice(gb, rank, world)
        mine.append(part or gb[:1])
        weights.append(1.0 if part else 0.0)
    steps = cfg.ttt_steps if kind == "eagle3" else 1
    # per step j: [loss*count, acc*count, count]; eagle1 adds reg*count, ce*count
    sums = torch.zeros(steps, 5, dtype=torch.float64, device=accelerator.device)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for i, (batch, weight) in enumerate(zip(batch_loader(source, mine, cfg.num_workers), weights)):
            batch = _prepare_batch(batch, accelerator, online, target, aux_layers)
            if top1_cache is not None and kind == "eagle3":
                if i not in top1_cache:
                    lm_head = target.model.get_output_embeddings()
                    top1_cache[i] = target_argmax(lm_head, batch["last_hidden"])
                batch["target_top"] = top1_cache[i]
            _, m = model(batch)
            for j in range(steps):
                if kind == "eagle3":
                    count = m[f"count_{j}"].double() * weight
                    parts = [m[f"loss_{j}"], m[f"acc_{j}"], 1.0, 0.0, 0.0]
                else:
                    count = m["count"].double() * weight
                    parts = [m["loss"], m["acc"], 1.0, m["loss_reg"], m["loss_ce"]]
                sums[j] += torch.stack(
                    [torch.as_tensor(p, device=count.device).double() * count for p in parts]
                )
    model.train(was_training)
    sums = accelerator.reduce(sums, reduction="sum").cpu()
    out: dict[str, float] = {}
    if kind == "eagle3":
        total = 0.0
        for j in range(steps):
            count = max(float(sums[j, 2]), 1.0)
            out[f"val_loss_{j}"] = float(sums[j, 0]) / count
            out[f"val_acc_{j}"] = float(sums[j, 1]) / count
            total += cfg.step_decay**j * out[f"val_loss_{j}"]
        out["val_loss"], out["val_acc"] = total, out["val_acc_0"]
    else:
        count = max(float(sums[0, 2]), 1.0)
        out["val_loss"] = float(sums[0, 0]) / count
        out["val_acc"] = float(sums[0, 1]) / count
        out["val_loss_reg"], out["val_loss_ce"] = float(sums[0, 3]) / count, float(sums[0, 4]) / count
    out["val_tokens"] = int(sums[0, 2])
    return out


def _is_finite_everywhere(value: torch.Tensor, accelerator) -> bool:
    bad = (~torch.isfinite(value.detach().float())).any().float().reshape(1).to(accelerator.device)
    return float(accelerator.reduce(bad, reduction="sum").item()) == 0.0


def _nonfinite_error(what: str, step: int) -> EagleError:
    return EagleError(
        f"{what} is not finite at step {step}: lower train.lr, keep train.max_grad_norm > 0, check the data "
        "(or set train.on_nonfinite=skip to skip such batches)"
    )


def train(
    run: Any = None,
    *,
    target: Any = None,
    data_dir: str | os.PathLike | None = None,
    features_dir: str | os.PathLike | None = None,
    head: HeadSpec | None = None,
    cfg: TrainConfig | None = None,
    on_checkpoint: Callable[[Path, int], None] | None = None,
) -> TrainResult:
    """Train a draft head; returns where it went. Call it on every process of a launch.

    ``run`` is a ``train.config.RunConfig`` (target, data.output_dir, collect.output_dir, head, train);
    the keyword arguments replace its parts (``target`` may also be a loaded ``eagle.targets.Target``).
    ``on_checkpoint(path, step)`` is called on the main process after each checkpoint is in place.
    """
    if run is not None:
        target = target if target is not None else run.target
        data_dir = data_dir if data_dir is not None else run.data.output_dir
        features_dir = features_dir if features_dir is not None else run.collect.output_dir
        head = head if head is not None else run.head
        cfg = cfg if cfg is not None else run.train
    cfg = (cfg or TrainConfig()).validate()
    spec = (head or HeadSpec()).validate()
    if "{run_dir}" in cfg.output_dir:
        raise EagleError(
            f"train.output_dir {cfg.output_dir!r} still holds {{run_dir}}: give a real directory"
        )
    previous_det = torch.are_deterministic_algorithms_enabled()
    if cfg.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
    try:
        return _train(cfg, spec, target, data_dir, features_dir, on_checkpoint)
    finally:
        torch.use_deterministic_algorithms(previous_det)


def _train(cfg: TrainConfig, spec: HeadSpec, target, data_dir, features_dir, on_checkpoint) -> TrainResult:
    run = _Run(cfg, spec, target, data_dir, features_dir, on_checkpoint)
    try:
        run.fit()
        return run.finish()
    except BaseException:
        run.logger.close(plot=False)
        raise


class _Run:
    """One training run on this process: set up in ``__init__``, then :meth:`fit` and :meth:`finish`."""

    def __init__(self, cfg: TrainConfig, spec: HeadSpec, target, data_dir, features_dir, on_checkpoint):
        from eagle.heads import HeadConfig, build_head
        from train import checkpoint as ck
        from train.batching import plan_epoch, plan_eval
        from train.logging import MetricsLogger

        self.cfg, self.on_checkpoint = cfg, on_checkpoint
        self.deadline = Deadline(cfg.max_minutes)  # loading counts too
        self.accelerator = acc = _make_accelerator(cfg)
        self.rank, self.world, self.main = acc.process_index, acc.num_processes, acc.is_main_process
        self.deepspeed = acc.distributed_type.name == "DEEPSPEED"
        self.out = Path(cfg.output_dir)
        self.ckpt_root = self.out / "checkpoints"
        self.target = target = _load_target(target, acc)

        self.resume_path = resume_path = _resolve_resume(cfg, self.ckpt_root)
        if self.main:
            self.out.mkdir(parents=True, exist_ok=True)
            ck.clean_stale(self.ckpt_root)
            if cfg.resume == "never" and self.ckpt_root.is_dir():
                for old in ck.list_checkpoints(self.ckpt_root):
                    ck.remove_tree(old)
                (self.ckpt_root / ck.LATEST).unlink(missing_ok=True)
        acc.wait_for_everyone()

        # ---- data and head
        self.train_src, self.val_src = _open_data(cfg, data_dir, features_dir, target.fingerprint)
        # a sequence needs 3 tokens for one label (the head at i predicts x_{i+2}); shorter ones are skipped
        self.lengths = lengths = [n if n >= MIN_LENGTH else 0 for n in self.train_src.lengths()]
        if not any(lengths):
            raise EagleError(
                f"the training data is empty (no sequences with at least {MIN_LENGTH} tokens): run `eagle "
                "prepare` (and `eagle collect` for offline training) on a non-empty data set"
            )
        self.aux_layers = _aux_layers(spec, self.train_src, target)
        if spec.kind == "eagle3" and spec.draft_vocab_size > target.vocab_size:
            raise EagleError(
                f"head.draft_vocab_size={spec.draft_vocab_size} is larger than the target's vocabulary "
                f"({target.vocab_size}): lower head.draft_vocab_size"
            )
        self.hcfg = hcfg = HeadConfig.from_target(
            target.config,
            spec.kind,
            draft_vocab_size=spec.draft_vocab_size if spec.kind == "eagle3" else None,
            aux_layers=self.aux_layers if spec.kind == "eagle3" else None,
            target_name=target.name,
            target_fingerprint=target.fingerprint,
        )
        if spec.kind == "eagle1":
            hcfg = self.hcfg = dataclasses.replace(hcfg, fc_bias=spec.fc_bias)
        resume_weights = init_state = None
        if resume_path is not None:
            resume_weights, saved_cfg = ck.load_head_files(resume_path)
            _check_checkpoint_head(saved_cfg, hcfg, resume_path)
        elif spec.init_from:
            init_state, init_cfg = ck.load_head_files(spec.init_from)
            if init_cfg.get("kind") != hcfg.kind:
                raise EagleError(
                    f"head.init_from {spec.init_from} is a {init_cfg.get('kind')} head, not {hcfg.kind}: "
                    "point it at a head of the same kind"
                )

        _seed_all(cfg.seed)  # the same initial weights on every process
        head = build_head(hcfg).attach_target(target.model)
        self.vocab, self.vocab_fp = None, None
        if hcfg.kind == "eagle3":
            self.vocab, self.vocab_fp = _draft_vocab(
                spec, hcfg, self.train_src, self.out, resume_path, acc, init_state
            )
            head.set_draft_vocab(*self.vocab)
        for weights, where in ((init_state, spec.init_from), (resume_weights, resume_path)):
            if weights is not None:
                try:
                    head.load_state_dict(weights, strict=True)
                except RuntimeError as exc:
                    raise EagleError(
                        f"the head weights in {where} do not fit this head ({str(exc).splitlines()[0]}): use a "
                        "head trained for this target and head settings"
                    ) from exc
        _seed_all(cfg.seed + 1 + 1_000_003 * self.rank)  # per-process noise streams

        # ---- schedule
        self.sizes = (
            {"batch_size": cfg.batch_size} if cfg.batch_tokens is None else {"batch_tokens": cfg.batch_tokens}
        )
        first_plan = plan_epoch(lengths, world=self.world, seed=cfg.seed, epoch=0, **self.sizes)
        self.steps_per_epoch = len(first_plan) // cfg.grad_accum
        if self.steps_per_epoch == 0:
            size = cfg.batch_size if cfg.batch_tokens is None else f"{cfg.batch_tokens} tokens"
            raise EagleError(
                f"the training data ({len(lengths)} sequences) is too small for one optimizer step: a step needs "
                f"{cfg.grad_accum} global batch(es) of {size} x {self.world} process(es); lower "
                "train.batch_size / train.grad_accum or add data"
            )
        total = self.steps_per_epoch * cfg.epochs
        self.total_steps = min(total, cfg.max_steps) if cfg.max_steps is not None else total
        self.planned_steps = self.total_steps  # the schedule asked for, before train.max_minutes shortens it
        self.warmup = self._warmup_steps()

        model = HeadWithLoss(head, target.model.get_output_embeddings(), hcfg.kind, cfg)
        model.train()
        optimizer = _optimizer(head, cfg)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, _lr_lambda(self.total_steps, self.warmup, cfg.min_lr_ratio)
        )
        self.num_parameters = sum(p.numel() for p in head.parameters())  # before ZeRO-3 partitions them
        self.model, self.optimizer = acc.prepare(model, optimizer)
        self.engine = self.model if self.deepspeed else None
        self.unwrapped = acc.unwrap_model(self.model)

        self.state = {"epoch": 0, "micro_batch": 0, "global_step": 0, "tokens_seen": 0, "last_eval_step": -1}
        self.time_cut = False  # the schedule was shortened to fit train.max_minutes
        if resume_path is not None:
            self._restore(resume_path)
        self.start_step = self.state["global_step"]
        self.last_ckpt = resume_path
        self.last_save_step = self.start_step if resume_path is not None else -1
        self.eval_metrics: dict[str, float] = {}
        self.logger = MetricsLogger(
            self.out,
            cfg.report_to,
            enabled=self.main,
            resume_step=self.start_step if resume_path is not None else None,
            config={"train": dataclasses.asdict(cfg), "head": hcfg.to_dict()},
            project=cfg.wandb_project,
            run_name=cfg.run_name,
        )
        self.eval_plan = None
        self.val_top1: dict[int, torch.Tensor] = {}  # the target's exact top-1 per validation batch (evaluate)
        if self.val_src is not None:
            val_lengths = [
                n if n >= MIN_LENGTH else 0 for n in self.val_src.lengths()[: cfg.eval_max_sequences]
            ]
            self.eval_plan = plan_eval(val_lengths, world=self.world, **self.sizes) or None

    def _restore(self, path: Path) -> None:
        from train import checkpoint as ck

        saved = ck.load_checkpoint(
            path,
            accelerator=self.accelerator,
            engine=self.engine,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
        )
        for key in self.state:
            self.state[key] = saved.get(key, self.state[key])
        if saved.get("time_cut") and saved.get("total_steps", self.total_steps) < self.total_steps:
            self._set_total_steps(int(saved["total_steps"]))  # continue the shortened schedule
        now = {"world_size": self.world, **dataclasses.asdict(self.cfg)}
        changed = [
            k
            for k in ("world_size", "grad_accum", "batch_size", "batch_tokens", "seed")
            if saved.get(k) != now[k]
        ]
        if changed and self.main:
            warnings.warn(
                f"resuming {path} with different {', '.join(changed)}: the data order of the current epoch "
                "differs from the interrupted run's",
                stacklevel=4,
            )

    # ---- schedule length

    def _warmup_steps(self) -> int:
        cfg = self.cfg
        return cfg.warmup_steps if cfg.warmup_steps is not None else int(cfg.warmup_ratio * self.total_steps)

    def _set_total_steps(self, total: int) -> None:
        """Run ``total`` optimizer steps (at most the planned ones): warm-up and cosine decay are rescaled to it."""
        self.total_steps, self.time_cut = total, total < self.planned_steps
        self.warmup = self._warmup_steps()
        factor = _lr_lambda(total, self.warmup, self.cfg.min_lr_ratio)
        self.scheduler.lr_lambdas = [factor] * len(self.scheduler.lr_lambdas)
        if getattr(self, "bar", None) is not None:
            self.bar.total = total
            self.bar.refresh()

    def _fit_to_deadline(self, step: int) -> None:
        """Fit the schedule to ``train.max_minutes``: shorten it when the steps left would run past the limit, and
        lengthen a shortened one again (up to the planned steps) when the pace turns out faster.

        The pace is measured over the later half of the steps run so far, since the first ones are slower (bf16
        kernels are compiled per matrix shape): measured from the start, a demo on this project's CPU shortened
        its schedule at step 110 to 1,059 of 1,160 steps and then finished 2 of its 13.5 minutes early
        (TUNING.md run 63). It includes the periodic evaluations and checkpoints; a little time is kept for the
        final ones. A longer schedule is taken only when it is 2% longer (no jitter). Every process takes the
        smallest step count any of them computed.
        """
        done = step - self.start_step
        if not self.deadline.limited or done <= 0:
            return
        now = self.deadline.elapsed()
        self.pace.append((step, now))
        since_step, since = max((p for p in self.pace if p[0] <= self.start_step + done / 2), key=lambda p: p[0])
        per_step = (now - since) / max(step - since_step, 1)
        reserve = min(30.0, 0.03 * self.deadline.minutes * 60)
        fits = step + max(0, int((self.deadline.remaining() - reserve) / per_step))
        total = min(self.planned_steps, max(step, fits))
        if self.world > 1:
            total = int(self.accelerator.gather(torch.tensor([total], device=self.accelerator.device)).min())
        shorter = total < self.total_steps
        longer = self.time_cut and total > self.total_steps and total >= 1.02 * self.total_steps
        if not (shorter or longer):
            return
        if self.main and not self.time_cut:  # said once; later changes show in the bar's total and at the end
            self._say(
                f"train: at {per_step:.2f} s/step, {self.planned_steps:,} steps would overrun train.max_minutes="
                f"{self.deadline.minutes:g}; shortening the schedule to {total:,} steps (it follows the measured "
                "pace from here on)"
            )
        self._set_total_steps(total)

    def _say(self, text: str) -> None:
        """A line for the console that does not tear the progress bar."""
        bar = getattr(self, "bar", None)
        if bar is not None and not bar.disable:
            bar.write(text)
        else:
            print(text, flush=True)

    # ---- pieces of the loop

    def save(self, step: int) -> Path:
        """Checkpoint ``step`` (all processes)."""
        from train import checkpoint as ck

        full = self.accelerator.get_state_dict(self.model) or {}  # ZeRO-3 gathers onto the main process only
        head_state = {k[len("head.") :]: v for k, v in full.items() if k.startswith("head.")}
        cfg = self.cfg
        trainer_state = {
            **self.state,
            "world_size": self.world,
            "grad_accum": cfg.grad_accum,
            "batch_size": cfg.batch_size,
            "batch_tokens": cfg.batch_tokens,
            "seed": cfg.seed,
            "mode": cfg.mode,
            "total_steps": self.total_steps,
            "time_cut": self.time_cut,
            "target_fingerprint": self.target.fingerprint,
            "vocab_data_fingerprint": self.vocab_fp,
            "eval": self.eval_metrics,
        }
        path = ck.save_checkpoint(
            self.ckpt_root,
            step,
            accelerator=self.accelerator,
            engine=self.engine,
            head_state=head_state,
            head_config=self.hcfg.to_dict(),
            vocab=self.vocab,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            trainer_state=trainer_state,
            keep_last=cfg.keep_last,
        )
        self.last_ckpt, self.last_save_step = path, step
        if self.main and self.on_checkpoint is not None:
            self.on_checkpoint(path, step)
        return path

    def run_eval(self, step: int) -> None:
        from tqdm import tqdm

        self.eval_metrics = evaluate(
            self.model,
            self.val_src,
            self.eval_plan,
            self.accelerator,
            self.cfg,
            self.hcfg.kind,
            self.cfg.mode == "online",
            self.target,
            self.aux_layers,
            self.val_top1,
        )
        self.state["last_eval_step"] = step
        self.logger.log("eval", step, self.eval_metrics)
        if self.main:
            shown = {
                k: v for k, v in self.eval_metrics.items() if k == "val_loss" or k.startswith("val_acc_")
            }
            tqdm.write(f"step {step}: " + ", ".join(f"{k}={v:.4f}" for k, v in shown.items()))

    def _micro_step(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Forward + backward of one micro-batch; the optimizer steps at the end of an accumulation window."""
        acc, cfg, state = self.accelerator, self.cfg, self.state
        with acc.accumulate(self.model):
            batch = _prepare_batch(batch, acc, cfg.mode == "online", self.target, self.aux_layers)
            loss, metrics = self.model(batch)
            if not _is_finite_everywhere(loss, acc):
                if cfg.on_nonfinite == "stop":
                    raise _nonfinite_error("the loss", state["global_step"] + 1)
                self.skipped += 1
                self._say_skipped("the loss", state["global_step"] + 1)
                loss, metrics = self.unwrapped.zero_loss(), {}
            acc.backward(loss)
            step_ok = True
            if acc.sync_gradients and cfg.max_grad_norm > 0:
                norm = acc.clip_grad_norm_(self.unwrapped.parameters(), cfg.max_grad_norm)
                if norm is not None:  # DeepSpeed clips (and reports the norm) inside its own step
                    self.grad_norm = float(norm)
                    if not math.isfinite(self.grad_norm) and not self.deepspeed:
                        if cfg.on_nonfinite == "stop":
                            raise _nonfinite_error("the gradient norm", state["global_step"] + 1)
                        self.skipped += 1
                        self._say_skipped("the gradient norm", state["global_step"] + 1)
                        step_ok = False
            if step_ok:
                self.optimizer.step()
            self.optimizer.zero_grad()
        return metrics

    def _say_skipped(self, what: str, step: int) -> None:
        if self.main:
            print(
                f"train: {what} is not finite at step {step}: skipped that batch (train.on_nonfinite=skip; "
                "set it to stop to halt instead); metrics.jsonl counts skipped batches",
                file=sys.stderr,
                flush=True,
            )

    def _log_train(self, step: int, lr: float, usable: int) -> None:
        now = time.perf_counter()
        record = self.window.reduce(self.accelerator)
        record.update(
            lr=lr,
            grad_norm=self.grad_norm,
            tokens=self.state["tokens_seen"],
            tokens_per_s=(self.state["tokens_seen"] - self.tokens_last) / max(now - self.t_last, 1e-9),
            epoch=self.state["epoch"] + self.state["micro_batch"] / max(usable, 1),
            skipped=self.skipped,
        )
        self.t_last, self.tokens_last = now, self.state["tokens_seen"]
        self.logger.log("train", step, record)
        self.bar.set_postfix(
            loss=f"{record.get('loss', float('nan')):.3f}",
            tok_s=f"{record['tokens_per_s']:,.0f}",
            refresh=False,
        )

    # ---- the loop

    def fit(self) -> None:
        """Train until ``total_steps`` (or the last epoch) is done, evaluating and checkpointing on the way."""
        from tqdm import tqdm

        from train import checkpoint as ck
        from train.batching import batch_loader, plan_epoch, rank_slice

        cfg, state, acc = self.cfg, self.state, self.accelerator
        # restored last, right before the first step: nothing above may shift the random streams
        if self.resume_path is not None and not ck.restore_rng(self.resume_path, self.rank) and self.main:
            warnings.warn(f"{self.resume_path} has no RNG state for process {self.rank}", stacklevel=3)
        if self.main:
            where = (
                f"resuming from {self.resume_path} at step {self.start_step}"
                if self.resume_path
                else "fresh start"
            )
            print(
                f"train: {self.hcfg.kind} head ({self.num_parameters:,} parameters), {cfg.mode} mode, "
                f"{len(self.lengths):,} sequences, {self.steps_per_epoch:,} steps/epoch, {self.total_steps:,} steps, "
                f"{self.world} process(es){' under DeepSpeed' if self.deepspeed else ''}, "
                f"{'bf16 autocast' if self.accelerator.mixed_precision == 'bf16' else 'fp32'}; {where}",
                flush=True,
            )
        self.window, self.skipped, self.grad_norm = _Window(), 0, float("nan")
        self.t_last, self.tokens_last = time.perf_counter(), state["tokens_seen"]
        self.fit_started = self.deadline.elapsed()
        self.pace = [(self.start_step, self.fit_started)]  # (step, elapsed seconds) at each deadline check
        self.bar = tqdm(
            total=self.total_steps,
            initial=self.start_step,
            disable=not (self.main and cfg.progress),
            unit="step",
            dynamic_ncols=True,
            desc="train",
        )
        try:
            while state["global_step"] < self.total_steps and state["epoch"] < cfg.epochs:
                plan = plan_epoch(
                    self.lengths, world=self.world, seed=cfg.seed, epoch=state["epoch"], **self.sizes
                )
                usable = len(plan) // cfg.grad_accum * cfg.grad_accum
                mine = [rank_slice(gb, self.rank, self.world) for gb in plan[state["micro_batch"] : usable]]
                pin = acc.device.type == "cuda"
                for batch in batch_loader(self.train_src, mine, cfg.num_workers, pin_memory=pin):
                    self.window.add(self._micro_step(batch))
                    state["tokens_seen"] += sum(self.lengths[i] for i in plan[state["micro_batch"]])
                    state["micro_batch"] += 1
                    if not acc.sync_gradients:
                        continue
                    lr = self.scheduler.get_last_lr()[0]
                    self.scheduler.step()
                    state["global_step"] += 1
                    step = state["global_step"]
                    self.bar.update(1)
                    if step % cfg.log_every == 0:
                        self._fit_to_deadline(step)
                    if step % cfg.log_every == 0 or step == self.total_steps:
                        self._log_train(step, lr, usable)
                    if self.eval_plan and cfg.eval_every and step % cfg.eval_every == 0:
                        self.run_eval(step)
                    if step % cfg.save_every == 0:
                        self.save(step)
                    if step >= self.total_steps:
                        break
                else:
                    state["epoch"] += 1
                    state["micro_batch"] = 0
        finally:
            self.bar.close()
        if self.main and self.time_cut:
            step = state["global_step"]
            self._say(
                f"train: train.max_minutes={self.deadline.minutes:g} ended the schedule at step {step:,} of the "
                f"{self.planned_steps:,} planned ({step / max(self.steps_per_epoch, 1):.1f} epochs)"
            )

    def finish(self) -> TrainResult:
        """Final evaluation and checkpoint, ``final/`` (the input of ``eagle export``), curves."""
        from train import checkpoint as ck

        step = self.state["global_step"]
        if self.eval_plan and self.state["last_eval_step"] != step:
            self.run_eval(step)
        if self.last_save_step != step:
            self.save(step)
        final_dir = self.out / "final"
        if self.main:
            weights, config = ck.load_head_files(self.last_ckpt)
            tmp = self.out / ".final.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            with ck.write_guard(f"the final head {final_dir}", tmp):  # the old final/ stays until replaced
                tmp.mkdir()
                ck.save_head_files(tmp, weights, config, self.vocab)
                info = {
                    "global_step": step,
                    "checkpoint": self.last_ckpt.name,
                    "eval": self.eval_metrics,
                    "time_cut": self.time_cut,
                    "epochs": step / max(self.steps_per_epoch, 1),
                    "seconds": round(self.deadline.elapsed(), 1),  # this process's run, loading included
                }
                ck.write_json_atomic(info, tmp / "train_info.json")
            ck.replace_dir(tmp, final_dir)
        self.logger.close(plot=True)
        self.accelerator.wait_for_everyone()
        metrics = self.eval_metrics
        if not metrics and self.resume_path is not None:
            metrics = ck.read_state(self.resume_path).get("eval") or {}
        return TrainResult(self.out, final_dir, step, self.last_ckpt, metrics, self.resume_path)


# ---------------------------------------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    """``python -m train.trainer --config run.yaml key=value ...``: train under any launcher."""
    parser = argparse.ArgumentParser(
        prog="python -m train.trainer",
        description="Train a draft head (works under torchrun, accelerate launch and the deepspeed launcher).",
    )
    parser.add_argument("--config", "-c", default=None, help="run config YAML")
    parser.add_argument("--deepspeed", default=None, help="DeepSpeed JSON (same as train.deepspeed=...)")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. train.lr=1e-4"
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        from train.config import load_config

        overrides = list(args.overrides) + ([f"train.deepspeed={args.deepspeed}"] if args.deepspeed else [])
        train(load_config(args.config, overrides))
    except EagleError as exc:
        print(f"eagle train: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
