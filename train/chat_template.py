"""Rendering a conversation with the target's chat template, and finding what the loss trains on.

The loss mask covers what the target writes in each assistant turn, as its own chat template renders it: the
content, the thinking (``reasoning_content``) and the tool calls of that turn where the template renders them
(with the tags around them: a reasoning target emits ``<think>`` itself), plus the end-of-turn token that closes
the turn (not the role header). Whatever the template leaves out (Qwen3's drops the thinking of turns before the
last user message) is simply not in the text and not in the mask. Tool results are never trained on. An answer
cut at the token limit (``cut``) is trained without the end of turn the template would add: the target never
wrote it.

Every part is found from character offsets in the rendered text: the conversation is rendered again with that
part replaced by a marker (or the tool calls left out), and the text that differs is the part's. So it works with
any chat template; no ``{% generation %}`` markers are needed. ``template_kwargs`` (``data.chat_template_kwargs``,
say ``enable_thinking``) go to every rendering.
"""

from __future__ import annotations

import os
from typing import Any

from eagle.errors import EagleError
from eagle.records import Message

# what a chat template reads of a message; our own marks (``cut``) and the record's ``tools`` stay out of it
TEMPLATE_KEYS = ("role", "content", "reasoning_content", "tool_calls", "name", "tool_call_id")


def check_template(tokenizer: Any) -> None:
    """Raise EagleError when the tokenizer has no chat template (the data cannot be rendered)."""
    if not getattr(tokenizer, "chat_template", None):
        raise EagleError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '?')!r} has no chat template; use an instruct/chat "
            "target, or set one (tokenizer.chat_template = '<jinja>' and save it, or add 'chat_template' to its "
            "tokenizer_config.json)"
        )


def template_messages(messages: list[Message]) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """``(messages, tools)`` as ``apply_chat_template`` takes them. The thinking goes under both spellings
    templates read (Qwen3 and DeepSeek: ``reasoning_content``; gpt-oss: ``thinking``)."""
    out = []
    for m in messages:
        d = {k: m[k] for k in TEMPLATE_KEYS if k in m}
        if "reasoning_content" in d:
            d["thinking"] = d["reasoning_content"]
        out.append(d)
    return out, (messages[0].get("tools") if messages else None)


def drop_thinking(messages: list[Message]) -> list[Message]:
    """The conversation without any assistant thinking (``data.thinking: drop``)."""
    return [{k: v for k, v in m.items() if k != "reasoning_content"} for m in messages]


def render(
    tokenizer: Any, messages: list[Message], add_generation_prompt: bool = False, where: str = "",
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    """The conversation rendered as text by the tokenizer's chat template."""
    check_template(tokenizer)
    plain, tools = template_messages(messages)
    try:
        return tokenizer.apply_chat_template(
            plain, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt,
            **(template_kwargs or {}),
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


def _marked_start(tokenizer: Any, messages: list[Message], i: int, text: str, where: str,
                  kw: dict[str, Any] | None = None) -> int | None:
    """Where message ``i``'s content starts in ``text``, found by rendering the conversation with that content
    replaced by a marker: exact even when the same string also occurs earlier (say in the role header of a
    conversation that opens with an answer). None when the template does not render the content verbatim."""
    marked = [dict(m) for m in messages]
    marked[i]["content"] = _MARKER
    other = render(tokenizer, marked, where=where, template_kwargs=kw)
    start = other.find(_MARKER)
    content = messages[i]["content"]
    if start < 0 or other[:start] != text[:start] or text[start : start + len(content)] != content:
        return None
    if text[start + len(content) :] != other[start + len(_MARKER) :]:
        return None
    return start


def _changed(text: str, other: str) -> tuple[int, int, int]:
    """``(start, end in text, end in other)`` of the part where two renderings differ."""
    start = len(os.path.commonprefix([text, other]))
    room = min(len(text), len(other)) - start
    same_tail = len(os.path.commonprefix([text[::-1][:room], other[::-1][:room]]))
    return start, len(text) - same_tail, len(other) - same_tail


def _part_span(tokenizer: Any, messages: list[Message], i: int, text: str, where: str, kw: dict[str, Any] | None,
               field: str, cursor: int) -> tuple[int, int] | None:
    """Where message ``i``'s ``field`` is rendered in ``text``: render again with the field replaced by a marker
    (``tool_calls``: left out), and take the text that differs. None when the template does not render it (no
    marker shows; the calls change nothing) or the difference is not this turn's (it starts before ``cursor``,
    the end of the previous turn's part)."""
    variant = [dict(m) for m in messages]
    if field == "tool_calls":
        del variant[i][field]
    else:
        variant[i][field] = _MARKER
    try:
        other = render(tokenizer, variant, where=where, template_kwargs=kw)
    except EagleError:  # a template that insists on what was changed (say, calls before tool results)
        return None
    if other == text or (field != "tool_calls" and _MARKER not in other):
        return None
    start, end, _ = _changed(text, other)
    return (start, end) if start >= cursor else None


def _thinking_opener(tokenizer: Any, messages: list[Message], i: int, text: str, where: str,
                     kw: dict[str, Any] | None) -> int:
    """Where the target starts writing turn ``i``: the end of the generation prompt (so a ``<think>`` the template
    puts before the thinking is trained, as the target emits it). -1 when that prompt cannot be rendered."""
    try:
        prompt = render(tokenizer, messages[:i], add_generation_prompt=True, where=where, template_kwargs=kw)
    except EagleError:
        return -1
    return len(os.path.commonprefix([text, prompt]))


def _turn_region(tokenizer: Any, messages: list[Message], i: int, text: str, where: str,
                 kw: dict[str, Any] | None, cursor: int) -> tuple[int, int, bool] | None:
    """``(start, end, close)`` of an assistant turn with thinking, tool calls or a cut: the span from its first
    rendered part to its last, and whether its end-of-turn token trains too (not after a cut answer)."""
    message = messages[i]
    parts = {}
    for field in ("reasoning_content", "tool_calls"):
        if message.get(field):
            span = _part_span(tokenizer, messages, i, text, where, kw, field, cursor)
            if span is not None:
                parts[field] = span
    if message["content"] or not parts:
        span = _part_span(tokenizer, messages, i, text, where, kw, "content", cursor)
        if span is None and message["content"] and not message.get("tool_calls"):
            raise EagleError(
                f"conversation {where or '?'}: the chat template changes assistant message {i}'s text, so its "
                "loss mask cannot be found; use a template that renders message content verbatim"
            )
        if span is not None:
            parts["content"] = span
    if not parts:
        return None
    start, end = min(s for s, _ in parts.values()), max(e for _, e in parts.values())
    if "reasoning_content" in parts:
        opener = _thinking_opener(tokenizer, messages, i, text, where, kw)
        start = opener if cursor <= opener <= start else start
    return start, end, not message.get("cut")


def assistant_regions(
    tokenizer: Any, messages: list[Message], text: str, where: str = "", template_kwargs: dict[str, Any] | None = None
) -> list[tuple[int, int, bool]]:
    """``(start, end, close)`` per assistant turn: the character span it trains on in the rendered ``text``, and
    whether the end-of-turn token after it does too.

    A plain answer's span is its content, searched after the rendered prefix (the messages before it plus the
    generation prompt), so a string that also occurs in a system prompt or an earlier user turn cannot be mistaken
    for it; a turn with thinking, tool calls or a cut is :func:`_turn_region`'s.
    """
    kw = template_kwargs
    regions = []
    cursor = 0
    for i, message in enumerate(messages):
        if message["role"] == "assistant" and (message.get("reasoning_content") or message.get("tool_calls")
                                               or message.get("cut")):
            region = _turn_region(tokenizer, messages, i, text, where, kw, cursor)
            if region is not None:
                regions.append(region)
                cursor = region[1]
            continue
        if message["role"] == "assistant":
            start = _marked_start(tokenizer, messages, i, text, where, kw)
            if start is not None:
                regions.append((start, start + len(message["content"]), True))
                cursor = start + len(message["content"])
                continue
        if message["role"] == "assistant" and i > 0:
            prefix = render(tokenizer, messages[:i], add_generation_prompt=True, where=where, template_kwargs=kw)
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
            regions.append((start, end, True))
        cursor = end
    return regions


def assistant_spans(
    tokenizer: Any, messages: list[Message], text: str, where: str = "", template_kwargs: dict[str, Any] | None = None
) -> list[tuple[int, int]]:
    """Character spans of the assistant turns in the rendered ``text`` (:func:`assistant_regions`)."""
    return [(s, e) for s, e, _ in assistant_regions(tokenizer, messages, text, where, template_kwargs)]


def tokenize_conversation(
    tokenizer: Any, messages: list[Message], specials: set[int] | None = None, where: str = "",
    template_kwargs: dict[str, Any] | None = None,
) -> tuple[list[int], list[int]]:
    """``(input_ids, loss_mask)``: mask = 1 on what each assistant turn writes and the end-of-turn token after it."""
    text = render(tokenizer, messages, where=where, template_kwargs=template_kwargs)
    regions = assistant_regions(tokenizer, messages, text, where, template_kwargs)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
    specials = special_token_ids(tokenizer) if specials is None else specials
    mask = [0] * len(ids)
    n, t = len(ids), 0
    for start, end, close in regions:
        while t < n and offsets[t][1] <= start:
            t += 1
        first = t
        while end > start and t < n and offsets[t][0] < end:  # tokens overlapping the span
            mask[t] = 1
            t += 1
        if not close or (t > first and ids[t - 1] in specials):  # cut, or the span holds its own end (gpt-oss)
            continue
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
