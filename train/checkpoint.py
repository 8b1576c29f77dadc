"""Atomic training checkpoints and exact resume.

Layout of ``<output_dir>/checkpoints``::

    latest                    name of the newest complete checkpoint (replaced atomically)
    step-0000500/
        model.safetensors     the head's weights (+ d2t/t2d for eagle3), consolidated even under ZeRO-3
        head_config.json      HeadConfig (kind, shapes, aux layers, target name + fingerprint)
        draft_vocab.safetensors   eagle3: d2t / t2d
        optimizer.pt          AdamW state (plain DDP / one process)
        deepspeed/            DeepSpeed's own optimizer shards (under DeepSpeed, instead of optimizer.pt)
        scheduler.pt          LR scheduler state
        rng/rank-00000.pt     torch / numpy / python / cuda RNG states of each process
        trainer_state.json    data position (epoch, batch in epoch), global step, tokens seen, ... (written last)

A checkpoint is written into ``.tmp-step-NNNNNNN``, every file fsynced, and renamed into place; only then does
``latest`` move. A crash at any point leaves either the old or the new checkpoint, never half of one. Every
``.pt`` file holds only tensors and plain Python values, so it loads with ``torch.load(weights_only=True)``;
DeepSpeed's own files (which DeepSpeed reads with full pickle) are vetted the same way before it sees them.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import random
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eagle.errors import EagleError
from eagle.fileio import fsync_dir, remove_stale_temps, write_json_atomic, write_text_atomic
from train.vocab import VOCAB_FILE, save_vocab

STATE_FILE = "trainer_state.json"
INFO_FILE = "train_info.json"  # what a head folder (final/, best/) says of its training
MODEL_FILE = "model.safetensors"
HEAD_CONFIG_FILE = "head_config.json"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
DEEPSPEED_DIR = "deepspeed"
LATEST = "latest"
_STEP_RE = re.compile(r"^step-(\d{7,})$")


def step_dir_name(step: int) -> str:
    """``step-0000500``."""
    return f"step-{step:07d}"


# --------------------------------------------------------------------------------------------- file helpers


def fsync_tree(path: Path) -> None:
    """fsync every file and directory under ``path`` (and ``path`` itself)."""
    for root, _dirs, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb+") as fh:
                os.fsync(fh.fileno())
        fsync_dir(root)


def remove_tree(path: Path) -> None:
    """Delete a directory so that no half-deleted ``step-*`` directory is ever visible: rename it first."""
    if not path.exists():
        return
    trash = path.with_name(f".trash-{path.name}-{uuid.uuid4().hex[:8]}")
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def replace_dir(tmp: Path, final: Path) -> None:
    """Move a finished directory into place (an existing one of the same name is moved aside first)."""
    fsync_tree(tmp)
    if final.exists():
        remove_tree(final)
    os.replace(tmp, final)
    fsync_dir(final.parent)


# ------------------------------------------------------------------------------------------------ weights


def save_head_files(
    directory: Path, state_dict: dict[str, torch.Tensor], head_config: dict, vocab: tuple | None
) -> None:
    """Write ``model.safetensors``, ``head_config.json`` and (eagle3) ``draft_vocab.safetensors``."""
    from safetensors.torch import save_file


    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()}
    save_file(tensors, str(directory / MODEL_FILE), metadata={"format": "pt"})
    write_json_atomic(head_config, directory / HEAD_CONFIG_FILE)
    if vocab is not None:
        save_vocab(directory / VOCAB_FILE, *vocab)


def write_head_folder(
    folder: Path, state_dict: dict[str, torch.Tensor], head_config: dict, vocab: tuple | None, info: dict
) -> Path:
    """A head folder (``final/``, ``best/``: the head files plus ``train_info.json``) built aside, fsynced and
    renamed into place, so that a crash leaves the old folder or the new one, never half of one."""
    tmp = folder.with_name(f".{folder.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with write_guard(f"the head {folder}", tmp):  # the old folder stays until replaced
        tmp.mkdir(parents=True)
        save_head_files(tmp, state_dict, head_config, vocab)
        write_json_atomic(info, tmp / INFO_FILE)
        replace_dir(tmp, folder)
    return folder


def read_info(folder: Path) -> dict:
    """The ``train_info.json`` of a head folder ({} when it has none or it is unreadable)."""
    try:
        info = json.loads((folder / INFO_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def load_head_files(directory: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict]:
    """``(state_dict, head_config dict)`` of a head folder (a checkpoint or ``final/``)."""
    from safetensors.torch import load_file

    directory = Path(directory)
    model, config = directory / MODEL_FILE, directory / HEAD_CONFIG_FILE
    if not model.is_file() or not config.is_file():
        raise EagleError(
            f"{directory} is not a head folder ({MODEL_FILE} and {HEAD_CONFIG_FILE} expected): point at a "
            "checkpoint (checkpoints/step-*) or a run's final/ folder"
        )
    try:
        return load_file(str(model)), json.loads(config.read_text(encoding="utf-8"))
    except Exception as exc:
        raise EagleError(f"{directory} holds an unreadable head ({exc}): use another checkpoint") from exc


# -------------------------------------------------------------------------------------------------- RNG


def rng_state() -> dict[str, Any]:
    """This process's RNG states as tensors and plain values (``weights_only`` loadable)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "kind": str(kind),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "python": {
            "version": int(version),
            "internal": torch.tensor(internal, dtype=torch.int64),
            "gauss_next": gauss_next,
        },
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"])
    npst = state["numpy"]
    np.random.set_state(
        (
            npst["kind"],
            npst["keys"].numpy().astype(np.uint32),
            npst["pos"],
            npst["has_gauss"],
            npst["cached_gaussian"],
        )
    )
    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["internal"].tolist()), py["gauss_next"]))
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)


def rng_file(directory: Path, rank: int) -> Path:
    return directory / "rng" / f"rank-{rank:05d}.pt"


def save_pt(obj: Any, path: Path) -> None:
    """torch.save + fsync."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as fh:
        torch.save(obj, fh)
        fh.flush()
        os.fsync(fh.fileno())


def _reason(exc: Exception) -> str:
    """The informative line of a torch.load error (its boilerplate suggests weights_only=False: never here)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    for line in lines:
        if "GLOBAL" in line or line.startswith("Unsupported"):
            return line
    if isinstance(exc, pickle.UnpicklingError) or not lines:
        return f"{type(exc).__name__}: not a plain tensor file"
    return lines[0]


def load_pt(path: Path, allowed_globals: list | None = None) -> Any:
    """torch.load with ``weights_only=True``: never unpickles arbitrary objects (a planted pickle is refused
    before any of it runs). ``allowed_globals`` admits a few more plain data classes (DeepSpeed's)."""
    try:
        with torch.serialization.safe_globals(allowed_globals or []):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise EagleError(
            f"{path} holds objects other than tensors and plain values, so it was refused without running it "
            f"({_reason(exc)}): resume from a checkpoint this tool wrote (train.resume=<dir>) or start fresh "
            "(train.resume=never)"
        ) from exc
    except Exception as exc:
        raise EagleError(
            f"{path} is unreadable ({_reason(exc)}): resume from another checkpoint (train.resume=<dir>) or "
            "start fresh (train.resume=never)"
        ) from exc


# DeepSpeed pickles a few of its own plain data classes into its optimizer states, and reads its files with
# full pickle: every file is vetted by the weights-only unpickler (admitting only these) before DeepSpeed sees it.
_DEEPSPEED_GLOBALS = (
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaleConfig"),
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaleProfile"),
    ("deepspeed.utils.tensor_fragment", "fragment_address"),
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"),
)


def vet_deepspeed_files(directory: Path) -> None:
    """Refuse a DeepSpeed checkpoint folder whose ``.pt`` files hold anything but tensors, plain values and
    DeepSpeed's own data classes (EagleError), so that DeepSpeed's unrestricted ``torch.load`` runs no code."""
    import importlib

    # names missing from this DeepSpeed version cannot occur in its files
    found = (getattr(importlib.import_module(module), name, None) for module, name in _DEEPSPEED_GLOBALS)
    allowed = [cls for cls in found if cls is not None]
    for path in sorted(directory.rglob("*.pt")):
        load_pt(path, allowed)


@contextlib.contextmanager
def write_guard(what: str, partial: Path | None = None):
    """Turn a failed write of ``what`` (disk full, quota, I/O error) into a clear EagleError after removing the
    partial output ``partial``; what was complete before (earlier checkpoints) stays untouched.

    A full disk shows up as OSError, as RuntimeError from torch.save and as SafetensorError from safetensors."""
    from safetensors import SafetensorError

    try:
        yield
    except (OSError, RuntimeError, SafetensorError) as exc:
        if partial is not None:
            shutil.rmtree(partial, ignore_errors=True)
        reason = getattr(exc, "strerror", None) or (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        where = partial.parent if partial is not None else Path(".")
        try:
            free = f"{shutil.disk_usage(where).free / 1e6:.1f} MB free there"
        except OSError:
            free = "free space unknown"
        raise EagleError(
            f"could not write {what} ({reason}; {free}): free disk space (or move train.output_dir) and rerun "
            "the same command; it resumes from the last complete checkpoint, which is intact"
        ) from exc


# ------------------------------------------------------------------------------------------ finding them


def checkpoint_step(path: Path) -> int | None:
    m = _STEP_RE.match(path.name)
    return int(m.group(1)) if m else None


def is_complete(path: Path) -> bool:
    """A checkpoint directory with a readable trainer state and weights (names are only ever renamed in
    complete, so this mostly guards against hand-made or truncated copies)."""
    try:
        state = json.loads((path / STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    has_optim = (path / OPTIMIZER_FILE).is_file() or (path / DEEPSPEED_DIR).is_dir()
    return isinstance(state, dict) and "global_step" in state and (path / MODEL_FILE).is_file() and has_optim


def list_checkpoints(root: Path) -> list[Path]:
    """Complete ``step-*`` directories under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = [(checkpoint_step(p), p) for p in root.iterdir() if p.is_dir() and checkpoint_step(p) is not None]
    return [p for _, p in sorted(found) if is_complete(p)]


def find_latest(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint: the ``latest`` pointer when it names one, else the highest step."""
    root = Path(root)
    pointer = root / LATEST
    if pointer.is_file():
        name = pointer.read_text(encoding="utf-8").strip()
        candidate = root / name
        if name and _STEP_RE.match(name) and is_complete(candidate):
            newer = [p for p in list_checkpoints(root) if checkpoint_step(p) > checkpoint_step(candidate)]
            return newer[-1] if newer else candidate
    found = list_checkpoints(root)
    return found[-1] if found else None


def prune(root: Path, keep_last: int | None, protect: Path | None = None) -> list[Path]:
    """Delete all but the newest ``keep_last`` checkpoints (never ``protect``); returns what was deleted."""
    if keep_last is None or keep_last <= 0:
        return []
    found = list_checkpoints(root)
    doomed = [p for p in found[:-keep_last] if protect is None or p.resolve() != protect.resolve()]
    for path in doomed:
        remove_tree(path)
    return doomed


def clean_stale(root: Path) -> None:
    """Remove temporary directories left by a crash while writing or deleting a checkpoint, and next to the
    checkpoints, those of the head folders (``.final.tmp``, ``.best.tmp``, ``.trash-final-*``, ...)."""
    if root.parent.is_dir():
        for name in ("final", "best"):
            for path in root.parent.glob(f".trash-{name}-*"):
                shutil.rmtree(path, ignore_errors=True)
            shutil.rmtree(root.parent / f".{name}.tmp", ignore_errors=True)
    if not root.is_dir():
        return
    for path in root.iterdir():
        if path.name.startswith((".tmp-step-", ".trash-")):
            shutil.rmtree(path, ignore_errors=True)
    remove_stale_temps(root / LATEST)


def read_state(path: Path) -> dict:
    """The ``trainer_state.json`` of a checkpoint."""
    try:
        return json.loads((path / STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise EagleError(
            f"{path} is not a complete checkpoint ({STATE_FILE} unreadable: {exc}): resume from another one "
            "(train.resume=<dir>) or start fresh (train.resume=never)"
        ) from exc


# ------------------------------------------------------------------------------------- save / load (all ranks)


def save_checkpoint(
    root: Path,
    step: int,
    *,
    accelerator: Any,
    engine: Any,
    head_state: dict[str, torch.Tensor],
    head_config: dict,
    vocab: tuple | None,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    trainer_state: dict,
    keep_last: int | None,
) -> Path:
    """Write checkpoint ``step`` atomically; call on every process (``head_state`` matters on the main one).

    ``engine`` is the DeepSpeed engine when training under DeepSpeed (its optimizer shards are saved by
    DeepSpeed itself, from every process), else None.
    """
    main = accelerator.is_main_process
    final = root / step_dir_name(step)
    tmp = root / f".tmp-{step_dir_name(step)}"
    accelerator.wait_for_everyone()
    if main:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    accelerator.wait_for_everyone()
    with write_guard(f"checkpoint {final}", tmp):
        save_pt(rng_state(), rng_file(tmp, accelerator.process_index))
        if engine is not None:
            engine.save_checkpoint(str(tmp / DEEPSPEED_DIR), tag="state", save_latest=False)
        if main:
            save_head_files(tmp, head_state, head_config, vocab)
            if engine is None:
                save_pt(optimizer.state_dict(), tmp / OPTIMIZER_FILE)
            save_pt(scheduler.state_dict(), tmp / SCHEDULER_FILE)
    accelerator.wait_for_everyone()
    if main:
        with write_guard(f"checkpoint {final}", tmp):
            write_json_atomic(trainer_state, tmp / STATE_FILE)  # last: marks the content complete
            replace_dir(tmp, final)
            write_text_atomic(final.name + "\n", root / LATEST)
            prune(root, keep_last, protect=final)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(
    path: Path, *, accelerator: Any, engine: Any, optimizer: torch.optim.Optimizer, scheduler: Any
) -> dict:
    """Restore optimizer, scheduler and (DeepSpeed) engine state from ``path``; returns the trainer state.
    Weights are loaded by the caller from ``model.safetensors`` (before the model is wrapped); the RNG states
    by :func:`restore_rng` as the very last step before training resumes."""
    state = read_state(path)
    if engine is not None:
        if not (path / DEEPSPEED_DIR).is_dir():
            raise EagleError(
                f"{path} was not written under DeepSpeed (no {DEEPSPEED_DIR}/ folder): resume it without "
                "train.deepspeed, or start fresh with train.resume=never"
            )
        vet_deepspeed_files(path / DEEPSPEED_DIR)
        engine.load_checkpoint(
            str(path / DEEPSPEED_DIR), tag="state", load_optimizer_states=True, load_lr_scheduler_states=False
        )
    else:
        if not (path / OPTIMIZER_FILE).is_file():
            raise EagleError(
                f"{path} was written under DeepSpeed ({OPTIMIZER_FILE} missing): resume it with the same "
                "train.deepspeed config, or start fresh with train.resume=never"
            )
        optimizer.load_state_dict(load_pt(path / OPTIMIZER_FILE))
    scheduler.load_state_dict(load_pt(path / SCHEDULER_FILE))
    return state


def restore_rng(path: Path, rank: int) -> bool:
    """Restore this process's RNG states from checkpoint ``path``; False when it has none for this rank
    (e.g. resumed with more processes)."""
    file = rng_file(path, rank)
    if not file.is_file():
        return False
    set_rng_state(load_pt(file))
    return True


def resolve_resume(resume: str, root: Path) -> Path | None:
    """The checkpoint ``train.resume`` names (auto: the latest in ``root``; never: None, a fresh start)."""

    if resume == "never":
        return None
    if resume == "auto":
        return find_latest(root)
    path = Path(resume)
    if path.is_dir() and is_complete(path):
        return path
    for candidate in (path, path / "checkpoints"):
        found = find_latest(candidate) if candidate.is_dir() else None
        if found is not None:
            return found
    raise EagleError(
        f"train.resume={resume!r} is neither a complete checkpoint nor a folder holding one: pass a "
        "checkpoints/step-* folder, or use train.resume=auto / never"
    )


def check_head_matches(saved: dict, hcfg: Any, path: Path) -> None:
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
