"""``eagle demo`` end to end on a tiny random target saved as a model folder (with SmolLM2's tokenizer).

The same pipeline a user runs (prepare with regeneration -> collect -> train -> export -> eval), driven through
``recipes.cli.main``, then: every artefact is where docs/ARCHITECTURE.md says, the exported EAGLE-3 head
reloads and decodes losslessly, a rerun skips every stage without touching a file, and online mode works.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from datasets import load_from_disk
from safetensors.torch import load_file

from eagle.drafter import HeadDrafter
from eagle.evaluate import eos_token_ids
from eagle.export import load_exported_head
from eagle.sampling import Sampling
from eagle.speculate import speculative_generate
from eagle.targets import load_target, load_tokenizer
from eagle.testing import check_greedy_report_section
from eagle.tree import TreeConfig
from recipes.cli import main
from train.checkpoint import load_head_files
from train.regen_features import CapturedFeatures, CaptureSpec
from train.shards import FeatureShards

VOCAB = 49152  # SmolLM2's tokenizer: its ids must be valid for the tiny model
HIDDEN = 32
DRAFT_VOCAB = 512
MAX_NEW = 16
SHAREGPT_ANSWER = "It is a topic worth a long answer."
PNG = b"\x89PNG\r\n\x1a\n"
PROMPTS = [
    {"id": "chat", "messages": [{"role": "user", "content": "Say hello twice, then count to five."}]},
    {"id": "code", "prompt": "def add(a, b):\n    return a + b\n\ndef sub(a, b):"},
]
EAGLE3_KEYS = {
    "fc.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
    *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"),
    *(f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
    *(f"midlayer.{n}.weight" for n in ("hidden_norm", "input_layernorm", "post_attention_layernorm")),
}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, tiny_target_folder) -> dict[str, Path]:
    """The shared tiny target folder (random llama + SmolLM2 tokenizer with its chat template), ShareGPT data,
    prompts."""
    root = tmp_path_factory.mktemp("e2e")
    target = tiny_target_folder
    sharegpt = root / "sharegpt.jsonl"
    records = [
        {
            "conversations": [
                {"from": "human", "value": f"Tell me about topic number {i}."},
                {"from": "gpt", "value": SHAREGPT_ANSWER},
            ]
        }
        for i in range(6)
    ]
    sharegpt.write_text("".join(json.dumps(r) + "\n" for r in records))
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return {"root": root, "target": target, "sharegpt": sharegpt, "prompts": prompts}


def _demo_args(ws: dict[str, Path], run_dir: Path, *extra: str) -> list[str]:
    """``eagle demo`` on the demo recipe, shrunk to seconds: 14 conversations, 30 steps, 2 prompts x 16 tokens."""
    return [
        "--debug",  # a user error raises (with its message) instead of becoming exit status 2
        "demo",
        "--config",
        str(Path(__file__).resolve().parent.parent / "configs" / "smollm2_demo.yaml"),
        f"run_dir={run_dir}",
        f"target.name={ws['target']}",
        f"data.sources=[{ws['sharegpt']},chitchat:8]",
        "data.max_conversations=null",
        "data.max_length=128",
        "data.regen_max_new_tokens=16",
        "data.regen_batch_size=8",
        f"head.draft_vocab_size={DRAFT_VOCAB}",
        "train.epochs=5",
        "train.max_steps=30",
        "train.batch_size=2",
        "train.ttt_steps=2",
        "train.eval_every=0",
        "train.save_every=1000",
        "train.report_to=[none]",
        "train.progress=false",
        f"eval.prompts=[{ws['prompts']}]",
        f"eval.max_new_tokens={MAX_NEW}",
        "eval.warmup=0",
        "eval.tree.policy=dynamic",
        "eval.tree.depth=3",
        "eval.tree.top_k=2",
        "eval.tree.total_tokens=8",
        *extra,
    ]


def _files(run_dir: Path) -> dict[str, tuple[int, int]]:
    """Every file under the run directory -> (mtime_ns, size)."""
    return {
        str(p.relative_to(run_dir)): (p.stat().st_mtime_ns, p.stat().st_size)
        for p in sorted(run_dir.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def offline_run(workspace) -> Path:
    run_dir = workspace["root"] / "run-offline"
    assert main(_demo_args(workspace, run_dir)) == 0
    return run_dir


def _check_report(run_dir: Path, target_dir: Path) -> dict:
    report = json.loads((run_dir / "eval" / "report.json").read_text())
    assert set(report["prompt_sets"]) == {"prompts"}
    for section in (report["prompt_sets"]["prompts"], report["overall"]):
        check_greedy_report_section(section, len(PROMPTS))
        assert len(PROMPTS) <= section["new_tokens"] <= len(PROMPTS) * MAX_NEW
        assert section["target_forwards"] >= 1 and section["acceptance_length_mean"] >= 1.0
        # the demo's prompt-lookup branch (10 tokens) reaches deeper than the depth-3 tree
        assert len(section["per_depth_acceptance"]) == 10
        assert all(0.0 <= r <= 1.0 for r in section["per_depth_acceptance"])
    tree = report["tree"]
    assert (tree["policy"], tree["depth"], tree["top_k"], tree["total_tokens"]) == ("dynamic", 3, 2, 8)
    assert (tree["lookup_ngram"], tree["lookup_tokens"]) == (3, 10)
    assert report["target"] == str(target_dir)
    assert Path(report["head"]) == run_dir / "export"
    assert [p["first_mismatch"] for p in report["prompts"]] == [None] * len(PROMPTS)
    for name in ("accept_hist.png", "accept_by_depth.png"):
        assert (run_dir / "eval" / name).read_bytes()[:8] == PNG, name
    return report


def test_demo_writes_every_artefact(offline_run, workspace):
    run = offline_run
    saved = (run / "config.yaml").read_text()
    assert f"run_dir: {run}" in saved and str(workspace["target"]) in saved

    # prepare: both sources, split, and the assistant turns rewritten by the target (regeneration)
    meta = json.loads((run / "data" / "prepare_meta.json").read_text())
    assert meta["regenerate"] is True
    assert {k: v["kept"] for k, v in meta["sources"].items()} == {
        str(workspace["sharegpt"]): 6,
        "chitchat:8": 8,
    }
    assert meta["counts"]["train"] >= 10 and meta["counts"]["val"] >= 1
    train_rows = load_from_disk(str(run / "data" / "train"))
    assert len(train_rows) == meta["counts"]["train"] and len(load_from_disk(str(run / "data" / "val"))) >= 1
    tokenizer = load_tokenizer(str(workspace["target"]))
    answers = [
        tokenizer.decode([t for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if m])
        for row in train_rows
    ]
    assert all(answers) and not any(SHAREGPT_ANSWER in a for a in answers)

    # collect: a complete manifest with the tiny target's layers
    manifest = json.loads((run / "features" / "manifest.json").read_text())
    assert manifest["complete"] is True and manifest["hidden_size"] == HIDDEN
    assert manifest["splits"]["train"]["num_sequences"] == meta["counts"]["train"]
    for split in ("train", "val"):
        assert list((run / "features" / split).glob("shard-r00-*.safetensors"))
    # regeneration kept the target's features (data.capture_features in the demo config) and collect copied them:
    # bit for bit where the capture reaches, zeros after it (positions the losses never read)
    kept = CapturedFeatures.find(run / "data", CaptureSpec(**meta["captured_features"]["spec"]))
    assert kept is not None and len(kept) > 0
    split_ids = json.loads((run / "data" / "split_ids.json").read_text())["train"]
    shards = FeatureShards(run / "features", "train")
    copied = zero_tail = 0
    for i, row in enumerate(shards.seq_indices()):
        item = shards[i]
        got = kept.for_row(split_ids[row], item["input_ids"], item["loss_mask"])
        if got is not None and torch.equal(got[0], item["aux_hidden"]) and torch.equal(got[1], item["last_hidden"]):
            copied += 1
            zero_tail += not item["aux_hidden"][-1].any()  # e.g. the template's closing newline
    # a random tiny target writes token runs that re-tokenize differently, so most rows are recomputed here (5% of
    # the embedded SmolLM2's, TUNING.md run 46); the ones that fit were copied
    assert copied > 0 and zero_tail > 0

    # train: 30 optimizer steps, metrics, curves, final head
    metrics = [json.loads(line) for line in (run / "train" / "metrics.jsonl").read_text().splitlines()]
    steps = [m["step"] for m in metrics if m["event"] == "train"]
    assert steps and max(steps) == 30
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in metrics if m["event"] == "train")
    assert (run / "train" / "training_curves.png").read_bytes()[:8] == PNG
    final = run / "train" / "final"
    assert (final / "model.safetensors").is_file() and (final / "head_config.json").is_file()

    # export: the EAGLE-3 layout SGLang / vLLM load
    tensors = load_file(str(run / "export" / "model.safetensors"))
    assert set(tensors) == EAGLE3_KEYS
    aux = manifest["aux_layers"]
    assert tensors["fc.weight"].shape == (HIDDEN, len(aux) * HIDDEN)
    assert tensors["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * HIDDEN
    assert tensors["lm_head.weight"].shape == (DRAFT_VOCAB, HIDDEN)
    d2t, t2d = tensors["d2t"], tensors["t2d"]
    assert d2t.dtype == torch.int64 and d2t.shape == (DRAFT_VOCAB,)
    assert t2d.dtype == torch.bool and t2d.shape == (VOCAB,) and int(t2d.sum()) == DRAFT_VOCAB
    mapped = torch.arange(DRAFT_VOCAB) + d2t  # target id of draft id i
    assert torch.equal(mapped.sort().values, t2d.nonzero().flatten())
    config = json.loads((run / "export" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert (config["hidden_size"], config["vocab_size"], config["draft_vocab_size"]) == (
        HIDDEN,
        VOCAB,
        DRAFT_VOCAB,
    )
    assert config["eagle_aux_hidden_state_layer_ids"] == aux
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in aux]

    # eval + the demo's stage stamps
    _check_report(run, workspace["target"])
    stamps = json.loads((run / "stages.json").read_text())
    assert list(stamps) == ["prepare", "collect", "train", "export", "eval"]
    assert all(s["status"] == "done" and s["key"] for s in stamps.values())
    # regeneration, training and evaluation ran with their share of the 30-minute budget as a time limit
    limited = {name for name, s in stamps.items() if s.get("time_limit_minutes")}
    assert limited == {"prepare", "train", "eval"}
    from recipes.demo import STAGE_WEIGHT

    share = STAGE_WEIGHT["prepare"]  # the demo config keeps regeneration's features: collect weighs little
    assert share * 27 < stamps["prepare"]["time_limit_minutes"] <= share * 27.5  # (30 - 2.5 reserved) x its share


def test_stage_time_limits_share_the_time_left():
    from recipes.config import RunConfig
    from recipes.demo import (
        COLLECT_WEIGHT_UNCAPTURED,
        MIN_STAGE_MINUTES,
        limit_stage,
        stage_hash,
        stage_weights,
    )

    cfg = RunConfig()
    key = stage_hash(cfg, "eval")
    stages = ["prepare", "collect", "train", "export", "eval"]
    weights = stage_weights(cfg)
    assert weights["collect"] == COLLECT_WEIGHT_UNCAPTURED  # no regeneration: collect runs the target itself
    share = weights["prepare"] / sum(weights.values())
    assert limit_stage(cfg, "prepare", stages, 1200.0) == pytest.approx(20 * share)
    assert cfg.data.regen_max_minutes == pytest.approx(20 * share)
    cfg.data.regenerate = cfg.data.capture_features = True  # features kept by regeneration: collect only copies
    cfg.data.regen_max_minutes = None
    assert stage_weights(cfg)["collect"] < weights["collect"] / 5
    cfg.data.regen_engine = "vllm"  # ... but vLLM keeps no features: collect runs the target after all
    assert stage_weights(cfg)["collect"] == COLLECT_WEIGHT_UNCAPTURED
    cfg.data.regen_engine = "hf"
    assert limit_stage(cfg, "prepare", stages, 1200.0) > 20 * share
    key = stage_hash(cfg, "eval")
    assert limit_stage(cfg, "collect", stages[1:], 900.0) is None  # collect scales with the data instead
    weights = stage_weights(cfg)
    share = weights["train"] / sum(weights[s] for s in stages[2:])
    assert limit_stage(cfg, "train", stages[2:], 600.0) == pytest.approx(10 * share)
    assert limit_stage(cfg, "eval", ["eval"], 300.0) == pytest.approx(5.0)  # the last stage gets all that is left
    assert limit_stage(cfg, "eval", ["eval"], -60.0) == MIN_STAGE_MINUTES  # over budget: still a minimum
    cfg.eval.max_minutes = None
    cfg.train.max_minutes = 2.0  # a smaller limit of the user's own stays
    assert limit_stage(cfg, "train", stages[2:], 6000.0) == 2.0
    # the limits depend on the time left, so they are not part of a stage's identity (a rerun still resumes)
    assert stage_hash(cfg, "eval") == key


def test_a_budget_scales_the_config_but_never_raises_what_it_set_lower():
    from recipes.config import RunConfig
    from recipes.demo import apply_budget

    cfg = RunConfig()
    cfg.data.max_conversations, cfg.train.max_steps, cfg.eval.max_prompts = 12, 6, 2
    apply_budget(cfg, 2.0)  # a 2-minute budget: the scaled values fall below the floors
    assert (cfg.data.max_conversations, cfg.train.max_steps, cfg.eval.max_prompts) == (12, 6, 2)
    cfg.data.max_conversations, cfg.train.max_steps, cfg.eval.max_prompts = 3000, 900, 40
    apply_budget(cfg, 15.0)
    assert (cfg.data.max_conversations, cfg.train.max_steps, cfg.eval.max_prompts) == (1500, 450, 20)
    apply_budget(cfg, 1.0)
    assert (cfg.data.max_conversations, cfg.train.max_steps, cfg.eval.max_prompts) == (50, 20, 4)


def test_a_larger_budget_draws_more_prompts_from_each_counted_source():
    from recipes.config import RunConfig
    from recipes.demo import apply_budget

    cfg = RunConfig()
    cfg.data.sources = ["chitchat:900", "stdlib-code:1240", "chats.jsonl", "hf:org/data:train[:500]"]
    cfg.data.max_conversations = 2140
    apply_budget(cfg, 90.0)  # 3x the time: 3x the prompts, or the cap alone would add only epochs
    assert cfg.data.max_conversations == 6420
    assert cfg.data.sources == ["chitchat:2700", "stdlib-code:3720", "chats.jsonl", "hf:org/data:train[:500]"]
    apply_budget(cfg, 15.0)  # a smaller budget keeps the mix and lets the cap cut the shuffled pool
    assert cfg.data.sources[:2] == ["chitchat:2700", "stdlib-code:3720"]
    assert cfg.data.max_conversations == 3210


def test_exported_head_reloads_and_decodes_losslessly(offline_run, workspace):
    target = load_target(str(workspace["target"]))
    head = load_exported_head(offline_run / "export", target, dtype="float32")
    # the export is the trained head, rounded to bf16
    final_state, _ = load_head_files(offline_run / "train" / "final")
    reloaded = head.state_dict()
    assert set(final_state) <= set(reloaded)
    for key, value in final_state.items():
        expected = value.to(torch.bfloat16).float() if value.is_floating_point() else value
        assert torch.equal(reloaded[key].to(expected.dtype), expected), key

    eos = eos_token_ids(target)
    tokenizer = target.tokenizer
    chat = tokenizer.apply_chat_template(PROMPTS[0]["messages"], add_generation_prompt=True, tokenize=False)
    trees = [
        TreeConfig(policy="dynamic", depth=3, top_k=2, total_tokens=8),
        TreeConfig(policy="chain", depth=4),
    ]
    for text in (chat, PROMPTS[1]["prompt"]):
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
        with torch.no_grad():
            reference = target.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=MAX_NEW,
                eos_token_id=eos,
                pad_token_id=tokenizer.pad_token_id,
            )[0, ids.shape[1] :].tolist()
        for tree in trees:
            result = speculative_generate(
                target.model, HeadDrafter(head), ids, MAX_NEW, tree, sampling=Sampling(eos_token_ids=eos)
            )
            assert result.tokens == reference, (tree.policy, text[:30])
            # every verification forward yields its accepted drafts + 1; the prefill adds one token; the
            # last forward may be cut at max_new_tokens
            assert 0 <= sum(result.accept_lengths) + 1 - len(result.tokens) <= 4


def test_rerun_skips_every_stage_and_changes_nothing(offline_run, workspace, capsys):
    before = _files(offline_run)
    config_before = (offline_run / "config.yaml").read_bytes()
    capsys.readouterr()
    start = time.perf_counter()
    assert main(_demo_args(workspace, offline_run)) == 0
    elapsed = time.perf_counter() - start
    out = capsys.readouterr().out
    assert out.count("already done") == 5, out
    assert elapsed < 10, f"a rerun with nothing to do took {elapsed:.1f}s"
    after = _files(offline_run)
    # config.yaml is rewritten on every invocation (the settings of the latest one): same bytes here
    assert (offline_run / "config.yaml").read_bytes() == config_before
    before.pop("config.yaml")
    after.pop("config.yaml")
    assert after == before, sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))


def test_online_mode_demo(workspace, capsys):
    run = workspace["root"] / "run-online"
    assert main(_demo_args(workspace, run, "demo.collect=false")) == 0
    assert "online mode" in capsys.readouterr().out
    stamps = json.loads((run / "stages.json").read_text())
    assert list(stamps) == ["prepare", "train", "export", "eval"]
    assert not (run / "features").exists()  # online: the target runs inside the training step
    assert "mode: online" in (run / "config.yaml").read_text()  # the saved config is the one that ran
    steps = [json.loads(line)["step"] for line in (run / "train" / "metrics.jsonl").read_text().splitlines()]
    assert max(steps) == 30
    assert set(load_file(str(run / "export" / "model.safetensors"))) == EAGLE3_KEYS
    _check_report(run, workspace["target"])


@pytest.mark.parametrize("prepack", [True, False])
def test_data_stages_prepack_the_target_they_load(workspace, tmp_path, monkeypatch, prepack):
    """target.cpu_prepack: regeneration (prepare) and collect run on a prepacked copy of the target on a CPU."""
    import eagle.targets as T
    from recipes.collect import run as run_collect
    from recipes.config import load_config
    from recipes.prepare import run as run_prepare

    swapped: list[int] = []
    real = T.prepack_for_cpu
    monkeypatch.setattr(T, "prepack_for_cpu", lambda module, **kw: swapped.append(real(module, **kw)) or swapped[-1])
    cfg = load_config(
        None,
        [
            f"target.name={workspace['target']}",
            f"target.cpu_prepack={str(prepack).lower()}",
            f"data.sources=[{workspace['sharegpt']}]",
            "data.max_length=128",
            "data.regen_max_new_tokens=4",
            f"data.output_dir={tmp_path / 'data'}",
            f"collect.output_dir={tmp_path / 'features'}",
        ],
    )
    run_prepare(cfg)
    run_collect(cfg)
    n_linear = 2 * 7 + 1  # two decoder layers of 7 linear layers each, and the lm_head
    assert swapped == ([n_linear, n_linear] if prepack else [])
    assert (tmp_path / "features" / "manifest.json").is_file()
