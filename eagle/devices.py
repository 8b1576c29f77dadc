"""Where a model computes and in what dtype, and waiting for its device: the one place that answers both."""

from __future__ import annotations

import torch


def model_device(model: torch.nn.Module) -> torch.device:
    """The device a model's inputs go to: where its input embedding lives (first stage of a sharded model)."""
    return model.get_input_embeddings().weight.device


def model_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype a model computes in: its input embedding's."""
    return model.get_input_embeddings().weight.dtype


def sync(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (GPU kernels run asynchronously; a wall clock must wait for them)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
