"""Data preparation: sources, loss masks under several chat templates, limits, splits, regeneration, errors."""

from __future__ import annotations

import copy
import gzip
import json
from pathlib import Path

import pytest
import torch

from eagle import datasets as D
from eagle import prompts as PR
from eagle import records as REC
from eagle.devices import model_dtype
from eagle.errors import EagleError
from eagle.testing import masked_runs
from train import chat_template as CT
from train import prepare as P
from train import regenerate as R
from train import sources as S
from train import stdlib_code as SC
from train.chat_template import tokenize_conversation
from train.prepare import DataConfig, prepare

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + (m['content'] | trim) + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
QWEN_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{% endif %}{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _with_template(tok, template, extra_special=()):
    t = copy.deepcopy(tok)
    if extra_special:
        t.add_tokens(list(extra_special), special_tokens=True)
    t.chat_template = template
    return t


# tricky on purpose: an answer that repeats the user's words, one that quotes the default system prompt, an
# emoji (several byte tokens for one character), a trailing newline, and an empty answer
CONVERSATION = [
    {"role": "user", "content": "Say yes"},
    {"role": "assistant", "content": "yes"},
    {"role": "user", "content": "Who are you?"},
    {"role": "assistant", "content": "You are a helpful assistant. 😀 ok\n"},
    {"role": "user", "content": "Say nothing"},
    {"role": "assistant", "content": ""},
]


@pytest.mark.parametrize("style", ["smollm2", "llama3", "qwen"])
def test_loss_mask_is_exactly_assistant_content_plus_end_of_turn(tok, style):
    if style == "smollm2":
        t, eot, trim = tok, "<|im_end|>", False
    elif style == "llama3":
        specials = ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
        t, eot, trim = _with_template(tok, LLAMA3_TEMPLATE, specials), "<|eot_id|>", True
    else:
        t, eot, trim = _with_template(tok, QWEN_TEMPLATE), "<|im_end|>", False
    ids, mask = tokenize_conversation(t, CONVERSATION)
    assert len(ids) == len(mask) and set(mask) == {0, 1}
    answers = [m["content"] for m in CONVERSATION if m["role"] == "assistant"]
    expected = [(a.strip() if trim else a) + eot for a in answers]
    assert masked_runs(t, ids, mask) == expected
    # the ids are the template's own tokenization of the whole rendered text
    rendered = t.apply_chat_template(CONVERSATION, tokenize=False)
    assert ids == t(rendered, add_special_tokens=False)["input_ids"]
    assert CT.end_of_turn_ids(t) >= {t.convert_tokens_to_ids(eot)}


def test_loss_mask_with_explicit_system_and_consecutive_assistants(tok):
    t = _with_template(tok, QWEN_TEMPLATE)
    conv = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "assistant", "content": "Be brief."},
    ]
    ids, mask = tokenize_conversation(t, conv)
    assert masked_runs(t, ids, mask) == ["Hello.<|im_end|>", "Be brief.<|im_end|>"]
    # header tokens ("<|im_start|>assistant\n") are never trained on
    start = t.convert_tokens_to_ids("<|im_start|>")
    assert all(m == 0 for i, m in zip(ids, mask) if i == start)


# ------------------------------------------------------------------------------------------------ sources


def _write_jsonl(path: Path, records) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n", encoding="utf-8")
    return path


def test_sharegpt_openai_json_and_jsonl(tmp_path):
    sharegpt = {
        "conversations": [
            {"from": "system", "value": "sys"},
            {"from": "human", "value": "q1"},
            {"from": "gpt", "value": "a1"},
            {"from": "human", "value": "q2"},
            {"from": "chatgpt", "value": "a2"},
            {"from": "user", "value": "q3"},
            {"from": "bing", "value": "a3"},
            {"from": "human", "value": "q4"},
            {"from": "model", "value": "a4"},
        ]
    }
    openai = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "pa"}, {"type": "text", "text": "rts"}]},
            {"role": "assistant", "content": "ok"},
        ]
    }
    jsonl = _write_jsonl(tmp_path / "mixed.jsonl", [sharegpt, openai])
    as_list = tmp_path / "mixed.json"
    as_list.write_text(json.dumps([sharegpt, openai], indent=2), encoding="utf-8")
    for path in (jsonl, as_list):
        convs = list(REC.read_chat_file(path))
        assert [m["role"] for m in convs[0]] == ["system"] + ["user", "assistant"] * 4
        assert [m["content"] for m in convs[0]][-2:] == ["q4", "a4"]
        assert convs[1] == [{"role": "user", "content": "parts"}, {"role": "assistant", "content": "ok"}]
    loaded = S.load_source(f"{jsonl}:1")  # path:N keeps the first N
    assert len(loaded) == 1 and loaded[0].id == f"{jsonl}:0" and loaded[0].source == f"{jsonl}:1"

    bad_role = _write_jsonl(
        tmp_path / "role.jsonl", [openai, {"messages": [{"role": "wizard", "content": "x"}]}]
    )
    with pytest.raises(EagleError, match=r"role\.jsonl line 2.*wizard"):
        S.load_source(str(bad_role))


def test_hf_source_from_disk_and_file(tmp_path):
    import datasets

    rows = {"conversations": [[{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]] * 3}
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "saved"))
    convs = S.load_source(f"hf:{tmp_path / 'saved'}")
    assert len(convs) == 3 and convs[0].messages[1] == {"role": "assistant", "content": "hello"}
    path = _write_jsonl(tmp_path / "d.jsonl", [{"messages": [{"role": "user", "content": "a"}]}] * 2)
    assert len(S.load_source(f"hf:{path}", regenerate=True)) == 2


def test_chitchat_merges_and_alternates_speakers():
    record = {
        "messages": [
            [{"sender": "A", "text": "hi"}, {"sender": "A", "text": "anyone?"}],
            [{"sender": "B", "text": "yes"}],
            [{"sender": "B", "text": "me"}],
            [{"sender": "A", "text": "great"}],
        ]
    }
    assert D._chitchat_messages(record) == [
        {"role": "user", "content": "hi\nanyone?"},
        {"role": "assistant", "content": "yes\nme"},
        {"role": "user", "content": "great"},
    ]
    # the published dev-chat prompts are the first (merged) user turns of reserve conversations
    dev = PR.load_prompts("dev-chat")
    reserve = dict(D.chitchat_items("eval"))
    for p in dev[:10]:
        assert p["messages"][0]["content"] == reserve[p["id"].removeprefix("chat-")][0]["content"]


def test_chitchat_reserve_never_in_training():
    keys = sorted(D._chitchat_data())
    reserve = {f"chitchat:{k}" for k in keys[-D.CHITCHAT_EVAL_RESERVE :]}
    train = S.load_source("chitchat")
    assert len(train) == len(keys) - 1000 and not reserve & {c.id for c in train}
    assert len(list(D.chitchat_items("eval"))) == 1000
    assert [c.id for c in S.load_source("chitchat:5")] == [f"chitchat:{k}" for k in keys[:5]]
    with pytest.raises(EagleError, match="evaluation-only"):
        S.load_source("dev-chat")


def test_stdlib_code_prompts():
    prompts = SC.stdlib_code_prompts()
    assert len(prompts) >= 2500
    texts = [p[0]["content"] for p in prompts]
    assert len(set(texts)) == len(texts)
    stubs = [t for t in texts if t.startswith("Complete the following Python function.\n\n```python\ndef ")]
    assert len(stubs) >= len(texts) // 3 and all(t.endswith('    """\n```') for t in stubs)
    assert all(t.startswith("Write a Python") for t in texts if t not in stubs)
    # any prefix spans the library: the first 60 requests name callables of at least 30 modules or classes
    ids = [k for k, _ in SC.stdlib_items()[:60]]
    assert len({k.rsplit(".", 1)[0] for k in ids}) >= 30
    assert all(p == [{"role": "user", "content": p[0]["content"]}] for p in prompts)
    assert any("dedent(text)" in t for t in texts)
    with pytest.raises(EagleError, match="regenerate=true"):
        S.load_source("stdlib-code:5")
    convs = S.load_source("stdlib-code:5", regenerate=True)
    assert len(convs) == 5 and [c.messages for c in convs] == prompts[:5]


def test_stdlib_code_grows_past_its_listed_modules_without_moving_them():
    """A budget that asks for more code requests than the listed modules give (`--budget 90` draws 3,720) gets the
    rest of the library and a second request for each function in the other form, after the listed ones, which
    keep their order (the 30-minute demo's 1,240 prompts stay the same)."""
    items = SC.stdlib_items()
    listed = set(SC.STDLIB_MODULES) | set(SC.STDLIB_METHOD_CLASSES)
    first = [k for k, _ in items].index(next(k for k, _ in items if k.rsplit(".", 1)[0] not in listed))
    assert 1000 <= first and all(k.rsplit(".", 1)[0] in listed for k, _ in items[:first])
    more = items[first:]
    assert len(more) >= 2000 and len({t for _, t in items}) == len(items)
    again = dict(more)
    assert {k.rsplit(".", 1)[0] for k in again if not k.endswith("#2")} & {"abc", "builtins", "http.client"}
    stub = "Complete the following Python function."
    # each function asked twice: once as a stub and once in words, both naming it
    dedent = dict(items)
    assert dedent["textwrap.dedent"].startswith(stub) != dedent["textwrap.dedent#2"].startswith(stub)
    assert all(dedent[k].startswith(stub) != dedent[k[:-2]].startswith(stub) for k in again if k.endswith("#2"))
    assert all("dedent(text)" in dedent[k] for k in ("textwrap.dedent", "textwrap.dedent#2"))
    assert sum(k.endswith("#2") for k in again) >= 1000 and not any(k.endswith("#2") for k, _ in items[:first])
    # any prefix of the extension mixes new modules with second requests
    assert 10 <= sum(k.endswith("#2") for k in list(again)[:40]) <= 30


def test_stdlib_code_prompts_are_the_same_in_every_process():
    """The requests feed the prepare cache keys: a default like `pat=<... object at 0x7f..>` once changed them from
    run to run, so a re-run redid a finished regeneration. Two fresh interpreters (other hash seeds, other
    addresses) must build the same requests."""
    import os
    import subprocess
    import sys

    code = "from train.sources import source_stamp; print(source_stamp('stdlib-code'))"
    root = Path(__file__).resolve().parent.parent
    stamps = {
        subprocess.run(
            [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout
        for seed in ("1", "2")
    }
    assert len(stamps) == 1 and str(S.source_stamp("stdlib-code")) + "\n" in stamps
    # nor on what this process imported or set up: transformers adds methods to logging.Logger, torch.package
    # replaces inspect.getfile, and a list default's repr grows with the process's logging handlers
    import logging

    import torch.package  # noqa: F401
    import transformers  # noqa: F401

    handler = logging.StreamHandler()
    logging.getLogger("eagle-test-stdlib").addHandler(handler)
    SC.stdlib_items.cache_clear()
    try:
        assert str(S.source_stamp("stdlib-code")) + "\n" in stamps
    finally:
        logging.getLogger("eagle-test-stdlib").removeHandler(handler)
        SC.stdlib_items.cache_clear()
    texts = [t for _, t in SC.stdlib_items()]
    assert not any(" at 0x" in t for t in texts)
    assert any("def IS_LINE_JUNK(line, pat=...)" in t for t in texts)  # the address-bearing default, written ...
    assert SC._clean_signature("(f=<function <lambda> at 0x7f00aa>, /)") == "(f=...)"


def test_humaneval_is_evaluation_only(tmp_path):
    assert len(D.humaneval_prompts()) == 164
    dev = PR.load_prompts("dev-code")
    assert [p["id"] for p in dev] == [f"HumanEval/{i}" for i in range(40, 80)]
    assert dev[0]["messages"] == D.humaneval_prompts()[40]["messages"]
    for spec in ("human-eval", "humaneval:10"):
        with pytest.raises(EagleError, match="evaluation-only.*stdlib-code"):
            S.load_source(spec)
    with pytest.raises(EagleError, match="evaluation-only"):
        prepare(DataConfig(sources=["human-eval"], output_dir=str(tmp_path)), "x", tokenizer=object())


def test_load_prompts_file_formats_and_errors(tmp_path):
    path = _write_jsonl(
        tmp_path / "p.jsonl",
        [{"id": "a", "messages": [{"role": "user", "content": "hi"}]}, {"prompt": "raw text"}],
    )
    assert PR.load_prompts(path) == [
        {"id": "a", "messages": [{"role": "user", "content": "hi"}]},
        {"id": "p-2", "prompt": "raw text"},
    ]
    (tmp_path / "bad.jsonl").write_text('{"prompt": "ok"}\n{"prompt": oops}\n', encoding="utf-8")
    with pytest.raises(EagleError, match=r"bad\.jsonl line 2"):
        PR.load_prompts(tmp_path / "bad.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n \n", encoding="utf-8")
    with pytest.raises(EagleError, match=r"empty\.jsonl is empty"):
        PR.load_prompts(tmp_path / "empty.jsonl")
    (tmp_path / "latin.jsonl").write_bytes(b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(EagleError, match=r"latin\.jsonl line 2: not valid UTF-8"):
        PR.load_prompts(tmp_path / "latin.jsonl")
    (tmp_path / "neither.jsonl").write_text('{"text": "x"}\n', encoding="utf-8")
    with pytest.raises(EagleError, match=r"neither\.jsonl line 1.*'messages'"):
        PR.load_prompts(tmp_path / "neither.jsonl")
    with pytest.raises(EagleError, match="does not exist"):
        PR.load_prompts(tmp_path / "nope.jsonl")


def test_bad_training_sources(tmp_path, tok):
    with pytest.raises(EagleError, match=r"missing\.jsonl.*neither a known name"):
        S.load_source(str(tmp_path / "missing.jsonl"))
    (tmp_path / "empty.jsonl").write_text("", encoding="utf-8")
    with pytest.raises(EagleError, match=r"empty\.jsonl is empty"):
        S.load_source(str(tmp_path / "empty.jsonl"))
    (tmp_path / "broken.jsonl").write_text('{"messages": []}\n\n{"messages": [\n', encoding="utf-8")
    with pytest.raises(EagleError, match=r"broken\.jsonl line 3: invalid JSON"):
        S.load_source(str(tmp_path / "broken.jsonl"))
    prompts_only = _write_jsonl(
        tmp_path / "prompts.jsonl", [{"messages": [{"role": "user", "content": "q"}]}]
    )
    with pytest.raises(EagleError, match=r"prompts\.jsonl.*no assistant turns.*regenerate=true"):
        prepare(DataConfig(sources=[str(prompts_only)], output_dir=str(tmp_path / "o")), "x", tokenizer=tok)
    # answers that are all empty and have no end-of-turn token leave nothing to learn: named by source
    no_eot = _with_template(
        tok, "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
    )
    empty = _write_jsonl(
        tmp_path / "blank.jsonl",
        [{"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": ""}]}],
    )
    with pytest.raises(EagleError, match=r"blank\.jsonl.*no assistant turns"):
        prepare(DataConfig(sources=[str(empty)], output_dir=str(tmp_path / "o2")), "x", tokenizer=no_eot)
    plain = copy.deepcopy(tok)
    plain.chat_template = None
    good = _write_jsonl(
        tmp_path / "good.jsonl",
        [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}],
    )
    with pytest.raises(EagleError, match="no chat template"):
        prepare(DataConfig(sources=[str(good)], output_dir=str(tmp_path / "o3")), "x", tokenizer=plain)


def test_config_validation_names_the_field():
    for field, value in [
        ("sources", []),
        ("max_length", 0),
        ("val_fraction", 1.0),
        ("on_overlong", "crop"),
        ("regen_top_p", 0.0),
        ("regen_batch_size", 0),
        ("max_conversations", 0),
        ("regen_dtype", "bf16"),
    ]:
        with pytest.raises(EagleError, match=f"data.{field}"):
            DataConfig(**{field: value}).validate()
    assert DataConfig().validate().sources == ["chitchat"]


# ------------------------------------------------------------------------------------------- pipeline


def _chat_file(tmp_path, n=40, name="chat.jsonl"):
    records = [
        {
            "messages": [
                {"role": "user", "content": f"question {i}"},
                {"role": "assistant", "content": f"answer {i}"},
            ]
        }
        for i in range(n)
    ]
    return _write_jsonl(tmp_path / name, records)


def test_prepare_writes_datasets_meta_and_deterministic_split(tmp_path, tok):
    from datasets import load_from_disk

    src = str(_chat_file(tmp_path))

    def run(seed, out):
        cfg = DataConfig(sources=[src], output_dir=str(tmp_path / out), val_fraction=0.25, seed=seed)
        summary = prepare(cfg, "smollm2-135m-instruct", tokenizer=tok)
        return summary, json.loads((tmp_path / out / "split_ids.json").read_text())

    summary, ids_a = run(0, "a")
    _, ids_b = run(0, "b")
    _, ids_c = run(1, "c")
    assert ids_a == ids_b and ids_a["val"] != ids_c["val"]
    assert len(ids_a["val"]) == 10 and len(ids_a["train"]) == 30
    assert not set(ids_a["val"]) & set(ids_a["train"])
    train = load_from_disk(str(tmp_path / "a" / "train"))
    assert train.column_names == ["input_ids", "loss_mask"] and len(train) == 30
    row = train[0]
    idx = int(ids_a["train"][0].rsplit(":", 1)[1])
    assert masked_runs(tok, row["input_ids"], row["loss_mask"]) == [f"answer {idx}<|im_end|>"]
    meta = json.loads((tmp_path / "a" / "prepare_meta.json").read_text())
    assert meta["counts"] == {"train": 30, "val": 10} and meta["sources"][src]["kept"] == 40
    assert meta["assistant_tokens"]["train"] == sum(sum(r) for r in train["loss_mask"])
    assert meta["tokens"]["train"] == sum(len(r) for r in train["input_ids"])
    # same settings: skipped; another setting: rebuilt in place
    again = prepare(
        DataConfig(sources=[src], output_dir=str(tmp_path / "a"), val_fraction=0.25),
        "smollm2-135m-instruct",
        tokenizer=tok,
    )
    assert again["skipped"] and again["config_hash"] == summary["config_hash"]
    other = prepare(
        DataConfig(sources=[src], output_dir=str(tmp_path / "a"), val_fraction=0.5),
        "smollm2-135m-instruct",
        tokenizer=tok,
    )
    assert not other["skipped"] and other["counts"] == {"train": 20, "val": 20}
    assert not [p for p in (tmp_path / "a").iterdir() if p.name.startswith(".")]  # no temp dirs left
    _chat_file(tmp_path, 42)  # an edited data file is not up to date
    edited = prepare(
        DataConfig(sources=[src], output_dir=str(tmp_path / "a"), val_fraction=0.5),
        "smollm2-135m-instruct",
        tokenizer=tok,
    )
    assert not edited["skipped"] and edited["counts"] == {"train": 21, "val": 21}


def test_max_conversations_caps_after_shuffling(tmp_path, tok):
    a, b = str(_chat_file(tmp_path, 30, "a.jsonl")), str(_chat_file(tmp_path, 30, "b.jsonl"))
    cfg = DataConfig(sources=[a, b], max_conversations=20, output_dir=str(tmp_path / "o"), val_fraction=0.1)
    summary = prepare(cfg, "t", tokenizer=tok)
    assert summary["counts"]["train"] + summary["counts"]["val"] == 20
    assert summary["sources"][a]["selected"] > 0 and summary["sources"][b]["selected"] > 0


def test_overlong_policies(tmp_path, tok):
    long_user = {
        "messages": [{"role": "user", "content": "word " * 200}, {"role": "assistant", "content": "ok"}]
    }
    long_answer = {
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "word " * 200}]
    }
    short = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    src = str(_write_jsonl(tmp_path / "long.jsonl", [long_user, long_answer, short]))

    def run(policy):
        cfg = DataConfig(
            sources=[src],
            max_length=64,
            on_overlong=policy,
            val_fraction=0.0,
            output_dir=str(tmp_path / policy),
        )
        return prepare(cfg, "t", tokenizer=tok)

    s = run("truncate")
    assert s["counts"]["train"] == 2 and s["truncated"] == 1
    assert s["dropped"] == {"overlong_no_assistant_in_window": 1}
    from datasets import load_from_disk

    lengths = sorted(len(r) for r in load_from_disk(str(tmp_path / "truncate" / "train"))["input_ids"])
    assert lengths[-1] == 64 and lengths[0] < 64
    s = run("skip")
    assert s["counts"]["train"] == 1 and s["dropped"] == {"overlong_skipped": 2}
    with pytest.raises(EagleError, match=r"long\.jsonl:0 .*max_length=64"):
        run("error")


# ---------------------------------------------------------------------------------------- regeneration


@pytest.fixture(scope="module")
def tiny(tok):
    from eagle.testing import tiny_model

    return tiny_model("llama", vocab_size=len(tok), hidden_size=32, num_layers=2)


def _greedy(tok, model, messages, cfg):
    text = CT.render(tok, messages, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    return R.generate_batch(model, tok, [ids], cfg, CT.end_of_turn_ids(tok), seed=0)[0]


def test_regeneration_replaces_answers_with_the_targets_own(tmp_path, tok, tiny):
    records = [
        {"messages": [{"role": "user", "content": f"Tell me about {w}"}, {"role": "assistant", "content": "HUMAN"},
                      {"role": "user", "content": "more"}, {"role": "assistant", "content": "HUMAN"}]}
        for w in ("cats", "the sea and the long coast line")
    ]  # fmt: skip
    src = str(_write_jsonl(tmp_path / "chat.jsonl", records))
    cfg = DataConfig(
        sources=[src], regenerate=True, regen_max_new_tokens=6, regen_batch_size=2, regen_max_turns=0,
        val_fraction=0.0, output_dir=str(tmp_path / "out"),
    )  # fmt: skip
    convs = R.regenerate(S.load_source(src), tok, tiny, cfg)
    for conv in convs:
        answers = [m["content"] for m in conv.messages if m["role"] == "assistant"]
        assert len(answers) == 2 and "HUMAN" not in answers
        # batched (left-padded) answers equal one-by-one greedy answers, and turn 2 sees the regenerated turn 1
        assert answers[0] == _greedy(tok, tiny, conv.messages[:1], cfg)
        assert answers[1] == _greedy(tok, tiny, conv.messages[:3], cfg)
        n_new = len(tok(answers[0], add_special_tokens=False)["input_ids"])
        assert 0 < n_new <= 8
    # the default keeps one turn; a prompt-only source gets an answer appended
    one = R.regenerate(S.load_source(src), tok, tiny, DataConfig(regenerate=True, regen_max_new_tokens=4))
    assert [m["role"] for m in one[0].messages] == ["user", "assistant"]
    code = R.regenerate(
        S.load_source("stdlib-code:1", regenerate=True), tok, tiny, DataConfig(regen_max_new_tokens=4)
    )
    assert [m["role"] for m in code[0].messages] == ["user", "assistant"] and code[0].messages[1]["content"]

    summary = prepare(cfg, "tiny", tokenizer=tok, model=tiny)
    assert summary["regenerate"] and summary["counts"]["train"] == 2 and summary["target_fingerprint"]
    partial = list((tmp_path / "out").glob("regen-*.jsonl"))
    assert len(partial) == 1 and len(partial[0].read_text().splitlines()) == 4


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_batched_answers_equal_hf_generate_when_rows_stop_early(tok, family):
    """Rows that stop leave the batch (their cache rows dropped); the others' tokens must not change."""
    from transformers import GenerationConfig

    from eagle.testing import tiny_model

    model = tiny_model(family, vocab_size=len(tok), hidden_size=32, num_layers=2, seed=3).eval()
    texts = ["Hi", "Tell me about the sea and the long coast line, please", "Write a poem", "ok"]
    prompts = [tok(CT.render(tok, [{"role": "user", "content": t}], add_generation_prompt=True),
                   add_special_tokens=False)["input_ids"] for t in texts]  # fmt: skip
    cfg = DataConfig(regen_max_new_tokens=12)
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    free = model.generate(input_ids=ids, attention_mask=mask, generation_config=GenerationConfig(
        max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0))[:, width:].tolist()  # fmt: skip
    # stop tokens that end some rows early, at different steps, while others run to the end
    stops = {free[0][2], free[2][6]} - set(free[1]) - set(free[3])
    assert len(stops) >= 1, "the tiny model produced no usable stop token"
    ref = model.generate(input_ids=ids, attention_mask=mask, generation_config=GenerationConfig(
        max_new_tokens=12, do_sample=False, eos_token_id=sorted(stops), pad_token_id=0))[:, width:].tolist()  # fmt: skip
    want = []
    for row in ref:
        end = next((j for j, t in enumerate(row) if t in stops), len(row))
        want.append(tok.decode(row[:end], skip_special_tokens=True))
    got = R.generate_batch(model, tok, prompts, cfg, stops, seed=0)
    assert got == want
    lengths = [next((j for j, t in enumerate(r) if t in stops), len(r)) for r in ref]
    assert min(lengths) < 12 and max(lengths) == 12  # some rows did stop early and some did not

    # sampling: seeded per batch (a resumed run writes the same answers), and the seed matters
    hot = DataConfig(regen_max_new_tokens=12, regen_temperature=1.0)
    a = R.generate_batch(model, tok, prompts, hot, stops, seed=1)
    assert a == R.generate_batch(model, tok, prompts, hot, stops, seed=1)
    assert a != R.generate_batch(model, tok, prompts, hot, stops, seed=2)


def test_regeneration_in_bfloat16_leaves_the_callers_model_and_is_its_own_output(tmp_path, tok, tiny, monkeypatch):
    """data.regen_dtype: answers come from a bf16 copy (prepacked on a CPU with AVX512, where oneDNN runs bf16
    layers); the fp32 model given stays as it was."""
    src = str(_chat_file(tmp_path, n=4))
    seen = []
    real = R.generate_batch
    monkeypatch.setattr(R, "generate_batch", lambda model, *a, **k: seen.append(model) or real(model, *a, **k))
    base = dict(sources=[src], regenerate=True, regen_max_new_tokens=4, regen_batch_size=2, val_fraction=0.0,
                output_dir=str(tmp_path / "out"))  # fmt: skip
    fp32 = prepare(DataConfig(**base), "tiny", tokenizer=tok, model=tiny)
    assert {model_dtype(m) for m in seen} == {torch.float32} and all(m is tiny for m in seen)
    seen.clear()
    bf16 = prepare(DataConfig(**base, regen_dtype="bfloat16"), "tiny", tokenizer=tok, model=tiny)
    assert seen and {model_dtype(m) for m in seen} == {torch.bfloat16} and all(m is not tiny for m in seen)
    if torch.backends.mkldnn.is_available() and torch.cpu._is_avx512_supported():
        assert not any(type(m) is torch.nn.Linear for m in seen[0].modules())  # prepacked in bf16
    assert model_dtype(tiny) == torch.float32
    assert sum(type(m) is torch.nn.Linear for m in tiny.modules()) > 0  # the caller's model is not prepacked
    # another dtype is another output: its own partial file and config hash, not a reuse of the fp32 answers
    assert not bf16["skipped"] and bf16["config_hash"] != fp32["config_hash"]
    assert bf16["regen"]["regen_dtype"] == "bfloat16" and bf16["counts"]["train"] == 4
    assert len(list((tmp_path / "out").glob("regen-*.jsonl"))) == 2


def test_killed_regeneration_resumes(tmp_path, tok, tiny, monkeypatch):
    src = str(_chat_file(tmp_path, 4))
    cfg = DataConfig(sources=[src], regenerate=True, regen_max_new_tokens=4, regen_batch_size=2,
                     val_fraction=0.0, output_dir=str(tmp_path / "out"))  # fmt: skip
    reference = prepare(cfg, "tiny", tokenizer=tok, model=tiny)
    ref_partial = next((tmp_path / "out").glob("regen-*.jsonl")).read_text()

    calls = []
    real = R.generate_batch

    def dies_on_second_batch(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(R, "generate_batch", dies_on_second_batch)
    killed = DataConfig(**{**cfg.__dict__, "output_dir": str(tmp_path / "killed")})
    with pytest.raises(KeyboardInterrupt):
        prepare(killed, "tiny", tokenizer=tok, model=tiny)
    assert not (tmp_path / "killed" / "prepare_meta.json").exists()
    assert len(next((tmp_path / "killed").glob("regen-*.jsonl")).read_text().splitlines()) == 2
    partial = next((tmp_path / "killed").glob("regen-*.jsonl"))
    partial.write_text(partial.read_text() + '{"id": "torn', encoding="utf-8")  # killed mid-write
    calls.clear()
    resumed = prepare(killed, "tiny", tokenizer=tok, model=tiny)
    assert len(calls) == 1  # only the unfinished batch ran again
    lines = partial.read_text().splitlines()
    assert lines[2] == '{"id": "torn' and "\n".join(lines[:2] + lines[3:]) + "\n" == ref_partial
    assert resumed["tokens"] == reference["tokens"] and resumed["config_hash"] == reference["config_hash"]


class _Clock:
    """A hand-wound clock for Deadline: time moves only when a test says so."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_regeneration_time_limit_keeps_a_random_subset_and_resumes(tmp_path, tok, tiny, monkeypatch, capsys):
    from eagle.deadline import Deadline

    src = str(_chat_file(tmp_path, 12))
    cfg = DataConfig(sources=[src], regenerate=True, regen_max_new_tokens=4, regen_batch_size=2,
                     val_fraction=0.0, output_dir=str(tmp_path / "out"))  # fmt: skip
    everything = R.regenerate(S.load_source(src), tok, tiny, cfg)
    assert len(everything) == 12

    clock, calls = _Clock(), []
    real = R.generate_batch

    def slow_batch(*args, **kwargs):  # every batch takes 40 "seconds"
        calls.append(args[2])
        clock.now += 40.0
        return real(*args, **kwargs)

    monkeypatch.setattr(R, "generate_batch", slow_batch)
    partial = tmp_path / "partial.jsonl"
    kept = R.regenerate(S.load_source(src), tok, tiny, cfg, partial, Deadline(1.0, clock=clock))
    # batch 1 ends at 40 s and batch 2 would end at 80 s > 60 s: only the first runs (the first always does)
    assert len(calls) == 1 and len(kept) == 2
    bar = capsys.readouterr().err.split("\r")[-1]  # the progress bar's last state
    assert " 2/12 " in bar and "time limit: 10 unanswered" in bar, bar  # stops where the answers stopped
    want = {c.id: c for c in everything}
    assert all(c.messages == want[c.id].messages for c in kept)  # kept conversations are complete and the same
    # batches run in a seeded random order, not shortest first (the prompts here all have the same length, so
    # shortest first would mean the first two in load order)
    assert [c.id for c in kept] != [c.id for c in everything[:2]]
    # without a limit, a resumed run answers only the rest
    calls.clear()
    rest = R.regenerate(S.load_source(src), tok, tiny, cfg, partial)
    assert len(rest) == 12 and len(calls) == 5 and [c.messages for c in rest] == [c.messages for c in everything]


def test_prepare_cut_by_the_time_limit_is_reused_by_limited_runs_only(tmp_path, tok, tiny, monkeypatch):
    src = str(_chat_file(tmp_path, 8))
    cfg = DataConfig(sources=[src], regenerate=True, regen_max_new_tokens=4, regen_batch_size=2,
                     val_fraction=0.0, output_dir=str(tmp_path / "out"), regen_max_minutes=1.0)  # fmt: skip
    clock = _Clock()
    monkeypatch.setattr(P, "Deadline", lambda minutes: __import__("eagle.deadline").deadline.Deadline(
        minutes, clock=clock))  # fmt: skip
    real = R.generate_batch

    def slow_batch(*args, **kwargs):
        clock.now += 25.0
        return real(*args, **kwargs)

    monkeypatch.setattr(R, "generate_batch", slow_batch)
    cut = prepare(cfg, "tiny", tokenizer=tok, model=tiny)
    assert cut["counts"]["train"] == 4 and cut["dropped"] == {"regen_time_limit": 4} and not cut["skipped"]
    clock.now = 0.0
    again = prepare(DataConfig(**{**cfg.__dict__, "regen_max_minutes": 5.0}), "tiny", tokenizer=tok, model=tiny)
    assert again["skipped"] and again["config_hash"] == cut["config_hash"]  # the limit is not the data's identity
    full = prepare(DataConfig(**{**cfg.__dict__, "regen_max_minutes": None}), "tiny", tokenizer=tok, model=tiny)
    assert not full["skipped"] and full["counts"]["train"] == 8 and full["dropped"] == {}
    with pytest.raises(EagleError, match="data.regen_max_minutes"):
        DataConfig(regen_max_minutes=0).validate()


def test_prepare_loads_the_tokenizer_through_eagle_targets(tmp_path, tok, monkeypatch):
    import eagle.targets

    asked = []
    monkeypatch.setattr(eagle.targets, "load_tokenizer", lambda name, **kw: asked.append(name) or tok)
    src = str(_chat_file(tmp_path, 4))
    prepare(DataConfig(sources=[src], output_dir=str(tmp_path / "o")), "smollm2-135m-instruct")
    assert asked == ["smollm2-135m-instruct"]


def test_gz_chat_file(tmp_path):
    path = tmp_path / "c.jsonl.gz"
    path.write_bytes(
        gzip.compress(
            b'{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}\n'
        )
    )
    assert S.load_source(str(path))[0].messages[1]["content"] == "a"


def test_evaluation_data_is_refused_by_content_whatever_its_name(tmp_path):
    """A renamed copy of a dev set, or training chats with HumanEval problems slipped in, are refused; ordinary
    chat data that happens to share a greeting with the evaluation reserve is not."""
    renamed = tmp_path / "my_chats.jsonl"
    renamed.write_bytes(D.dev_set_path("dev-chat").read_bytes())
    with pytest.raises(EagleError, match="evaluation data.*open with evaluation prompts"):
        S.load_source(str(renamed), regenerate=True)
    chats = [{"messages": [{"role": "user", "content": f"Tell me about topic {i}."},
                           {"role": "assistant", "content": f"Topic {i} is interesting."}]} for i in range(30)]
    problem = D.humaneval_prompts()[3]["messages"][0]["content"]
    mixed = _write_jsonl(tmp_path / "mixed.jsonl", chats + [{"messages": [
        {"role": "user", "content": problem}, {"role": "assistant", "content": "def f(): pass"}]}])
    with pytest.raises(EagleError, match="contain evaluation prompts"):
        S.load_source(str(mixed))
    greeting = next(p["messages"][0]["content"] for p in PR.load_prompts("dev-chat")
                    if len(p["messages"][0]["content"]) < 20)
    fine = _write_jsonl(tmp_path / "fine.jsonl", chats + [{"messages": [
        {"role": "user", "content": greeting}, {"role": "assistant", "content": "Hello!"}]}])
    assert len(S.load_source(str(fine))) == 31
