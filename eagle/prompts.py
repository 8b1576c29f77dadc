"""Evaluation prompt sets: named sets, JSONL files or Hugging Face data, rendered into token ids with the target's
chat template.

A prompts file holds one JSON object per line, in any of these shapes (each with an optional ``"id"``):

- ``{"messages": [...]}`` or ShareGPT ``{"conversations": [...]}``: rendered with the chat template, the
  generation prompt added;
- ``{"prompt": "..."}``: raw text;
- ``{"turns": ["...", "..."], "category": "..."}`` (MT-bench's and Spec-Bench's question files): the first turn
  is asked, each later one after the target's own answer to the one before;
- ``{"question": "..."}`` (GSM8K) and ``{"instruction": "...", "input": "..."}`` (Alpaca): one user turn.

``hf:<path-or-hub-id>[:split]`` reads the same shapes from a Hugging Face dataset (a data file, a ``save_to_disk``
folder, or a hub id when online). Named sets: ``dev-chat`` and ``dev-code`` (the public development set,
shipped in the package), ``humaneval``, ``mt-bench`` (80 two-turn questions in 8 categories) and
``chitchat-eval`` (the chitchat evaluation reserve). None of them is ever training data (:func:`evaluation_texts`
lets the training sources refuse them by content).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from functools import cache
from pathlib import Path
from typing import Any, NamedTuple

from eagle.datasets import (
    DEV_SETS,
    chitchat_eval_prompts,
    dev_set_path,
    humaneval_prompts,
    load_hf_dataset,
    mtbench_prompts,
)
from eagle.errors import EagleError
from eagle.records import iter_json_records, parse_record

NAMED_PROMPT_SETS: dict[str, Callable[[], list[dict[str, Any]]]] = {
    **{name: (lambda name=name: load_prompts(dev_set_path(name))) for name in DEV_SETS},
    "humaneval": humaneval_prompts,
    "mt-bench": mtbench_prompts,
    "chitchat-eval": chitchat_eval_prompts,
}
# sets from packages a user may not have installed: the others come with the project itself
OPTIONAL_SETS = {"mt-bench"}


class EvalPrompt(NamedTuple):
    """One evaluation prompt, tokenized. ``ids`` is the turn to answer now; ``follow_ups`` are the user turns
    still to come, each asked after the target's own answer to the one before (:func:`next_turn`)."""

    id: str
    ids: list[int]
    category: str | None = None
    messages: tuple[dict[str, str], ...] = ()  # the conversation up to this turn (empty for raw text prompts)
    follow_ups: tuple[str, ...] = ()
    turn: int = 1


def load_prompts(name_or_path: str | Path) -> list[dict[str, Any]]:
    """Evaluation prompts of a named set, a JSONL file or ``hf:<dataset>[:split]``: dicts with ``id`` and
    ``messages`` or ``prompt`` (plus ``category`` and ``follow_ups`` for multi-turn questions)."""
    if isinstance(name_or_path, str) and name_or_path in NAMED_PROMPT_SETS:
        return NAMED_PROMPT_SETS[name_or_path]()
    if isinstance(name_or_path, str) and name_or_path.startswith("hf:"):
        return [prompt_of_record(r, f"{name_or_path} row {n}", f"{n}") for n, r in enumerate(_hf_rows(name_or_path))]
    path = Path(name_or_path)
    if not path.is_file():
        raise EagleError(
            f"prompts file {str(path)!r} does not exist; give a JSONL file, hf:<dataset>[:split] or one of "
            f"{sorted(NAMED_PROMPT_SETS)}"
        )
    return [prompt_of_record(record, where, f"{path.stem}-{n}")
            for n, (where, record) in enumerate(iter_json_records(path), start=1)]


def prompt_of_record(record: Any, where: str, default_id: str) -> dict[str, Any]:
    """One prompt from a record in any of the module docstring's shapes; EagleError naming ``where`` otherwise."""
    if not isinstance(record, dict):
        raise EagleError(f"{where}: expected a JSON object with 'messages', 'prompt', 'turns', 'question' or "
                         "'instruction'")
    pid = str(record.get("id", record.get("question_id", default_id)))
    category = {"category": str(record["category"])} if record.get("category") is not None else {}
    if isinstance(record.get("prompt"), str):
        return {"id": pid, "prompt": record["prompt"], **category}
    if "messages" in record or "conversations" in record:
        messages = parse_record(record, where)
        if not messages:
            raise EagleError(f"{where}: 'messages' is empty")
        return {"id": pid, "messages": messages, **category}
    turns = _user_turns(record, where)
    if turns is None:
        raise EagleError(f"{where}: expected 'messages', 'prompt', 'turns' (MT-bench, Spec-Bench), 'question' "
                         f"(GSM8K) or 'instruction' (Alpaca); found keys {sorted(record)[:8]}")
    return {"id": pid, "messages": [{"role": "user", "content": turns[0]}], "follow_ups": turns[1:], **category}


def _user_turns(record: dict[str, Any], where: str) -> list[str] | None:
    """The user turns of an MT-bench / Spec-Bench (``turns``), GSM8K (``question``) or Alpaca (``instruction``
    plus optional ``input``) record; None for none of these shapes."""
    if "turns" in record:
        turns = record["turns"]
    elif "question" in record:
        turns = [record["question"]]
    elif "instruction" in record:
        extra = record.get("input") or ""
        turns = [f"{record['instruction']}\n\n{extra}" if extra else record["instruction"]]
    else:
        return None
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        raise EagleError(f"{where}: the question's turns must be non-empty strings, got {turns!r:.80}")
    return turns


def _hf_rows(spec: str) -> Any:
    """The rows of ``hf:<path-or-hub-id>[:config]:split`` or ``hf:<path-or-hub-id>[:split]`` (a local file or
    folder, or a hub id when online; a split may slice, ``test[:100]``)."""
    rest = spec[3:]
    if not rest:
        raise EagleError("prompts 'hf:' needs a dataset: hf:<path-or-hub-id>[:config][:split]")
    if Path(rest).exists():
        return load_hf_dataset(rest, None)
    path, _, tail = rest.partition(":")
    head, _, after = tail.partition(":")
    name, split = (head, after) if after and "[" not in head else (None, tail or None)
    return load_hf_dataset(path, split, name)


def set_names(specs: Sequence[str]) -> list[str]:
    """A short unique name per prompts spec: named sets keep their name, files their stem."""
    names: list[str] = []
    for spec in specs:
        base = spec if spec in NAMED_PROMPT_SETS else Path(spec.removeprefix("hf:").split(":")[0]).stem
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


def load_eval_prompts(specs: Sequence[str], tokenizer: Any, max_prompts: int | None = None
                      ) -> list[tuple[str, list[EvalPrompt]]]:
    """``[(set name, [EvalPrompt, ...]), ...]`` for every prompts spec (at most ``max_prompts`` each)."""
    out = []
    for name, spec in zip(set_names(specs), specs):
        prompts = load_prompts(spec)
        if not prompts:
            raise EagleError(f"prompts file {spec!r} holds no prompts: add JSONL lines or drop it from eval.prompts")
        if max_prompts is not None:
            prompts = prompts[:max_prompts]
        out.append((name, [EvalPrompt(str(p["id"]), prompt_token_ids(p, tokenizer), p.get("category"),
                                      tuple(p.get("messages", ())), tuple(p.get("follow_ups", ())))
                           for p in prompts]))
    return out


def load_prompt_sets(specs: Sequence[str], tokenizer: Any, max_prompts: int | None = None
                     ) -> list[tuple[str, list[tuple[str, list[int]]]]]:
    """``[(set name, [(prompt id, token ids), ...]), ...]``: the first turns of :func:`load_eval_prompts`."""
    return [(name, [(p.id, p.ids) for p in prompts])
            for name, prompts in load_eval_prompts(specs, tokenizer, max_prompts)]


def next_turn(prompt: EvalPrompt, answer: str, tokenizer: Any) -> EvalPrompt:
    """The prompt's next turn: its conversation, the target's ``answer`` to this turn, then the next user turn
    (how MT-bench asks its second question)."""
    if not prompt.follow_ups or not prompt.messages:
        raise EagleError(f"prompt {prompt.id!r} has no next turn")
    messages = (*prompt.messages, {"role": "assistant", "content": answer},
                {"role": "user", "content": prompt.follow_ups[0]})
    ids = prompt_token_ids({"id": prompt.id, "messages": list(messages)}, tokenizer)
    return prompt._replace(ids=ids, messages=messages, follow_ups=prompt.follow_ups[1:], turn=prompt.turn + 1)


def text_key(text: str) -> str:
    """A whitespace- and case-insensitive digest of a prompt's text (how evaluation data is recognised)."""
    return hashlib.sha256(" ".join(text.split()).lower().encode("utf-8")).hexdigest()[:24]


@cache
def evaluation_texts() -> frozenset[str]:
    """:func:`text_key` of every user message of every named evaluation set."""
    keys = set()
    for name, load in NAMED_PROMPT_SETS.items():
        try:
            prompts = load()
        except EagleError:
            if name in OPTIONAL_SETS:  # not installed here, so not evaluated here either
                continue
            raise
        for prompt in prompts:
            texts = [m["content"] for m in prompt.get("messages", []) if m["role"] == "user"]
            texts += list(prompt.get("follow_ups", [])) + ([prompt["prompt"]] if "prompt" in prompt else [])
            keys.update(text_key(t) for t in texts)
    return frozenset(keys)
