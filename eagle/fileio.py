"""Durable small-file writes shared by every stage: a reader never sees half a file, a crash never loses one.

Each write goes to a unique temporary file in the same folder, is fsynced, renamed over the target, and the
folder is fsynced so that the rename itself survives a power cut.
"""

from __future__ import annotations

import io
import json
import os
import uuid
from pathlib import Path
from typing import Any


def fsync_dir(path: str | os.PathLike) -> None:
    """Make renames/creations inside ``path`` durable (best effort where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # not every filesystem lets a directory be synced
    finally:
        os.close(fd)


def _temp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")


def remove_stale_temps(path: str | os.PathLike) -> list[Path]:
    """Delete the temporary files a killed :func:`write_text_atomic` left next to ``path``; returns them.

    Call it only where no other live process may be writing ``path`` at the same moment."""
    path = Path(path)
    stale = sorted(path.parent.glob(f".{path.name}.*.tmp"))
    for p in stale:
        p.unlink(missing_ok=True)
    return stale


def write_bytes_atomic(data: bytes, path: str | os.PathLike) -> Path:
    """Write a file through a temporary file, fsync and rename; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # a unique name opened normally (not mkstemp, whose 0600 mode would stick to the file)
    tmp = _temp_name(path)
    try:
        with open(tmp, "xb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_text_atomic(text: str, path: str | os.PathLike) -> Path:
    """Write a UTF-8 text file atomically (see :func:`write_bytes_atomic`); returns the path."""
    return write_bytes_atomic(text.encode("utf-8"), path)


def save_figure_atomic(fig: Any, path: str | os.PathLike, **savefig_kwargs: Any) -> Path:
    """A matplotlib figure as PNG, written atomically (never a half-written image); returns the path."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", **savefig_kwargs)
    return write_bytes_atomic(buffer.getvalue(), path)


def write_json_atomic(data: Any, path: str | os.PathLike) -> Path:
    """Write ``data`` as indented JSON, atomically (see :func:`write_text_atomic`); returns the path."""
    return write_text_atomic(json.dumps(data, indent=2) + "\n", path)
