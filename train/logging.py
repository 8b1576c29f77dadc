"""Training metrics: ``metrics.jsonl`` (always), TensorBoard and/or Weights & Biases (``train.report_to``), and
a PNG of the loss/accuracy curves at the end.

Only the main process writes. ``metrics.jsonl`` holds one JSON object per event: ``{"event": "train", "step",
"loss", "lr", "tokens_per_s", "acc_0", ...}`` or ``{"event": "eval", "step", "val_loss", "val_acc", "sim_tau",
...}`` (every validation metric, :func:`train.validation.validate`).
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
    """Loss (train and validation), accuracy and simulated chain tau curves from a ``metrics.jsonl``; None when it
    has no events."""
    events = read_metrics(metrics_path)
    train = [e for e in events if e.get("event") == "train" and isinstance(e.get("loss"), int | float)]
    evals = [e for e in events if e.get("event") == "eval"]
    if not train and not evals:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_acc, ax_tau) = plt.subplots(1, 3, figsize=(16, 4))
    _plot_loss(ax_loss, train, evals)
    _plot_accuracy(ax_acc, train, evals)
    _plot_sim_tau(ax_tau, evals)
    fig.tight_layout()
    save_figure_atomic(fig, out_png, dpi=100)
    plt.close(fig)
    return Path(out_png)


def _numbers(events: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the events that hold a number under ``key`` (a NaN is logged as a string)."""
    pairs = [(e["step"], e[key]) for e in events if isinstance(e.get(key), int | float)]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _plot_loss(ax, train: list[dict], evals: list[dict]) -> None:
    if train:
        ax.plot(*_numbers(train, "loss"), label="train loss", lw=1)
    if any("val_loss" in e for e in evals):
        ax.plot(*_numbers(evals, "val_loss"), "o-", label="val loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("loss")
    ax.legend()


def _plot_accuracy(ax, train: list[dict], evals: list[dict]) -> None:
    acc_keys = sorted(
        {k for e in evals for k in e if k.startswith("val_acc_")}, key=lambda k: int(k.rsplit("_", 1)[1])
    )
    for key in acc_keys or (["val_acc"] if any("val_acc" in e for e in evals) else []):
        label = f"val top-1, TTT step {key.rsplit('_', 1)[1]}" if key != "val_acc" else "val top-1"
        ax.plot(*_numbers(evals, key), "o-", label=label)
    key = "acc_0" if train and "acc_0" in train[0] else "acc"
    if train and key in train[0]:
        ax.plot(*_numbers(train, key), lw=0.8, alpha=0.6, label="train top-1")
    ax.set_xlabel("step")
    ax.set_ylabel("top-1 accuracy")
    ax.set_ylim(0, 1)
    ax.set_title("accuracy (head argmax == target argmax)")
    if ax.lines:
        ax.legend()


def _plot_sim_tau(ax, evals: list[dict]) -> None:
    """Validation's simulated chain tau (a chain of ttt_steps drafts at T=0), its best point marked."""
    steps, taus = _numbers(evals, "sim_tau")
    chain = sum(1 for k in (evals[-1] if evals else {}) if k.startswith("sim_accept_"))
    if taus:
        ax.plot(steps, taus, "o-", color="tab:green", label=f"val sim tau (chain of {chain})")
        best = max(range(len(taus)), key=lambda i: (taus[i], -i))  # the first of equal bests
        ax.plot([steps[best]], [taus[best]], "*", ms=14, color="tab:orange", label=f"best {taus[best]:.3f}")
        ax.set_ylim(1, max(chain + 1, max(taus)) + 0.05)
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no validation", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("step")
    ax.set_ylabel("tokens per verification")
    ax.set_title("simulated chain acceptance length (T=0)")
