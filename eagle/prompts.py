"""Evaluation prompt sets: named sets or JSONL files, rendered into token ids with the target's chat template.

A prompts file holds one JSON object per line: ``{"messages": [...]}`` (rendered with the chat template, the
generation prompt added) or ``{"prompt": "..."}`` (raw text), each with an optional ``"id"``. Named sets:
``dev-chat`` and ``dev-code`` (the public development set, shipped in the package), ``humaneval`` and
``chitchat-eval`` (the chitchat evaluation reserve). None of them is ever training data (:func:`evaluation_texts`
lets the training sources refuse them by content).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from functools import cache
from pathlib import Path
from typing import Any

from eagle.datasets import DEV_SETS, chitchat_eval_prompts, dev_set_path, humaneval_prompts
from eagle.errors import EagleError
from eagle.records import iter_json_records, parse_record

NAMED_PROMPT_SETS: dict[str, Callable[[], list[dict[str, Any]]]] = {
    **{name: (lambda name=name: load_prompts(dev_set_path(name))) for name in DEV_SETS},
    "humaneval": humaneval_prompts,
    "chitchat-eval": chitchat_eval_prompts,
}


def load_prompts(name_or_path: str | Path) -> list[dict[str, Any]]:
    """Evaluation prompts of a named set or a JSONL file: dicts with ``id`` and ``messages`` or ``prompt``."""
    if isinstance(name_or_path, str) and name_or_path in NAMED_PROMPT_SETS:
        return NAMED_PROMPT_SETS[name_or_path]()
    path = Path(name_or_path)
    if not path.is_file():
        raise EagleError(
            f"prompts file {str(path)!r} does not exist; give a JSONL file or one of {sorted(NAMED_PROMPT_SETS)}"
        )
    prompts: list[dict[str, Any]] = []
    for n, (where, record) in enumerate(iter_json_records(path), start=1):
        if not isinstance(record, dict):
            raise EagleError(f"{where}: expected a JSON object with 'messages' or 'prompt'")
        pid = str(record.get("id", f"{path.stem}-{n}"))
        if isinstance(record.get("prompt"), str):
            prompts.append({"id": pid, "prompt": record["prompt"]})
        elif "messages" in record or "conversations" in record:
            messages = parse_record(record, where)
            if not messages:
                raise EagleError(f"{where}: 'messages' is empty")
            prompts.append({"id": pid, "messages": messages})
        else:
            raise EagleError(f"{where}: expected a 'messages' list or a 'prompt' string")
    return prompts


def set_names(specs: Sequence[str]) -> list[str]:
    """A short unique name per prompts spec: named sets keep their name, files their stem."""
    names: list[str] = []
    for spec in specs:
        base = spec if spec in NAMED_PROMPT_SETS else Path(spec).stem
        name, n = base, 2
        while name in names or name == "overall":
            name, n = f"{base}-{n}", n + 1
        names.append(name)
    return names


def prompt_token_ids(prompt: dict[str, Any], tokenizer: Any) -> list[int]:
    """Token ids of one evaluation prompt: ``messages`` through the chat template (generation prompt added),
    ``prompt`` as raw text (with the tokenizer's usual special tokens)."""
    if "messages" in prompt:
        if not getattr(tokenizer, "chat_template", None):
            raise EagleError(
                f"prompt {prompt.get('id')!r} has 'messages' but the target's tokenizer has no chat template; "
                'use raw {"prompt": "..."} lines for this target'
            )
        text = tokenizer.apply_chat_template(prompt["messages"], add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer(prompt["prompt"])["input_ids"]
    if not ids:
        raise EagleError(f"prompt {prompt.get('id')!r} is empty after tokenization: remove it from the file")
    return [int(i) for i in ids]


def load_prompt_sets(specs: Sequence[str], tokenizer: Any, max_prompts: int | None = None
                     ) -> list[tuple[str, list[tuple[str, list[int]]]]]:
    """``[(set name, [(prompt id, token ids), ...]), ...]`` for every prompts spec (at most ``max_prompts`` each)."""
    out = []
    for name, spec in zip(set_names(specs), specs):
        prompts = load_prompts(spec)
        if not prompts:
            raise EagleError(f"prompts file {spec!r} holds no prompts: add JSONL lines or drop it from eval.prompts")
        if max_prompts is not None:
            prompts = prompts[:max_prompts]
        out.append((name, [(str(p["id"]), prompt_token_ids(p, tokenizer)) for p in prompts]))
    return out


def text_key(text: str) -> str:
    """A whitespace- and case-insensitive digest of a prompt's text (how evaluation data is recognised)."""
    return hashlib.sha256(" ".join(text.split()).lower().encode("utf-8")).hexdigest()[:24]


@cache
def evaluation_texts() -> frozenset[str]:
    """:func:`text_key` of every user message of every named evaluation set."""
    keys = set()
    for load in NAMED_PROMPT_SETS.values():
        for prompt in load():
            for message in prompt.get("messages", []):
                if message["role"] == "user":
                    keys.add(text_key(message["content"]))
            if "prompt" in prompt:
                keys.add(text_key(prompt["prompt"]))
    return frozenset(keys)
