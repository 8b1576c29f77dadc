"""The processes of a launch (``torchrun``, ``accelerate launch``, ``deepspeed``): which one this is
(:func:`process_state`, for every stage that splits its work), and for training its Accelerator (plain, DDP with
gloo on a CPU, DeepSpeed ZeRO), the seeds, and the frozen target on this process's device.

The settings come from the ``train:`` section (``train.trainer.TrainConfig`` has every field
:class:`LaunchSettings` names).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import random
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from eagle.errors import EagleError


class LaunchSettings(Protocol):
    """What setting up a training process reads of the ``train:`` section."""

    grad_accum: int
    bf16: Any
    deepspeed: str | None
    batch_size: int
    batch_tokens: int | None
    max_grad_norm: float


def mixed_precision(cfg: LaunchSettings) -> str:
    """``train.bf16``: auto = bf16 autocast on a GPU with bf16, and on a CPU with bf16 instructions (AVX512-BF16 /
    AMX), where it trains the SmolLM2 demo head ~1.7x faster with the same accuracy."""
    if cfg.bf16 == "auto":
        if torch.cuda.is_available():
            return "bf16" if torch.cuda.is_bf16_supported() else "no"
        from eagle.targets import cpu_has_fast_bf16

        return "bf16" if cpu_has_fast_bf16() else "no"
    return "bf16" if cfg.bf16 else "no"


def make_accelerator(cfg: LaunchSettings) -> Any:
    """An Accelerator for this launch: plain / DDP (gloo on CPU) / DeepSpeed (from train.deepspeed or from
    ``accelerate launch --use_deepspeed``)."""
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs

    cuda = torch.cuda.is_available()
    kwargs: dict[str, Any] = dict(
        gradient_accumulation_steps=cfg.grad_accum,
        mixed_precision=mixed_precision(cfg),
    )
    use_ds = cfg.deepspeed is not None or os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true"
    if use_ds and importlib.util.find_spec("deepspeed") is None:
        raise EagleError('training with DeepSpeed needs it installed: pip install "eagle-heads[deepspeed]"')
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


def _fill_deepspeed_config(ds: dict, cfg: LaunchSettings) -> None:
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


def seed_all(seed: int) -> None:
    """Seed Python, NumPy and torch (every device) alike."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def load_target_here(target: Any, accelerator: Any, shard: bool = False) -> Any:
    """A ``Target``: as given, or loaded from a TargetConfig / name onto this process's device; with ``shard``
    (online training under a multi-process launch, ``target.shard: auto``) its decoder layers are then split
    across the processes (:func:`shard_target`)."""
    from eagle.attention import suit_device
    from eagle.targets import Target, TargetConfig, load_target

    if isinstance(target, Target):
        return target
    if target is None:
        raise EagleError("no target given: set target.name in the run config")
    tcfg = target if isinstance(target, TargetConfig) else TargetConfig(name=str(target))
    if accelerator.device.type == "cuda":
        # each process on its own GPU (a sharded target is loaded on the CPU first: see shard_target)
        tcfg = dataclasses.replace(tcfg, device="cpu" if shard else f"cuda:{accelerator.device.index or 0}")
    with _without_zero3_init(accelerator):
        loaded = load_target(tcfg)
    if shard:
        suit_device(loaded.model, accelerator.device)  # loaded on the CPU, run on this process's GPU
        shard_target(loaded, accelerator.device)
    return loaded


def shard_target(target: Any, device: torch.device) -> int:
    """Split the frozen target's decoder layers across the processes (FSDP2 ``fully_shard`` on one device mesh):
    each process keeps 1/world of every layer's weights and gathers a layer only while it runs; returns the
    parameters this process holds.

    The embeddings, the final norm and the lm_head stay whole on every process: the draft head borrows the
    embedding and the loss reads the lm_head's rows directly, outside the target's forward, and for a large
    target they are a small part of it (2 of 16 GB for an 8B model in bf16). The target is loaded whole on the
    CPU first; the accelerator (GPU) then only ever holds the shards."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    layers = _decoder_layers(target.model)
    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    if device.type == "cuda":  # the parts that stay whole go to the process's GPU too
        for name, module in target.model.named_children():
            if name != "model":
                module.to(device)
        for name, module in target.model.model.named_children():
            if name != "layers":
                module.to(device)
    target.device = device
    return local_parameters(target.model)


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise EagleError(
            f"target.shard: cannot find the decoder layers of {type(model).__name__} (model.model.layers): set "
            "target.shard=none (every process holds the whole target)"
        )
    return list(layers)


def local_parameters(model: torch.nn.Module) -> int:
    """Parameter values this process holds: a sharded one counts its local shard only."""
    total = 0
    for p in model.parameters():
        local = getattr(p, "to_local", None)
        total += local().numel() if callable(local) else p.numel()
    return total


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


# ------------------------------------------------------------------------------------ the processes

_WORLD_ENV = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")


class OneProcess:
    """Stands in for accelerate's PartialState in a plain single-process run."""

    process_index, num_processes, is_main_process = 0, 1, True

    def wait_for_everyone(self) -> None:
        pass


def process_state(device: torch.device) -> Any:
    """accelerate's PartialState under a multi-process launch (or when the caller already set one up); a
    single plain process leaves accelerate's process-wide state alone, so a later Accelerator is unaffected."""
    from accelerate import PartialState

    launched = any(int(os.environ.get(k, "1") or 1) > 1 for k in _WORLD_ENV)
    if not launched and PartialState._shared_state == {}:
        return OneProcess()
    # gloo on CPU: without cpu=True accelerate treats a CPU torchrun launch as one process
    return PartialState(cpu=device.type == "cpu")
