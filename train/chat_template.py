"""Rendering a conversation with the target's chat template, and finding what the loss trains on.

The loss mask covers each assistant message's content plus the end-of-turn token that closes it (not the role
header). It is found from character offsets in the rendered text, so it works with any chat template; no
``{% generation %}`` markers are needed.
"""

from __future__ import annotations

from typing import Any

from eagle.errors import EagleError
from eagle.records import Message


def check_template(tokenizer: Any) -> None:
    """Raise EagleError when the tokenizer has no chat template (the data cannot be rendered)."""
    if not getattr(tokenizer, "chat_template", None):
        raise EagleError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '?')!r} has no chat template; use an instruct/chat "
            "target, or set one (tokenizer.chat_template = '<jinja>' and save it, or add 'chat_template' to its "
            "tokenizer_config.json)"
        )


def render(
    tokenizer: Any, messages: list[Message], add_generation_prompt: bool = False, where: str = ""
) -> str:
    """The conversation rendered as text by the tokenizer's chat template."""
    check_template(tokenizer)
    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except Exception as e:  # jinja raise_exception(...) and friends: the template rejects this conversation
        raise EagleError(
            f"the chat template rejected conversation {where or '?'}: {e}; fix or drop that conversation"
        ) from e


def special_token_ids(tokenizer: Any) -> set[int]:
    """Ids of all special tokens (the standard ones plus added tokens flagged special)."""
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    for tid, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(added, "special", False):
            ids.add(int(tid))
    return ids


def _locate(text: str, content: str, start: int) -> tuple[int, int]:
    """Character span of ``content`` in ``text`` at or after ``start``; templates that trim content also match."""
    pos = text.find(content, start)
    if pos >= 0:
        return pos, pos + len(content)
    stripped = content.strip()
    pos = text.find(stripped, start) if stripped != content else -1
    return (pos, pos + len(stripped)) if pos >= 0 else (-1, -1)


_MARKER = "\u27e6eagle-content\u27e7"


def _marked_start(tokenizer: Any, messages: list[Message], i: int, text: str, where: str) -> int | None:
    """Where message ``i``'s content starts in ``text``, found by rendering the conversation with that content
    replaced by a marker: exact even when the same string also occurs earlier (say in the role header of a
    conversation that opens with an answer). None when the template does not render the content verbatim."""
    marked = [dict(m) for m in messages]
    marked[i]["content"] = _MARKER
    other = render(tokenizer, marked, where=where)
    start = other.find(_MARKER)
    content = messages[i]["content"]
    if start < 0 or other[:start] != text[:start] or text[start : start + len(content)] != content:
        return None
    if text[start + len(content) :] != other[start + len(_MARKER) :]:
        return None
    return start


def assistant_spans(
    tokenizer: Any, messages: list[Message], text: str, where: str = ""
) -> list[tuple[int, int]]:
    """Character spans of the assistant contents in the rendered ``text``.

    Each assistant content is searched after the rendered prefix (the messages before it plus the generation
    prompt), so a string that also occurs in a system prompt or an earlier user turn cannot be mistaken for it.
    """
    spans = []
    cursor = 0
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            start = _marked_start(tokenizer, messages, i, text, where)
            if start is not None:
                spans.append((start, start + len(message["content"])))
                cursor = start + len(message["content"])
                continue
        if message["role"] == "assistant" and i > 0:
            prefix = render(tokenizer, messages[:i], add_generation_prompt=True, where=where)
            if text.startswith(prefix):  # templates that rewrite history break this; fall back to the cursor
                cursor = max(cursor, len(prefix))
        start, end = _locate(text, message["content"], cursor)
        if start < 0:
            if message["role"] == "assistant":
                raise EagleError(
                    f"conversation {where or '?'}: the chat template changes assistant message {i}'s text, so its "
                    "loss mask cannot be found; use a template that renders message content verbatim"
                )
            continue
        if message["role"] == "assistant":
            spans.append((start, end))
        cursor = end
    return spans


def tokenize_conversation(
    tokenizer: Any, messages: list[Message], specials: set[int] | None = None, where: str = ""
) -> tuple[list[int], list[int]]:
    """``(input_ids, loss_mask)``: mask = 1 on assistant content tokens and the end-of-turn token after each."""
    text = render(tokenizer, messages, where=where)
    spans = assistant_spans(tokenizer, messages, text, where)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
    specials = special_token_ids(tokenizer) if specials is None else specials
    mask = [0] * len(ids)
    n, t = len(ids), 0
    for start, end in spans:
        while t < n and offsets[t][1] <= start:
            t += 1
        while end > start and t < n and offsets[t][0] < end:  # tokens overlapping the content
            mask[t] = 1
            t += 1
        # the end-of-turn: the first special token after the content, past whitespace only
        k = t
        while k < n and ids[k] not in specials and not text[offsets[k][0] : offsets[k][1]].strip():
            k += 1
        if k < n and ids[k] in specials:
            for j in range(t, k + 1):
                mask[j] = 1
            t = k + 1
    return ids, mask


def end_of_turn_ids(tokenizer: Any) -> set[int]:
    """Tokens that end an assistant turn under this template (plus eos): where generation must stop."""
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    ids, mask = tokenize_conversation(tokenizer, messages)
    specials = special_token_ids(tokenizer)
    stop = {i for i, m in zip(ids, mask) if m and i in specials}
    if getattr(tokenizer, "eos_token_id", None) is not None:
        stop.add(int(tokenizer.eos_token_id))
    return stop
