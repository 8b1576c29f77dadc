"""Training metrics: ``metrics.jsonl`` (always), TensorBoard and/or Weights & Biases (``train.report_to``), and
a PNG of the loss/accuracy curves at the end.

Only the main process writes. ``metrics.jsonl`` holds one JSON object per event: ``{"event": "train", "step",
"loss", "lr", "tokens_per_s", "acc_0", ...}`` or ``{"event": "eval", "step", "val_loss", "val_acc", ...}``.
A resumed run first drops the events after its checkpoint's step, so the file reads as one uninterrupted run.
"""

from __future__ import annotations

import json
import math
import os
import uuid
from pathlib import Path
from typing import Any

from eagle.errors import EagleError
from eagle.fileio import save_figure_atomic, write_text_atomic

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "training_curves.png"
WANDB_ID_FILE = "wandb_run_id.txt"


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """All events of a ``metrics.jsonl`` (a torn last line from a crash is ignored)."""
    path = Path(path)
    if not path.is_file():
        return []
    events = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            continue
    return events


def _clean(value: Any) -> Any:
    """JSON-safe scalars (tensors -> float, NaN/inf -> str)."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class MetricsLogger:
    """Writes events to metrics.jsonl and the ``report_to`` backends (no-op on non-main processes)."""

    def __init__(
        self,
        output_dir: str | os.PathLike,
        report_to: list[str],
        *,
        enabled: bool = True,
        resume_step: int | None = None,
        config: dict | None = None,
        project: str = "eagle-heads",
        run_name: str | None = None,
    ):
        self.dir = Path(output_dir)
        self.enabled = enabled
        self.path = self.dir / METRICS_FILE
        self._tb = None
        self._wandb = None
        if not enabled:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        kept = [
            e for e in read_metrics(self.path) if resume_step is not None and e.get("step", 0) <= resume_step
        ]
        write_text_atomic("".join(json.dumps(e) + "\n" for e in kept), self.path)
        self._fh = open(self.path, "a", encoding="utf-8")
        reporters = [r for r in report_to if r != "none"]
        try:
            if "tensorboard" in reporters:
                self._tb = self._open_tensorboard(resume_step)
            if "wandb" in reporters:
                self._wandb = self._open_wandb(resume_step, config, project, run_name)
        except BaseException:
            self.close(plot=False)
            raise

    def _open_tensorboard(self, resume_step: int | None):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise EagleError(
                f"train.report_to includes tensorboard but it cannot be imported ({exc}): "
                'pip install "eagle-heads[tensorboard]" or remove it from train.report_to'
            ) from exc
        # purge_step hides events a killed run wrote after the checkpoint we resume from
        return SummaryWriter(str(self.dir / "tb"), purge_step=(resume_step + 1) if resume_step else None)

    def _open_wandb(self, resume_step: int | None, config: dict | None, project: str, run_name: str | None):
        try:
            import wandb
        except ImportError as exc:
            raise EagleError(
                f"train.report_to includes wandb but it cannot be imported ({exc}): pip install \"eagle-heads[wandb]\" or "
                "remove it from train.report_to"
            ) from exc
        id_file = self.dir / WANDB_ID_FILE
        run_id = id_file.read_text().strip() if resume_step and id_file.is_file() else None
        if run_id is None:
            run_id = uuid.uuid4().hex[:12]
            write_text_atomic(run_id + "\n", id_file)
        try:
            return wandb.init(
                project=project,
                name=run_name,
                id=run_id,
                resume="allow",
                dir=str(self.dir),
                config=config or {},
            )
        except Exception as exc:  # no login / no network: say how to run without it
            raise EagleError(
                f"wandb could not start ({exc}): run `wandb login`, or set WANDB_MODE=offline to log locally, "
                "or remove wandb from train.report_to"
            ) from exc

    def log(self, event: str, step: int, metrics: dict[str, Any]) -> None:
        """Record one event (``train`` or ``eval``) at optimizer step ``step``."""
        if not self.enabled:
            return
        record = {"event": event, "step": int(step), **{k: _clean(v) for k, v in metrics.items()}}
        self._fh.write(json.dumps(record) + "\n")
        self._fh.flush()
        numbers = {
            k: v for k, v in record.items() if isinstance(v, int | float) and k not in ("step", "event")
        }
        prefix = "train" if event == "train" else "eval"
        if self._tb is not None:
            for key, value in numbers.items():
                self._tb.add_scalar(f"{prefix}/{key}", value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log({f"{prefix}/{k}": v for k, v in numbers.items()}, step=int(step))

    def close(self, plot: bool = True) -> Path | None:
        """Flush and close everything; draw the curves PNG (returns its path)."""
        if not self.enabled or self._fh.closed:
            return None
        self._fh.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        return plot_metrics(self.path, self.dir / PLOT_FILE) if plot else None


def plot_metrics(metrics_path: str | os.PathLike, out_png: str | os.PathLike) -> Path | None:
    """Loss (train and validation) and accuracy curves from a ``metrics.jsonl``; None when it has no events."""
    events = read_metrics(metrics_path)
    train = [e for e in events if e.get("event") == "train" and isinstance(e.get("loss"), int | float)]
    evals = [e for e in events if e.get("event") == "eval"]
    if not train and not evals:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    if train:
        ax_loss.plot([e["step"] for e in train], [e["loss"] for e in train], label="train loss", lw=1)
    if evals and any("val_loss" in e for e in evals):
        ax_loss.plot([e["step"] for e in evals], [e.get("val_loss") for e in evals], "o-", label="val loss")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss")
    ax_loss.set_title("loss")
    ax_loss.legend()
    acc_keys = sorted(
        {k for e in evals for k in e if k.startswith("val_acc_")}, key=lambda k: int(k.rsplit("_", 1)[1])
    )
    for key in acc_keys or (["val_acc"] if any("val_acc" in e for e in evals) else []):
        label = f"val top-1, TTT step {key.rsplit('_', 1)[1]}" if key != "val_acc" else "val top-1"
        ax_acc.plot([e["step"] for e in evals], [e.get(key) for e in evals], "o-", label=label)
    if train and "acc_0" in train[0]:
        ax_acc.plot(
            [e["step"] for e in train],
            [e.get("acc_0") for e in train],
            lw=0.8,
            alpha=0.6,
            label="train top-1",
        )
    elif train and "acc" in train[0]:
        ax_acc.plot(
            [e["step"] for e in train], [e.get("acc") for e in train], lw=0.8, alpha=0.6, label="train top-1"
        )
    ax_acc.set_xlabel("step")
    ax_acc.set_ylabel("top-1 accuracy")
    ax_acc.set_ylim(0, 1)
    ax_acc.set_title("accuracy (head argmax == target argmax)")
    if ax_acc.lines:
        ax_acc.legend()
    fig.tight_layout()
    save_figure_atomic(fig, out_png, dpi=100)
    plt.close(fig)
    return Path(out_png)
