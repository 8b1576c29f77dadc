"""``eagle export``: a trained head -> ``model.safetensors`` + ``config.json`` + a model card, in the layout a
serving engine loads (eagle3 for vLLM and SGLang, speculators, or eagle1).

Reads the ``export`` section, plus ``target`` (the exact target the head was trained against, recorded in the
export), ``data`` and the training run's own records (for the model card) and ``eval.vllm`` (the chain length
written into a speculators config).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from eagle.errors import EagleError
from recipes.config import RunConfig
from recipes.console import console, setup_logging


def run(cfg: RunConfig) -> Path:
    """Export ``export.checkpoint`` to ``export.output_dir``; returns the output folder."""
    from eagle.export import export_head
    from eagle.heads import HeadConfig, build_head
    from eagle.targets import load_target, provenance
    from train.checkpoint import load_head_files

    setup_logging()
    src = Path(cfg.export.checkpoint)
    if not src.is_dir():
        raise EagleError(
            f"no trained head at {src}: run `eagle train` first, or pass --checkpoint <dir with model.safetensors>"
        )
    state, head_cfg = load_head_files(src)
    head = build_head(HeadConfig.from_dict(head_cfg))
    head.load_state_dict(state, strict=True)
    # only the weights and config are read here: no attention kernel the training machine asked for is needed
    target = load_target(replace(cfg.target, dtype="float32", device="cpu", attention="auto"))
    info = provenance(cfg.target.name, target, dtype=cfg.collect.target_dtype or cfg.target.dtype)
    out = export_head(
        head,
        cfg.export.output_dir,
        layout=cfg.export.layout,
        dtype=cfg.export.dtype,
        target=target,
        speculative_tokens=cfg.eval.vllm.num_speculative_tokens,
        verifier_name=info["path"],  # vLLM serves a speculators folder with this target: it must load as is
        target_info=info,
        training=training_summary(cfg, src),
    )
    console().print(f"[bold]export[/]: {cfg.export.layout} layout written to {out}")
    return out


def training_summary(cfg: RunConfig, head_dir: Path) -> dict[str, Any]:
    """What the model card says of the data and training, from the run's own records (missing ones left out)."""
    out: dict[str, Any] = {}
    meta = _read_json(Path(cfg.data.output_dir) / "prepare_meta.json")
    if meta:
        out["data sources"] = ", ".join(cfg.data.sources)
        out["conversations (train / val)"] = f"{meta['counts'].get('train')} / {meta['counts'].get('val')}"
        out["answers written by the target"] = "yes (regenerated)" if meta.get("regenerate") else "no"
        out["tokens (train)"] = f"{(meta.get('tokens') or {}).get('train', 0):,}"
    info = _read_json(head_dir / "train_info.json")
    if info:
        out["training steps"] = info.get("global_step")
        if info.get("epochs") is not None:
            out["epochs"] = f"{info['epochs']:.1f}"
        if info.get("seconds") is not None:
            out["training time"] = f"{info['seconds'] / 60:.1f} min"
        out.update(_validation_rows(info))
    return out


def _validation_rows(info: dict[str, Any]) -> dict[str, Any]:
    """The card's rows on validation: which step's weights these are (``train.keep_best``), their top-1 per TTT
    step and their simulated chain tau."""
    out: dict[str, Any] = {}
    best = info.get("best")
    if best and best.get("step") is not None:
        out["weights"] = (f"step {best['step']} of {info.get('global_step')}: the best validation "
                          f"{best['metric']} (train.keep_best)")
    metrics = info.get("eval") or {}
    acc = {k: v for k, v in metrics.items() if k.startswith("val_acc_")}
    if acc:
        ordered = sorted(acc.items(), key=lambda kv: int(kv[0].rsplit("_", 1)[1]))
        out["validation top-1 per TTT step"] = " / ".join(f"{v:.3f}" for _, v in ordered)
    if isinstance(metrics.get("sim_tau"), int | float):
        chain = sum(1 for k in metrics if k.startswith("sim_accept_"))
        out[f"validation sim tau (a chain of {chain} draft{'s' if chain != 1 else ''}, T=0)"] = (
            f"{metrics['sim_tau']:.3f}")
    return out


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None

