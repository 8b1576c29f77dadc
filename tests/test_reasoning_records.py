"""Reasoning and tool-call conversations: records in the OpenAI and ShareGPT shapes with tool calls, tool results
and thinking; their loss mask under chat templates written here the way current reasoning models' templates render
them (Qwen3: ``<think>`` blocks only after the last user message, ``<tool_call>`` JSON, tool results in a user
turn; gpt-oss: analysis / commentary / final messages); ``data.thinking``, ``data.chat_template_kwargs``; and
regenerated answers cut at ``regen_max_new_tokens`` (marked, then kept, dropped or refused)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from eagle.errors import EagleError
from eagle.records import chat_file_items, parse_record, split_thinking
from eagle.testing import masked_runs
from train import chat_template as CT
from train import regenerate as R
from train import sources as S
from train.chat_template import drop_thinking, render, tokenize_conversation
from train.prepare import DataConfig, prepare

# Qwen3's template in structure (thinking only after the last user query, and always on the last turn; tool calls
# as <tool_call> JSON; tool results in a user turn), plus enable_thinking=false dropping the thinking, as hybrid
# templates do
QWEN3_TEMPLATE = r"""
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
    {{- '# Tools\n\n<tools>' }}
    {%- for tool in tools %}{{- '\n' }}{{- tool | tojson }}{%- endfor %}
    {{- '\n</tools><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(last_query_index=messages|length - 1) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}{%- set ns.last_query_index = loop.index0 %}{%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {%- if enable_thinking is defined and enable_thinking is false %}{%- set reasoning_content = '' %}{%- endif %}
        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}
            {{- '<|im_start|>assistant\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}{{- '\n' }}{%- endif %}
                {%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}
                {{- '<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' }}
                {%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}
{%- endif %}
"""

# gpt-oss's (harmony) in structure: the thinking, read from `thinking`, is an analysis message shown only after the
# last user message; a tool call is its own commentary message ending in <|call|>; the last final answer ends in
# <|return|>, earlier ones in <|end|>
GPT_OSS_TEMPLATE = r"""
{%- set ns = namespace(last_user=-1) %}
{%- for message in messages %}{%- if message.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}
{%- for message in messages %}
    {%- if message.role == 'system' %}
        {{- '<|start|>developer<|message|>' + message.content + '<|end|>' }}
    {%- elif message.role == 'user' %}
        {{- '<|start|>user<|message|>' + message.content + '<|end|>' }}
    {%- elif message.role == 'assistant' %}
        {%- if message.thinking and loop.index0 > ns.last_user %}
            {{- '<|start|>assistant<|channel|>analysis<|message|>' + message.thinking + '<|end|>' }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for call in message.tool_calls %}
                {{- '<|start|>assistant to=functions.' + call.function.name + '<|channel|>commentary json<|message|>' }}
                {{- call.function.arguments | tojson }}{{- '<|call|>' }}
            {%- endfor %}
        {%- else %}
            {{- '<|start|>assistant<|channel|>final<|message|>' + message.content }}
            {{- '<|return|>' if loop.last else '<|end|>' }}
        {%- endif %}
    {%- elif message.role == 'tool' %}
        {{- '<|start|>functions.' + message.name + ' to=assistant<|channel|>commentary<|message|>' + message.content + '<|end|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}
"""

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}

# OpenAI's wire shape: arguments as a JSON string, content null beside tool calls, thinking in reasoning_content
# or opening the content, and the null fields a Hugging Face dataset fills in
OPENAI = {"tools": TOOLS, "messages": [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris?", "tool_calls": None, "reasoning_content": None},
    {"role": "assistant", "content": None, "reasoning_content": "Need the tool.", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "22C"},
    {"role": "assistant", "content": "<think>\nIt is warm.\n</think>\n\nIt is 22C in Paris."},
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "reasoning_content": "Be polite.", "content": "You're welcome."},
]}  # fmt: skip
# the same conversation as ShareGPT (LLaMA-Factory's function_call / observation turns, tools as a JSON string)
SHAREGPT = {"tools": json.dumps(TOOLS), "conversations": [
    {"from": "system", "value": "You are terse."},
    {"from": "human", "value": "Weather in Paris?"},
    {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})},
    {"from": "observation", "value": "22C"},
    {"from": "gpt", "value": "<think>It is warm.</think>It is 22C in Paris."},
    {"from": "human", "value": "Thanks!"},
    {"from": "gpt", "value": "<think>\nBe polite.\n</think>\n\nYou're welcome."},
]}  # fmt: skip


def _tokenizer(tok, template: str, added: tuple[str, ...] = (), special: tuple[str, ...] = ()):
    t = copy.deepcopy(tok)
    if added:  # Qwen3's <think>, <tool_call>, ... are single (not special) tokens
        t.add_tokens(list(added))
    if special:
        t.add_tokens(list(special), special_tokens=True)
    t.chat_template = template
    return t


@pytest.fixture(scope="module")
def qwen3(tok):
    return _tokenizer(tok, QWEN3_TEMPLATE, added=("<think>", "</think>", "<tool_call>", "</tool_call>",
                                                  "<tool_response>", "</tool_response>"))


@pytest.fixture(scope="module")
def gpt_oss(tok):
    return _tokenizer(tok, GPT_OSS_TEMPLATE,
                      special=("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|call|>", "<|return|>"))


def _write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


# ------------------------------------------------------------------------------------------------ records

EXPECTED = [
    {"role": "system", "content": "You are terse.", "tools": TOOLS},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "content": "22C"},
    {"role": "assistant", "content": "It is 22C in Paris.", "reasoning_content": "It is warm."},
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "content": "You're welcome.", "reasoning_content": "Be polite."},
]


def test_openai_and_sharegpt_shapes_with_tools_and_thinking_parse_alike():
    openai = parse_record(OPENAI, "openai")
    want = copy.deepcopy(EXPECTED)
    want[2]["reasoning_content"] = "Need the tool."
    want[2]["tool_calls"] = [{**CALL, "id": "c1"}]  # the arguments' JSON string became a dict
    want[3].update(name="get_weather", tool_call_id="c1")
    assert openai == want
    assert parse_record(SHAREGPT, "sharegpt") == EXPECTED
    # OpenAI's legacy function call / function result, and several ShareGPT calls in one turn
    legacy = parse_record({"messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "function_call": {"name": "get_weather", "arguments": "{}"}},
        {"role": "function", "name": "get_weather", "content": "22C"},
    ]}, "legacy")  # fmt: skip
    assert legacy[1]["tool_calls"] == [{"type": "function", "function": {"name": "get_weather", "arguments": {}}}]
    assert legacy[2] == {"role": "tool", "content": "22C", "name": "get_weather"}
    two = parse_record({"conversations": [{"from": "human", "value": "x"}, {"from": "function_call", "value": json.dumps(
        [{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"k": 1}}])}]}, "two")  # fmt: skip
    assert [c["function"]["name"] for c in two[1]["tool_calls"]] == ["a", "b"]


def test_plain_records_and_think_tags_inside_text_stay_as_they_were():
    plain = parse_record({"messages": [{"role": "user", "content": "What does <think> do in HTML?"},
                                       {"role": "assistant", "content": "Nothing: <think> is no HTML tag."}]}, "p")
    assert plain == [{"role": "user", "content": "What does <think> do in HTML?"},
                     {"role": "assistant", "content": "Nothing: <think> is no HTML tag."}]  # fmt: skip


BAD_SHAPES = {
    "tool call without a name": (
        {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"arguments": "{}"}}]},
        r"tool call has no function name.*give every call a 'name'",
    ),
    "arguments that are not JSON": (
        {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": "{city: Paris"}}]},
        r"arguments of tool call 'get_weather' are not valid JSON.*write them as a JSON object",
    ),
    "arguments that are a JSON list": (
        {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": '["Paris"]'}}]},
        r"arguments of tool call 'get_weather' are a JSON list, not an object",
    ),
    "thinking on a user turn": (
        {"role": "user", "content": "Hi", "reasoning_content": "I am the user"},
        r"a user message has thinking.*only assistant turns think: move it",
    ),
    "thinking never closed": (
        {"role": "assistant", "content": "<think>Let me see... 42"},
        r"opens <think> and never closes it.*one <think>...</think> block",
    ),
    "two thinking blocks": (
        {"role": "assistant", "content": "<think>a</think>b<think>c</think>d"},
        r"holds more than one thinking block",
    ),
    "thinking twice over": (
        {"role": "assistant", "content": "<think>a</think>b", "reasoning_content": "a"},
        r"thinking both in its content.*keep one of them",
    ),
    "tool calls on a user turn": (
        {"role": "user", "content": "Hi", "tool_calls": [CALL]},
        r"a user message has tool_calls; only assistant turns call tools",
    ),
}


@pytest.mark.parametrize("name", sorted(BAD_SHAPES))
def test_each_malformed_shape_names_file_line_problem_and_fix(tmp_path, name):
    turn, problem = BAD_SHAPES[name]
    good = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}
    path = _write_jsonl(tmp_path / "chats.jsonl", [good, {"messages": [{"role": "user", "content": "Q"}, turn]}])
    with pytest.raises(EagleError, match=problem) as err:
        list(chat_file_items(path))
    assert f"{path} line 2: message 1" in str(err.value)


def test_split_thinking_of_records_and_of_the_targets_own_answers():
    assert split_thinking("<think>\nR\n</think>\n\nC", "w") == ("R", "C")
    assert split_thinking("R</think>C", "w") == (None, "R</think>C")  # a record must open its block
    # the target's own answers: the prompt may open the block; a cut answer may never close it
    assert split_thinking("R\n</think>\n\nC", "w", strict=False) == ("R", "C")
    assert split_thinking("<think>\nhalf a thought", "w", strict=False) == ("half a thought", "")
    assert R.answer_message("<think>\nR\n</think>\n\nC", False, "w") == {
        "role": "assistant", "content": "C", "reasoning_content": "R"}
    assert R.answer_message("<think>\nhalf", True, "w") == {
        "role": "assistant", "content": "", "reasoning_content": "half", "cut": True}


# ------------------------------------------------------------------------------------ rendering and masks


def test_mask_is_what_each_assistant_turn_writes_as_qwen3_renders_it(qwen3):
    messages = parse_record(OPENAI, "openai")
    text = render(qwen3, messages)
    assert "# Tools" in text and "get_weather" in text  # the record's tools reach the template
    ids, mask = tokenize_conversation(qwen3, messages)
    assert ids == qwen3(text, add_special_tokens=False)["input_ids"]
    # the template drops the thinking of the turns before the last user message: not in the text, not in the
    # mask, and no error; the tool result and the tool definitions are never trained on
    assert "Need the tool." not in text and "It is warm." not in text
    assert masked_runs(qwen3, ids, mask) == [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
        "It is 22C in Paris.<|im_end|>",
        "<think>\nBe polite.\n</think>\n\nYou're welcome.<|im_end|>",
    ]
    # a multi-step tool chain after one question: every step's thinking is rendered, and trained
    ids, mask = tokenize_conversation(qwen3, messages[:5])
    assert masked_runs(qwen3, ids, mask) == [
        '<think>\nNeed the tool.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
        "\n</tool_call><|im_end|>",
        "<think>\nIt is warm.\n</think>\n\nIt is 22C in Paris.<|im_end|>",
    ]
    # a call beside content: both, with the template's separator
    both = [{"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Checking.", "tool_calls": [CALL, CALL]}]  # fmt: skip
    ids, mask = tokenize_conversation(qwen3, both)
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    # (the empty block the template puts before the last turn's content is no thinking of the target's)
    assert masked_runs(qwen3, ids, mask) == [f"Checking.\n{call}\n{call}<|im_end|>"]


def test_mask_under_a_gpt_oss_like_template(gpt_oss):
    messages = parse_record(OPENAI, "openai")
    ids, mask = tokenize_conversation(gpt_oss, messages[:5])
    # what the target writes after the generation prompt "<|start|>assistant", its own stop token included
    assert masked_runs(gpt_oss, ids, mask) == [
        "<|channel|>analysis<|message|>Need the tool.<|end|><|start|>assistant to=functions.get_weather<|channel|>"
        'commentary json<|message|>{"city": "Paris"}<|call|>',
        "<|channel|>analysis<|message|>It is warm.<|end|><|start|>assistant<|channel|>final<|message|>"
        "It is 22C in Paris.<|return|>",
    ]


def test_thinking_drop_and_enable_thinking_reach_the_mask(qwen3):
    messages = parse_record(OPENAI, "openai")[:5]
    ids, mask = tokenize_conversation(qwen3, drop_thinking(messages))
    runs = masked_runs(qwen3, ids, mask)
    assert runs[1] == "It is 22C in Paris.<|im_end|>" and not any("<think>" in r for r in runs)
    off = {"enable_thinking": False}
    assert render(qwen3, messages, template_kwargs=off) != render(qwen3, messages)
    ids, mask = tokenize_conversation(qwen3, messages, template_kwargs=off)
    runs = masked_runs(qwen3, ids, mask)
    assert runs[1] == "It is 22C in Paris.<|im_end|>" and not any("think" in r for r in runs)
    assert render(qwen3, messages[:2], add_generation_prompt=True, template_kwargs=off).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_a_cut_answer_trains_what_was_written_and_no_end_of_turn(qwen3):
    prompt = [{"role": "user", "content": "Why is the sky blue?"}]
    thinking = R.answer_message("<think>\nLight scatters and", True, "w")  # cut while thinking
    ids, mask = tokenize_conversation(qwen3, prompt + [thinking])
    # the template closes the block and the turn, the target never did: neither is trained
    assert masked_runs(qwen3, ids, mask) == ["<think>\nLight scatters and"]
    answering = R.answer_message("<think>\nShort.\n</think>\n\nBecause of Rayleigh", True, "w")
    ids, mask = tokenize_conversation(qwen3, prompt + [answering])
    assert masked_runs(qwen3, ids, mask) == ["<think>\nShort.\n</think>\n\nBecause of Rayleigh"]
    finished = R.answer_message("<think>\nShort.\n</think>\n\nBecause of Rayleigh.", False, "w")
    ids, mask = tokenize_conversation(qwen3, prompt + [finished])
    assert masked_runs(qwen3, ids, mask) == ["<think>\nShort.\n</think>\n\nBecause of Rayleigh.<|im_end|>"]


def test_prepare_keeps_or_drops_thinking_with_the_configs_template_arguments(tmp_path, qwen3):
    src = str(_write_jsonl(tmp_path / "tools.jsonl", [OPENAI, SHAREGPT]))

    def masked(name: str, **settings) -> tuple[dict, list[str]]:
        from datasets import load_from_disk

        cfg = DataConfig(sources=[src], val_fraction=0.0, output_dir=str(tmp_path / name), **settings)
        summary = prepare(cfg, "qwen3-like", tokenizer=qwen3)
        rows = load_from_disk(str(tmp_path / name / "train"))
        return summary, [r for row in rows for r in masked_runs(qwen3, row["input_ids"], row["loss_mask"])]

    keep, keep_runs = masked("keep")
    assert keep["cut_answers"] == {"count": 0, "policy": "keep"}
    assert keep_runs.count("<think>\nBe polite.\n</think>\n\nYou're welcome.<|im_end|>") == 2
    drop, drop_runs = masked("drop", thinking="drop")
    assert drop_runs.count("You're welcome.<|im_end|>") == 2 and not any("<think>" in r for r in drop_runs)
    off, off_runs = masked("off", chat_template_kwargs={"enable_thinking": False})
    assert off_runs == drop_runs and off["config_hash"] != drop["config_hash"] != keep["config_hash"]
    assert keep["assistant_tokens"]["train"] > drop["assistant_tokens"]["train"]


@pytest.mark.parametrize("bad", [dict(thinking="some"), dict(on_cut_answer="trim"),
                                 dict(chat_template_kwargs={"tokenize": True}),
                                 dict(chat_template_kwargs=["enable_thinking"])])
def test_the_new_settings_are_validated(bad):
    name = next(iter(bad))
    with pytest.raises(EagleError, match=f"data.{name} must be"):
        DataConfig(**bad).validate()


# ------------------------------------------------------------------------------------------ regeneration


PROMPTS = ["Tell me about cats", "Tell me about dogs", "Tell me about the sea", "Tell me about rain",
           "Tell me about snow", "Tell me about stars"]  # fmt: skip


@pytest.fixture(scope="module")
def stopping_target(tok):
    """A tiny target whose end-of-turn token wins where the last token of its first answer (to 6 tokens) would:
    that answer ends, others run into the limit (it is still a real model: one lm_head row changed)."""
    from eagle.testing import tiny_model

    model = tiny_model("llama", vocab_size=len(tok), hidden_size=32, num_layers=2)
    prompt = tok(render(tok, [{"role": "user", "content": PROMPTS[0]}], add_generation_prompt=True),
                 add_special_tokens=False)["input_ids"]  # fmt: skip
    out = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                         pad_token_id=0)[0, len(prompt):].tolist()  # fmt: skip
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    with torch.no_grad():
        model.lm_head.weight[eot] = 1.01 * model.lm_head.weight[out[-1]]
    return model


def test_generated_answers_are_marked_cut_exactly_when_they_hit_the_limit(tok, stopping_target):
    prompts = [tok(render(tok, [{"role": "user", "content": p}], add_generation_prompt=True),
                   add_special_tokens=False)["input_ids"] for p in PROMPTS]  # fmt: skip
    stops = CT.end_of_turn_ids(tok)
    cut: list[bool] = []
    texts = R.generate_batch(stopping_target, tok, prompts, DataConfig(regen_max_new_tokens=6), stops, 0, cut=cut)
    assert len(cut) == len(texts) and any(cut) and not all(cut) and not cut[0]
    for prompt, was_cut in zip(prompts, cut):  # one at a time: cut iff no stop token in 6
        out = stopping_target.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                                       eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()  # fmt: skip
        assert was_cut == (not stops & set(out))


def test_cut_answers_are_kept_marked_dropped_or_refused(tmp_path, tok, stopping_target):
    from datasets import load_from_disk

    src = str(_write_jsonl(tmp_path / "prompts.jsonl",
                           [{"messages": [{"role": "user", "content": p}]} for p in PROMPTS]))  # fmt: skip
    base = dict(sources=[src], regenerate=True, regen_max_new_tokens=6, regen_batch_size=3, val_fraction=0.0)
    out = tmp_path / "keep"
    keep = prepare(DataConfig(**base, output_dir=str(out)), "tiny", tokenizer=tok, model=stopping_target)
    answers = [json.loads(line) for line in next(out.glob("regen-*.jsonl")).read_text().splitlines()]
    n_cut = sum(a["cut"] for a in answers)
    assert 0 < n_cut < len(PROMPTS) and all(isinstance(a["cut"], bool) for a in answers)
    assert keep["cut_answers"] == {"count": n_cut, "policy": "keep"} and keep["counts"]["train"] == len(PROMPTS)
    # kept cut answers train without the end of turn the template adds: only the finished ones' is trained
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    rows = load_from_disk(str(out / "train"))
    trained_eots = sum(i == eot and m for row in rows for i, m in zip(row["input_ids"], row["loss_mask"]))
    assert trained_eots == len(PROMPTS) - n_cut
    # the same answers (not generated again), other policies
    drop = prepare(DataConfig(**base, output_dir=str(out), on_cut_answer="drop"), "tiny", tokenizer=tok,
                   model=stopping_target)  # fmt: skip
    assert drop["counts"]["train"] == len(PROMPTS) - n_cut and drop["dropped"] == {"cut_answer": n_cut}
    assert drop["cut_answers"] == {"count": n_cut, "policy": "drop"}
    with pytest.raises(EagleError, match=r"reached data.regen_max_new_tokens=6 without ending.*"
                                         r"raise data.regen_max_new_tokens.*data.on_cut_answer"):
        prepare(DataConfig(**base, output_dir=str(out), on_cut_answer="error"), "tiny", tokenizer=tok,
                model=stopping_target)  # fmt: skip
    assert len(list(out.glob("regen-*.jsonl"))) == 1


def test_a_cut_turn_ends_the_conversation_unless_kept(tmp_path, tok):
    from eagle.testing import tiny_model

    model = tiny_model("llama", vocab_size=len(tok), hidden_size=32, num_layers=2)  # never stops in 4 tokens
    src = str(_write_jsonl(tmp_path / "chat.jsonl", [{"messages": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "HUMAN"},
        {"role": "user", "content": "More"}, {"role": "assistant", "content": "HUMAN"}]}]))  # fmt: skip
    cfg = dict(regen_max_new_tokens=4, regen_max_turns=0)
    kept = R.regenerate(S.load_source(src), tok, model, DataConfig(**cfg))[0].messages
    assert [m.get("cut") for m in kept if m["role"] == "assistant"] == [True, True]
    dropped = R.regenerate(S.load_source(src), tok, model, DataConfig(**cfg, on_cut_answer="drop"))[0].messages
    assert [m["role"] for m in dropped] == ["user", "assistant"] and dropped[1]["cut"]  # turn 2 never asked


def test_regeneration_prompts_use_the_template_arguments(tmp_path, qwen3, monkeypatch):
    from eagle.testing import tiny_model

    model = tiny_model("llama", vocab_size=len(qwen3), hidden_size=32, num_layers=2)
    src = str(_write_jsonl(tmp_path / "p.jsonl", [{"messages": [{"role": "user", "content": "Hi"}]}]))
    seen = []
    real = R.generate_batch
    monkeypatch.setattr(R, "generate_batch", lambda m, t, prompts, *a, **k: seen.extend(prompts) or real(
        m, t, prompts, *a, **k))  # fmt: skip
    for kwargs in ({}, {"enable_thinking": False}):
        R.regenerate(S.load_source(src, regenerate=True), qwen3, model,
                     DataConfig(regen_max_new_tokens=2, chat_template_kwargs=kwargs))  # fmt: skip
    thinking, not_thinking = (qwen3.decode(p) for p in seen)
    assert thinking.endswith("<|im_start|>assistant\n")  # the target opens its <think> block itself
    assert not_thinking.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_vllm_answers_at_the_token_limit_count_as_cut(tmp_path):
    path = tmp_path / "answers.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"id": "a", "turn": 0, "content": "done", "tokens": 3},
        {"id": "b", "turn": 0, "content": "long", "tokens": 8},
        {"id": "c", "turn": 0, "content": "ours", "cut": True},
    ]) + "\n")  # fmt: skip
    assert R.read_answers(path, max_new_tokens=8) == {("a", 0): ("done", False), ("b", 0): ("long", True),
                                                      ("c", 0): ("ours", True)}  # fmt: skip
    assert R.read_partial(path) == {("a", 0): "done", ("b", 0): "long", ("c", 0): "ours"}
