"""Chat records in the two common JSON shapes, read with errors that name the file and line.

A conversation is a list of messages ``{"role": "system"|"user"|"assistant"|"tool", "content": str}``; an
assistant message may also carry ``reasoning_content`` (its thinking) and ``tool_calls`` (``[{"type":
"function", "function": {"name": str, "arguments": dict}}]``), a tool result ``name`` / ``tool_call_id``, and the
first message the record's ``tools`` (function definitions, passed to the chat template). Records come as ShareGPT
(``conversations`` of ``from`` / ``value``) or OpenAI (``messages`` of ``role`` / ``content``) objects, in a JSON
list, a single JSON object, or JSONL (optionally gzipped). Used by training sources and evaluation prompt sets alike.

Thinking that opens an assistant's content (``<think>...</think>``) is split into ``reasoning_content``, so that
every chat template gets it the one way templates read it. Tool-call arguments given as a JSON string (OpenAI's
wire format) become a dict.
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from eagle.errors import EagleError

Message = dict[str, Any]

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
    "tool": "tool",
    "function": "tool",  # OpenAI's legacy function results
    "observation": "tool",  # ShareGPT tool results (LLaMA-Factory)
    "ipython": "tool",  # Llama 3.1's tool results
    "function_call": "assistant",  # ShareGPT: an assistant turn whose value is the call(s) as JSON
    "tool_call": "assistant",
}
CALL_ROLES = ("function_call", "tool_call")  # ShareGPT roles whose value is a tool call, not text
REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")  # DeepSeek/vLLM, OpenRouter, gpt-oss spellings
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


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


def split_thinking(text: str, where: str, strict: bool = True) -> tuple[str | None, str]:
    """``(reasoning, content)`` of an assistant text that opens with ``<think>R</think>C``; ``(None, text)`` when
    it does not open with thinking (a tag elsewhere is just text, say in an answer about XML).

    ``strict`` (records): a block that is never closed, or a second one, raises EagleError. Otherwise (the target's
    own answer): a block cut by the token limit is all reasoning, and ``R</think>C`` without the opening tag (a
    generation prompt that opens the block itself) splits too."""
    body = text.lstrip()
    if body.startswith(THINK_OPEN):
        body = body[len(THINK_OPEN):]
    elif strict or THINK_CLOSE not in text or THINK_OPEN in text:
        return None, text
    reasoning, closed, content = body.partition(THINK_CLOSE)
    problem = None
    if not closed:
        if not strict:
            return reasoning.strip(), ""  # cut while thinking: everything written so far is reasoning
        problem = f"opens {THINK_OPEN} and never closes it"
    elif THINK_OPEN in content or THINK_CLOSE in content:
        problem = "holds more than one thinking block"
    if problem is None:
        return reasoning.strip(), content.lstrip()
    if not strict:
        return None, text
    raise EagleError(
        f"{where}: the assistant message {problem}; write each assistant turn's thinking as one "
        f"{THINK_OPEN}...{THINK_CLOSE} block at its start (or in 'reasoning_content')"
    )


def _arguments(args: Any, where: str, name: str) -> dict[str, Any]:
    """A tool call's arguments as a dict; OpenAI sends them as a JSON string."""
    if args is None or (isinstance(args, str) and not args.strip()):
        return {}
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            raise EagleError(
                f"{where}: the arguments of tool call {name!r} are not valid JSON ({e.msg} at character {e.pos}: "
                f"{args[:60]!r}); write them as a JSON object (a dict, or a string holding one)"
            ) from e
    if not isinstance(args, dict):
        raise EagleError(
            f"{where}: the arguments of tool call {name!r} are a JSON {type(args).__name__}, not an object; "
            "write them as a JSON object of named parameters"
        )
    return args


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    """One call as ``{"type": "function", "function": {"name", "arguments"}}`` (plus its ``id``), from OpenAI's
    nested shape or the flat ``{"name", "arguments"}`` of ShareGPT ``function_call`` turns."""
    if isinstance(call, str):  # a ShareGPT function_call value: the call as JSON text
        try:
            call = json.loads(call)
        except json.JSONDecodeError as e:
            raise EagleError(
                f"{where}: the tool call is not valid JSON ({e.msg} at character {e.pos}); write it as "
                '{"name": ..., "arguments": {...}}'
            ) from e
    fn = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(fn, dict):
        raise EagleError(f"{where}: a tool call must be an object with a 'name' and 'arguments', got {call!r:.80}")
    name = fn.get("name")
    if not isinstance(name, str) or not name.strip():
        raise EagleError(
            f"{where}: a tool call has no function name (got {fn!r:.80}); give every call a 'name' "
            "(OpenAI: tool_calls[].function.name)"
        )
    out: dict[str, Any] = {"type": "function", "function": {
        "name": name, "arguments": _arguments(fn.get("arguments", fn.get("parameters")), where, name)}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(calls, str) and calls.strip().startswith("["):  # ShareGPT: several calls in one JSON list
        try:
            calls = json.loads(calls)
        except json.JSONDecodeError as e:
            raise EagleError(f"{where}: the tool calls are not valid JSON ({e.msg}); write them as a JSON list "
                             "of {\"name\": ..., \"arguments\": {...}}") from e
    calls = calls if isinstance(calls, list) else [calls]
    return [_tool_call(c, f"{where} tool call {j}") for j, c in enumerate(calls)]


def _reasoning(turn: dict[str, Any], role: str, where: str) -> str | None:
    """The turn's thinking field (any of its spellings); only an assistant turn may have one."""
    value = next((turn[k] for k in REASONING_KEYS if turn.get(k) not in (None, "")), None)
    if value is None:
        return None
    if role != "assistant":
        raise EagleError(
            f"{where}: a {role} message has thinking ({'/'.join(REASONING_KEYS)}); only assistant turns think: "
            "move it to the assistant turn that wrote it, or drop it"
        )
    if not isinstance(value, str):
        raise EagleError(f"{where}: thinking must be a string, got {type(value).__name__}; give it as text")
    return value


def _message(turn: dict[str, Any], where: str) -> Message:
    """One message, its tool calls, thinking and tool-result fields normalised."""
    name = turn.get("from", turn.get("role"))
    key = str(name).strip().lower()
    role = ROLE_NAMES.get(key) if name is not None else None
    if role is None:
        raise EagleError(
            f"{where} has unknown role {name!r}; known roles: {sorted(ROLE_NAMES)} "
            "(rename or drop such messages before preparing)"
        )
    content = turn.get("value", turn.get("content"))
    if key in CALL_ROLES:  # the value is the call, not text
        return {"role": "assistant", "content": "", "tool_calls": _tool_calls(content, where)}
    calls = turn.get("tool_calls") or turn.get("function_call")
    if content is None and not (calls and role == "assistant"):
        raise EagleError(f"{where} has no 'value' or 'content'")
    message: Message = {"role": role, "content": _content_text(content or "", where)}
    reasoning = _reasoning(turn, role, where)
    if role == "assistant":
        inline, message["content"] = split_thinking(message["content"], where)
        if inline is not None and reasoning is not None:
            raise EagleError(f"{where}: the assistant message has thinking both in its content ({THINK_OPEN}) and "
                             "in reasoning_content; keep one of them")
        reasoning = reasoning if reasoning is not None else inline
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if calls:
        if role != "assistant":
            raise EagleError(f"{where}: a {role} message has tool_calls; only assistant turns call tools")
        message["tool_calls"] = _tool_calls(calls, where)
    if role == "tool":
        for field in ("name", "tool_call_id"):
            if isinstance(turn.get(field), str):
                message[field] = turn[field]
    return message


def _tools(record: dict[str, Any], where: str) -> list[dict[str, Any]] | None:
    """The record's function definitions (OpenAI ``tools``, or ShareGPT's JSON string of them), for the template."""
    tools = record.get("tools")
    if tools in (None, "", []):
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise EagleError(f"{where}: 'tools' is not valid JSON ({e.msg}); give a JSON list of tool "
                             "definitions") from e
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise EagleError(f"{where}: 'tools' must be a list of tool definitions (objects)")
    return tools


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
        messages.append(_message(turn, f"{where}: message {i}"))
    tools = _tools(record, where)
    if tools and messages:
        messages[0]["tools"] = tools  # travels with the conversation; train.chat_template passes it as tools=
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
