"""Chat records in the two common JSON shapes, read with errors that name the file and line.

A conversation is ``list[{"role": "system"|"user"|"assistant", "content": str}]``. Records come as ShareGPT
(``conversations`` of ``from`` / ``value``) or OpenAI (``messages`` of ``role`` / ``content``) objects, in a JSON
list, a single JSON object, or JSONL (optionally gzipped). Used by training sources and evaluation prompt sets alike.
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from eagle.errors import EagleError

Message = dict[str, str]

ROLE_NAMES: dict[str, str] = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
}


def _content_text(content: Any, where: str) -> str:
    """Message content as a string (OpenAI content-part lists are joined)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise EagleError(
        f"{where}: message content must be a string or a list of text parts, got {type(content).__name__}; "
        "convert the record to plain-text messages"
    )


def parse_record(record: Any, where: str) -> list[Message]:
    """A ShareGPT (``conversations`` of ``from``/``value``) or OpenAI (``messages`` of ``role``/``content``) record.

    The style is detected per record and per message; role names are mapped with ``ROLE_NAMES``. ``where`` (e.g.
    ``"data.jsonl line 7"``) is named in every error.
    """
    if not isinstance(record, dict):
        raise EagleError(f"{where}: expected a JSON object, got {type(record).__name__}")
    turns = record.get("conversations", record.get("messages"))
    if not isinstance(turns, list):
        raise EagleError(
            f"{where}: expected a 'conversations' (ShareGPT) or 'messages' (OpenAI) list; "
            f"found keys {sorted(record)[:8]}"
        )
    messages: list[Message] = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise EagleError(f"{where}: message {i} is not an object")
        name = turn.get("from", turn.get("role"))
        role = ROLE_NAMES.get(str(name).strip().lower()) if name is not None else None
        if role is None:
            raise EagleError(
                f"{where}: message {i} has unknown role {name!r}; known roles: {sorted(ROLE_NAMES)} "
                "(rename or drop such messages before preparing)"
            )
        content = turn.get("value", turn.get("content"))
        if content is None:
            raise EagleError(f"{where}: message {i} has no 'value' or 'content'")
        messages.append({"role": role, "content": _content_text(content, f"{where} message {i}")})
    return messages


def read_text(path: Path) -> str:
    """A file's text; missing, non-UTF-8 and empty files raise EagleError naming the file (and line)."""
    if not path.is_file():
        raise EagleError(f"data file {str(path)!r} does not exist; check the path (or use a named source)")
    raw = path.read_bytes()
    if path.suffix == ".gz":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as e:
            raise EagleError(
                f"{path} is not a complete gzip file ({e}); download or compress it again"
            ) from e
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise EagleError(
            f"{path} line {line}: not valid UTF-8 ({e.reason}); re-encode the file as UTF-8"
        ) from e
    if not text.strip():
        raise EagleError(f"{path} is empty; give a file with at least one record")
    return text


def iter_json_records(path: str | Path) -> Iterator[tuple[str, Any]]:
    """``(where, record)`` from a JSON list, a single JSON object, or JSONL (blank lines skipped).

    ``where`` names the file and the line (JSONL) or record number (JSON list) for error messages.
    """
    path = Path(path)
    text = read_text(path)
    if text.lstrip().startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise EagleError(f"{path} line {e.lineno}: invalid JSON ({e.msg})") from e
        if not isinstance(data, list):
            raise EagleError(f"{path}: expected a JSON list of records")
        for i, record in enumerate(data):
            yield f"{path} record {i + 1}", record
        return
    first = True
    # split on "\n" only: str.splitlines would also break at U+2028 etc., which JSON strings may hold raw
    for n, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if first:  # maybe one pretty-printed object rather than JSONL
                try:
                    record = json.loads(text)
                except json.JSONDecodeError:
                    record = None
                if isinstance(record, dict):
                    yield f"{path} record 1", record
                    return
            raise EagleError(f"{path} line {n}: invalid JSON ({e.msg}); fix or remove that line") from e
        first = False
        yield f"{path} line {n}", record


def read_chat_file(path: str | Path) -> Iterator[list[Message]]:
    """Conversations from a ShareGPT/OpenAI-style JSON list or JSONL file."""
    for _, messages in chat_file_items(Path(path)):
        yield messages


def chat_file_items(path: Path) -> Iterator[tuple[str, list[Message]]]:
    for i, (where, record) in enumerate(iter_json_records(path)):
        yield f"{path}:{i}", parse_record(record, where)
