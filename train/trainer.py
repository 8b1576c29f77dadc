"""The training loop (``eagle train``): a draft head on a frozen target, offline (feature shards) or online.

:func:`train` runs on every process of a launch (``eagle train`` / ``python -m recipes train``: one process, under
``torchrun`` / ``accelerate launch`` (DDP, gloo on CPU), under ``accelerate launch --use_deepspeed`` or the
``deepspeed`` launcher with ``train.deepspeed=<json>`` (ZeRO-2/3)).

Every process loads the frozen target (its embeddings and lm_head feed the loss; online mode also runs it inside
the step). Batches are planned globally (:mod:`train.batching`), so N processes with ``batch_size`` b train on
exactly the data of one process with N*b. Checkpoints (:mod:`train.checkpoint`) are atomic and restore the data
position, optimizer, scheduler and RNG states, so a resumed run continues the interrupted loss curve.

``final/`` (what ``eagle export`` reads) holds the last weights, or with ``train.keep_best`` those of the best
validation by that metric (kept in ``best/`` as training goes; the last weights stay in ``checkpoints/``).

Gradient averaging: each micro-batch's loss is a mean over its own counted tokens, and micro-batches (across
grad_accum and processes) are weighted equally -- as in most trainers.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from eagle.deadline import Deadline, check_minutes
from eagle.errors import EagleError
from eagle.heads import HeadConfig
from eagle.lazy_logits import TargetLogits
from train.batching import open_sources, prepare_batch
from train.checkpoint import resolve_resume
from train.launch import load_target_here, make_accelerator, seed_all
from train.validation import validate as run_validation
from train.vocab import draft_vocab_for_run

REPORTERS = ("none", "tensorboard", "wandb")
BEST_METRICS = {"sim_tau": "max", "val_loss": "min"}  # train.keep_best: which way each metric improves
MIN_LENGTH = 3  # tokens a sequence needs to give one training label
BEST_DIR = "best"  # train.keep_best: the weights of the best validation, under train.output_dir


@dataclass
class TrainConfig:
    """The ``train:`` section."""

    mode: Literal["offline", "online"] = "offline"  # offline: from feature shards (eagle collect); online: the target runs inside each step
    init_from: str | None = None  # a head folder (model.safetensors + head_config.json) to start from
    output_dir: str = "{run_dir}/train"  # checkpoints/, final/, metrics.jsonl, curves, tb/, wandb/
    epochs: int = 1  # passes over the training data
    max_steps: int | None = None  # optimizer steps; caps ``epochs`` when set
    # wall-time limit for this invocation: the schedule (cosine included) is shortened to end in time; null = none
    max_minutes: float | None = None
    batch_size: int = 8  # sequences per process per micro-step
    # when set: batches of about this many padded tokens per process (replaces batch_size)
    batch_tokens: int | None = None
    max_length: int | None = None  # truncate longer sequences
    grad_accum: int = 1  # micro-steps per optimizer step
    lr: float = 3e-4  # peak learning rate (AdamW, cosine schedule)
    weight_decay: float = 0.0  # AdamW weight decay
    warmup_steps: int | None = None  # linear warm-up steps (null: warmup_ratio of the total)
    warmup_ratio: float = 0.02  # share of the steps spent warming up
    min_lr_ratio: float = 0.1  # the cosine schedule ends at this share of lr
    max_grad_norm: float = 1.0  # gradient clipping
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # AdamW betas
    ttt_steps: int = 3  # eagle3: training-time-test steps (the head drafts from its own outputs this many times)
    step_decay: float = 0.8  # eagle3: weight of TTT step j is step_decay**j
    # eagle3: share of the loss on the target's top draft token (a hard label) instead of its whole distribution
    top1_weight: float = 0.0
    noise_std: float = 0.0  # width of the uniform noise added to the target features (EAGLE's augmentation; 0 = off)
    ce_weight: float = 0.1  # eagle1
    reg_weight: float = 1.0  # eagle1
    bf16: bool | Literal["auto"] = "auto"  # mixed precision; auto: on GPUs with bf16 and CPUs with bf16 units
    eval_every: int = 200  # 0: only at the end
    eval_max_sequences: int | None = None  # validation sequences per validation (null: all)
    save_every: int = 500  # optimizer steps between checkpoints
    keep_last: int | None = 3  # checkpoints kept (null: all)
    # null | sim_tau | val_loss: keep the weights of the best validation by this metric in best/ and make final/
    # (what eagle export reads) those weights; the last weights stay in checkpoints/. null: final/ = the last weights
    keep_best: str | None = None
    resume: str = "auto"  # auto | never | <checkpoint dir>
    seed: int = 0  # initialisation, data order and noise
    deterministic: bool = False  # deterministic kernels (slower; for bit-exact reruns)
    report_to: list[str] = field(default_factory=lambda: ["none"])  # none | tensorboard | wandb (metrics.jsonl and curves are always written)
    wandb_project: str = "eagle-heads"  # the W&B project (report_to: [wandb])
    run_name: str | None = None  # the W&B run name (null: W&B picks one)
    log_every: int = 10  # optimizer steps between metric lines
    num_workers: int = 0  # DataLoader worker processes
    on_nonfinite: Literal["skip", "stop"] = "skip"  # a NaN/inf loss: skip the batch, or stop with an error
    deepspeed: str | None = None  # DeepSpeed JSON (e.g. configs/deepspeed/zero2.json)
    progress: bool = True  # show a progress bar

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
        if not 0 <= self.top1_weight <= 1:
            raise EagleError(f"train.top1_weight must be in [0, 1] (0: the target's whole distribution), "
                             f"got {self.top1_weight}")
        if len(self.adam_betas) != 2 or not all(0 <= b < 1 for b in self.adam_betas):
            raise EagleError(f"train.adam_betas must be two numbers in [0, 1), got {self.adam_betas}")
        if self.eval_every < 0:
            raise EagleError(f"train.eval_every must be >= 0 (0: only at the end), got {self.eval_every}")
        if self.keep_last is not None and self.keep_last < 1:
            raise EagleError(f"train.keep_last must be >= 1 or unset (keep all), got {self.keep_last}")
        if self.keep_best is not None and self.keep_best not in BEST_METRICS:
            raise EagleError(
                f"train.keep_best must be one of {list(BEST_METRICS)} (the validation metric whose best weights "
                f"become final/) or null (final/ = the last weights), got {self.keep_best!r}"
            )
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
    val_metrics: dict[str, float] = field(default_factory=dict)
    resumed_from: Path | None = None
    best: dict[str, Any] | None = None  # train.keep_best: {"metric", "value", "step"} of the weights in final/


class HeadWithLoss(nn.Module):
    """The head plus its loss as one module, so DDP / DeepSpeed see a normal ``forward(batch) -> loss``.

    The target's lm_head (:class:`eagle.lazy_logits.TargetLogits`: with the target's own logit post-processing) is
    held outside the module tree (it is frozen and never wrapped or saved).
    """

    def __init__(self, head: nn.Module, target_lm_head: nn.Module, kind: str, cfg: TrainConfig):
        super().__init__()
        if kind != "eagle3" and cfg.top1_weight:
            raise EagleError(f"train.top1_weight applies to eagle3 heads (their TTT loss); this head is {kind}: "
                             "set train.top1_weight=0")
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
                top1_weight=cfg.top1_weight,
            )
        return eagle1_loss(self.head, batch, self._lm_head[0], cfg.reg_weight, cfg.ce_weight, cfg.noise_std)

    def zero_loss(self) -> torch.Tensor:
        """A zero loss that still reaches every parameter (skipping a bad batch without desyncing DDP)."""
        return sum((p * 0).sum() for p in self.parameters())


# ------------------------------------------------------------------------------------------------- setup


def _aux_layers(spec: HeadConfig, train_src, target) -> list[int]:
    from eagle.features import check_aux_layers, default_aux_layers

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


def improves(metric: str, value: float | None, best: float | None) -> bool:
    """Whether ``value`` of ``metric`` (a ``train.keep_best`` choice) beats ``best`` (None: nothing yet). Ties keep
    the earlier weights; a NaN or infinite value (a diverged run) never wins."""
    if value is None or not math.isfinite(value):
        return False
    if best is None:
        return True
    return value > best if BEST_METRICS[metric] == "max" else value < best


def _is_finite_everywhere(value: torch.Tensor, accelerator) -> bool:
    bad = (~torch.isfinite(value.detach().float())).any().float().reshape(1).to(accelerator.device)
    return float(accelerator.reduce(bad, reduction="sum").item()) == 0.0


def _nonfinite_error(what: str, step: int) -> EagleError:
    return EagleError(
        f"{what} is not finite at step {step}: lower train.lr, keep train.max_grad_norm > 0, check the data "
        "(or set train.on_nonfinite=skip to skip such batches)"
    )


def train(
    *,
    target: Any = None,
    data_dir: str | os.PathLike | None = None,
    features_dir: str | os.PathLike | None = None,
    head: HeadConfig | None = None,
    cfg: TrainConfig | None = None,
    on_checkpoint: Callable[[Path, int], None] | None = None,
) -> TrainResult:
    """Train a draft head; returns where it went. Call it on every process of a launch.

    ``target``: a ``TargetConfig``, a name, or a loaded ``eagle.targets.Target``; ``data_dir``: the prepared data
    (``eagle prepare``); ``features_dir``: the feature shards (``eagle collect``; offline mode).
    ``on_checkpoint(path, step)`` is called on the main process after each checkpoint is in place.
    """
    cfg = (cfg or TrainConfig()).validate()
    spec = (head or HeadConfig()).validate()
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


def _train(cfg: TrainConfig, spec: HeadConfig, target, data_dir, features_dir, on_checkpoint) -> TrainResult:
    run = _Run(cfg, spec, target, data_dir, features_dir, on_checkpoint)
    try:
        run.fit()
        return run.finish()
    except BaseException:
        run.logger.close(plot=False)
        raise


def _clean_output(cfg: TrainConfig, out: Path, ckpt_root: Path, fresh: bool) -> None:
    """The output folder, without the temporary leftovers of a killed run (and, with ``resume: never``, without
    earlier checkpoints; on a ``fresh`` start, without an earlier run's best/)."""
    from train import checkpoint as ck

    out.mkdir(parents=True, exist_ok=True)
    ck.clean_stale(ckpt_root)
    if fresh:  # best/ belongs to the run its checkpoints continue; a fresh start writes its own
        ck.remove_tree(out / BEST_DIR)
    if cfg.resume == "never" and ckpt_root.is_dir():
        for old in ck.list_checkpoints(ckpt_root):
            ck.remove_tree(old)
        (ckpt_root / ck.LATEST).unlink(missing_ok=True)


def _usable_lengths(lengths: list[int], allow_empty: bool = False) -> list[int]:
    """Sequence lengths with the ones too short for a label set to 0 (the head at i predicts x_{i+2}, so a
    sequence needs 3 tokens); an error when none is left (unless ``allow_empty``)."""
    usable = [n if n >= MIN_LENGTH else 0 for n in lengths]
    if not any(usable) and not allow_empty:
        raise EagleError(
            f"the training data is empty (no sequences with at least {MIN_LENGTH} tokens): run `eagle "
            "prepare` (and `eagle collect` for offline training) on a non-empty data set"
        )
    return usable


class _Run:
    """One training run on this process: set up in ``__init__``, then :meth:`fit` and :meth:`finish`."""

    def __init__(self, cfg: TrainConfig, spec: HeadConfig, target, data_dir, features_dir, on_checkpoint):
        from train.logging import MetricsLogger

        self.cfg, self.on_checkpoint = cfg, on_checkpoint
        self.deadline = Deadline(cfg.max_minutes)  # loading counts too
        self.accelerator = acc = make_accelerator(cfg)
        self.rank, self.world, self.main = acc.process_index, acc.num_processes, acc.is_main_process
        self.deepspeed = acc.distributed_type.name == "DEEPSPEED"
        self.out = Path(cfg.output_dir)
        self.ckpt_root = self.out / "checkpoints"
        shard = (cfg.mode == "online" and acc.num_processes > 1 and getattr(target, "shard", "none") == "auto"
                 and not self.deepspeed)
        self.target = target = load_target_here(target, acc, shard)
        if shard and self.main:
            from train.launch import local_parameters

            whole = sum(p.numel() for p in target.model.parameters())  # a sharded parameter reports its full size
            print(f"train: target sharded across {self.world} processes: this process holds "
                  f"{local_parameters(target.model):,} of {whole:,} parameters", flush=True)
        self.resume_path = resume_path = resolve_resume(cfg.resume, self.ckpt_root)
        if self.main:
            _clean_output(cfg, self.out, self.ckpt_root, fresh=resume_path is None)
        acc.wait_for_everyone()

        # ---- data and head
        self.train_src, self.val_src = open_sources(cfg.mode, data_dir, features_dir, target.fingerprint, cfg.max_length)
        self.lengths = _usable_lengths(self.train_src.lengths())
        self.aux_layers = _aux_layers(spec, self.train_src, target)
        self.hcfg = spec.for_target(target.config, self.aux_layers, target.name, target.fingerprint)
        head, self.vocab, self.vocab_fp = self._build_head(spec)
        self.num_parameters = sum(p.numel() for p in head.parameters())  # before ZeRO-3 partitions them

        # ---- schedule, optimizer
        self.sizes = {"batch_size": cfg.batch_size} if cfg.batch_tokens is None else {"batch_tokens": cfg.batch_tokens}
        self.steps_per_epoch = self._steps_per_epoch()
        total = self.steps_per_epoch * cfg.epochs
        self.total_steps = min(total, cfg.max_steps) if cfg.max_steps is not None else total
        self.planned_steps = self.total_steps  # the schedule asked for, before train.max_minutes shortens it
        self.warmup = self._warmup_steps()
        model = HeadWithLoss(head, TargetLogits(target.model), self.hcfg.kind, cfg)
        model.train()
        optimizer = _optimizer(head, cfg)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, _lr_lambda(self.total_steps, self.warmup, cfg.min_lr_ratio)
        )
        self.model, self.optimizer = acc.prepare(model, optimizer)
        self.engine = self.model if self.deepspeed else None
        self.unwrapped = acc.unwrap_model(self.model)

        # ---- where the run stands
        self.state = {"epoch": 0, "micro_batch": 0, "global_step": 0, "tokens_seen": 0, "last_eval_step": -1}
        self.time_cut = False  # the schedule was shortened to fit train.max_minutes
        # train.keep_best: the best validation so far, whose weights best/ holds
        self.best: dict[str, Any] = {"metric": cfg.keep_best, "value": None, "step": None}
        if resume_path is not None:
            self._restore(resume_path)
        self.start_step = self.state["global_step"]
        self.last_ckpt = resume_path
        self.last_save_step = self.start_step if resume_path is not None else -1
        self.val_metrics: dict[str, float] = {}
        self.logger = MetricsLogger(
            self.out, cfg.report_to, enabled=self.main,
            resume_step=self.start_step if resume_path is not None else None,
            config={"train": dataclasses.asdict(cfg), "head": self.hcfg.to_dict()},
            project=cfg.wandb_project, run_name=cfg.run_name,
        )
        # the fit loop's running state (fit() starts it afresh)
        self.window, self.skipped, self.grad_norm = _Window(), 0, float("nan")
        self.t_last, self.tokens_last = time.perf_counter(), self.state["tokens_seen"]
        self.fit_started = 0.0
        self.pace: list[tuple[int, float]] = []  # (step, elapsed seconds) at each deadline check
        self.bar: Any = None  # the progress bar, while fit() runs
        self.val_top1: dict[int, torch.Tensor] = {}  # the target's exact top-1 per validation batch
        self.val_plan = self._plan_validation()

    def _plan_validation(self) -> list | None:
        """The validation batches (None without validation data, which ``train.keep_best`` cannot do without)."""
        from train.batching import plan_eval

        cfg, plan = self.cfg, None
        if self.val_src is not None:
            val_lengths = _usable_lengths(self.val_src.lengths()[: cfg.eval_max_sequences], allow_empty=True)
            plan = plan_eval(val_lengths, world=self.world, **self.sizes) or None
        if cfg.keep_best and plan is None:
            raise EagleError(
                f"train.keep_best={cfg.keep_best} picks weights by validation, but there is no validation data "
                "(an empty or missing val split): prepare with data.val_fraction > 0, or set train.keep_best=null"
            )
        return plan

    def _build_head(self, spec: HeadConfig) -> tuple[nn.Module, tuple | None, str | None]:
        """The head, its weights from the checkpoint resumed or ``train.init_from`` (else fresh, the same on every
        process), and (eagle3) its draft vocabulary and that vocabulary's data fingerprint."""
        from eagle.heads import build_head
        from train import checkpoint as ck

        cfg, hcfg, resume_path = self.cfg, self.hcfg, self.resume_path
        resume_weights = init_state = None
        if resume_path is not None:
            resume_weights, saved_cfg = ck.load_head_files(resume_path)
            ck.check_head_matches(saved_cfg, hcfg, resume_path)
        elif cfg.init_from:
            init_state, init_cfg = ck.load_head_files(cfg.init_from)
            if init_cfg.get("kind") != hcfg.kind:
                raise EagleError(
                    f"train.init_from {cfg.init_from} is a {init_cfg.get('kind')} head, not {hcfg.kind}: "
                    "point it at a head of the same kind"
                )
        seed_all(cfg.seed)  # the same initial weights on every process
        head = build_head(hcfg).attach_target(self.target.model)
        vocab = vocab_fp = None
        if hcfg.kind == "eagle3":
            resumed = None if resume_path is None else (
                resume_path, ck.read_state(resume_path).get("vocab_data_fingerprint"))
            vocab, vocab_fp = draft_vocab_for_run(hcfg, self.train_src, self.out, resumed,
                                                  self.accelerator.is_main_process, init_state)
            head.set_draft_vocab(*vocab)
        for weights, where in ((init_state, cfg.init_from), (resume_weights, resume_path)):
            if weights is not None:
                try:
                    head.load_state_dict(weights, strict=True)
                except RuntimeError as exc:
                    raise EagleError(
                        f"the head weights in {where} do not fit this head ({str(exc).splitlines()[0]}): use a "
                        "head trained for this target and head settings"
                    ) from exc
        seed_all(cfg.seed + 1 + 1_000_003 * self.rank)  # per-process noise streams
        return head, vocab, vocab_fp

    def _steps_per_epoch(self) -> int:
        from train.batching import plan_epoch

        cfg = self.cfg
        first_plan = plan_epoch(self.lengths, world=self.world, seed=cfg.seed, epoch=0, **self.sizes)
        steps = len(first_plan) // cfg.grad_accum
        if steps == 0:
            size = cfg.batch_size if cfg.batch_tokens is None else f"{cfg.batch_tokens} tokens"
            raise EagleError(
                f"the training data ({len(self.lengths)} sequences) is too small for one optimizer step: a step "
                f"needs {cfg.grad_accum} global batch(es) of {size} x {self.world} process(es); lower "
                "train.batch_size / train.grad_accum or add data"
            )
        return steps

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
        self.best = self._resumed_best(saved)
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
        kernels are compiled per matrix shape), and a pace measured from the start would cut the schedule
        too short and end the run minutes early. It includes the periodic evaluations and checkpoints; a little time is kept for the
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

        head_state = self._head_state()
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
            "eval": self.val_metrics,
            "best": self.best,  # train.keep_best: a resumed run keeps comparing against it
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

    def _head_state(self) -> dict[str, torch.Tensor]:
        """The head's weights (call on every process: ZeRO-3 gathers them onto the main process only)."""
        full = self.accelerator.get_state_dict(self.model) or {}
        return {k[len("head.") :]: v for k, v in full.items() if k.startswith("head.")}

    def validate(self, step: int) -> None:
        """Validation loss, top-1 accuracy and sim_tau now, logged and shown; best/ updated (train.keep_best)."""
        from tqdm import tqdm

        self.val_metrics = run_validation(
            self.model,
            self.val_src,
            self.val_plan,
            self.accelerator,
            self.cfg,
            self.hcfg.kind,
            self.cfg.mode == "online",
            self.target,
            self.aux_layers,
            self.val_top1,
        )
        self.state["last_eval_step"] = step
        self.logger.log("eval", step, self.val_metrics)
        improved = self._improves(self.val_metrics)
        if improved:
            self._save_best(step)
        if self.main:
            shown = {
                k: v for k, v in self.val_metrics.items()
                if k in ("val_loss", "sim_tau") or k.startswith("val_acc_")
            }
            note = f" (best {self.cfg.keep_best} so far: saved to best/)" if improved else ""
            tqdm.write(f"step {step}: " + ", ".join(f"{k}={v:.4f}" for k, v in shown.items()) + note)

    def _micro_step(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Forward + backward of one micro-batch; the optimizer steps at the end of an accumulation window."""
        acc, cfg, state = self.accelerator, self.cfg, self.state
        with acc.accumulate(self.model):
            batch = prepare_batch(batch, acc, cfg.mode == "online", self.target, self.aux_layers)
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
                    if self.val_plan and cfg.eval_every and step % cfg.eval_every == 0:
                        self.validate(step)
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
        if self.val_plan and self.state["last_eval_step"] != step:
            self.validate(step)
        if self.last_save_step != step:
            self.save(step)
        final_dir = self.out / "final"
        source, info = self._final_weights(step)
        if self.main:
            weights, config = ck.load_head_files(source)
            ck.write_head_folder(final_dir, weights, config, self.vocab, info)
        self.logger.close(plot=True)
        self.accelerator.wait_for_everyone()
        metrics = self.val_metrics
        if not metrics and self.resume_path is not None:
            metrics = ck.read_state(self.resume_path).get("eval") or {}
        return TrainResult(self.out, final_dir, step, self.last_ckpt, metrics, self.resume_path, info.get("best"))

    # ---- train.keep_best

    def _improves(self, metrics: dict[str, float]) -> bool:
        """Whether ``metrics`` beat the best validation so far by ``train.keep_best``."""
        metric = self.cfg.keep_best
        return metric is not None and improves(metric, metrics.get(metric), self.best["value"])

    def _save_best(self, step: int) -> None:
        """Write the current weights to best/ (every process: ZeRO-3 gathers them)."""
        from train import checkpoint as ck

        head_state = self._head_state()
        metric = self.cfg.keep_best
        self.best = {"metric": metric, "value": self.val_metrics[metric], "step": step}
        if self.main:
            info = {"global_step": step, "best": self.best, "eval": self.val_metrics}
            ck.write_head_folder(self.out / BEST_DIR, head_state, self.hcfg.to_dict(), self.vocab, info)
        self.accelerator.wait_for_everyone()

    def _resumed_best(self, saved: dict) -> dict[str, Any]:
        """The best validation so far of a resumed run: the checkpoint's record, or best/'s own when that folder
        was written after the checkpoint (before the interruption: it holds those weights, and the resumed run
        replays the same steps). A record of another metric, or one whose weights best/ no longer holds, starts
        over: the next validation writes best/."""
        from train import checkpoint as ck

        metric = self.cfg.keep_best
        fresh = {"metric": metric, "value": None, "step": None}
        if metric is None:
            return fresh
        stored = saved.get("best") or {}
        on_disk = ck.read_info(self.out / BEST_DIR).get("best") or {}
        if on_disk.get("metric") == metric and (on_disk.get("step") or 0) > saved.get("global_step", 0):
            return {"metric": metric, "value": on_disk.get("value"), "step": on_disk.get("step")}
        if stored.get("metric") != metric or stored.get("value") is None:
            return fresh
        if on_disk.get("metric") != metric or on_disk.get("step") != stored.get("step"):
            if self.main:
                warnings.warn(
                    f"{self.out / BEST_DIR} does not hold the weights of the best {metric} the checkpoint records "
                    f"(step {stored.get('step')}): the best starts over at the next validation",
                    stacklevel=4,
                )
            return fresh
        return {"metric": metric, "value": stored["value"], "step": stored["step"]}

    def _final_weights(self, step: int) -> tuple[Path, dict[str, Any]]:
        """Which weights become final/ (the last checkpoint's, or best/'s under train.keep_best) and its
        train_info.json."""
        from train import checkpoint as ck

        info: dict[str, Any] = {
            "global_step": step,
            "checkpoint": self.last_ckpt.name,
            "eval": self.val_metrics,
            "time_cut": self.time_cut,
            "epochs": step / max(self.steps_per_epoch, 1),
            "seconds": round(self.deadline.elapsed(), 1),  # this process's run, loading included
        }
        metric = self.cfg.keep_best
        if metric is None:
            return self.last_ckpt, info
        best_dir = self.out / BEST_DIR
        recorded = ck.read_info(best_dir)
        if self.best["step"] is None or recorded.get("best") != self.best:
            if self.main:
                self._say(f"train: train.keep_best={metric}: no validation gave a finite {metric} whose weights "
                          f"are in {best_dir}, so final/ holds the last weights")
            return self.last_ckpt, info
        info.update(checkpoint=BEST_DIR, best=self.best, eval=recorded.get("eval") or {}, last_eval=self.val_metrics)
        return best_dir, info
