"""``eagle eval`` on a tiny random target: report fields and values, plots, oracle tau, failure modes."""

from __future__ import annotations

import importlib.util
import io
import json
import statistics
from pathlib import Path

import pytest
import torch
from rich.console import Console

from eagle.drafter import OracleDrafter
from eagle.errors import EagleError
from eagle.evaluate import EvalConfig, evaluate, summarize
from eagle.export import export_head
from eagle.heads import HeadConfig, build_head
from eagle.speculate import GenerationResult
from eagle.targets import Target, load_tokenizer
from eagle.testing import check_greedy_report_section, tiny_model
from eagle.tree import TreeConfig

VOCAB = 49152  # the SmolLM2 tokenizer's, so its ids are valid for the tiny model
PROMPTS = [
    {"id": "a", "prompt": "The quick brown fox jumps over the lazy dog. The quick brown fox"},
    {"id": "b", "prompt": "def add(a, b):\n    return a + b\n\ndef sub(a, b):"},
    {"id": "c", "messages": [{"role": "user", "content": "Say hello twice."}]},
]


def _load_script(name: str):
    """A module from scripts/ (not a package), loaded by path."""
    path = Path(__file__).resolve().parent.parent / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{name}_script", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2-135m-instruct")


def _target(tokenizer, seed: int = 0, name: str = "tiny-a") -> Target:
    model = tiny_model("llama", seed=seed, vocab_size=VOCAB, hidden_size=32, num_layers=4)
    return Target.from_model(model, tokenizer, name=name)


@pytest.fixture(scope="module")
def target(tokenizer) -> Target:
    return _target(tokenizer)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory, target):
    cfg = HeadConfig.from_target(
        target.config, "eagle3", target_name=target.name, target_fingerprint=target.fingerprint
    )
    head = build_head(cfg).attach_target(target.model).eval()
    return export_head(head, tmp_path_factory.mktemp("export") / "draft", dtype="float32", target=target)


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "mini.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return path


def _cfg(tmp_path, draft_dir, prompts_file, **kw) -> EvalConfig:
    base = dict(
        draft=str(draft_dir),
        prompts=[str(prompts_file)],
        max_new_tokens=12,
        tree=TreeConfig(policy="chain", depth=3),
        report=str(tmp_path / "eval" / "report.json"),
        warmup=0,
    )
    base.update(kw)
    return EvalConfig(**base)


def _quiet() -> Console:
    return Console(file=open("/dev/null", "w"), width=160)  # noqa: SIM115


def test_report_fields_values_and_plots(tmp_path, target, draft_dir, prompts_file):
    cfg = _cfg(tmp_path, draft_dir, prompts_file)
    console = Console(record=True, width=200, file=open("/dev/null", "w"))  # noqa: SIM115
    report = evaluate(cfg, target, console=console)
    on_disk = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert on_disk == json.loads(json.dumps(report))
    assert set(on_disk["prompt_sets"]) == {"mini"}
    for section in (on_disk["prompt_sets"]["mini"], on_disk["overall"]):
        check_greedy_report_section(section, 3)
        assert section["acceptance_length_mean"] >= 1.0
        assert section["speedup"] > 0 and section["prompt_lookup_speedup"] > 0
        assert 3 <= section["new_tokens"] <= 3 * 12
        rates = section["per_depth_acceptance"]
        assert len(rates) == 3 and all(0.0 <= r <= 1.0 for r in rates)
        assert all(a >= b for a, b in zip(rates, rates[1:]))  # a chain accepts depth d only after d - 1
        hist = section["accept_length_histogram"]
        assert sum(hist) == section["target_forwards"]
        tau = sum((i + 1) * n for i, n in enumerate(hist)) / sum(hist)
        assert tau == pytest.approx(section["acceptance_length_mean"])
    assert on_disk["tree"]["policy"] == "chain" and on_disk["tree"]["depth"] == 3
    assert on_disk["tree"]["verification"] == "tree"  # an attention-only target
    for key in ("target", "head", "device", "dtype", "torch_version", "transformers_version", "date"):
        assert on_disk[key], key
    assert on_disk["target"] == "tiny-a" and on_disk["head"] == str(draft_dir)
    assert len(on_disk["prompts"]) == 3 and all(p["first_mismatch"] is None for p in on_disk["prompts"])
    assert on_disk["speed_model"] is None  # 3 prompts do not pin the line of speed against tau
    mism = on_disk["greedy_mismatches"]
    assert mism["prompts"] == 3 and mism["mismatched"] == 0 and mism["dtype"] == "float32"
    for name in ("accept_hist.png", "accept_by_depth.png"):
        png = tmp_path / "eval" / name
        assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = console.export_text()
    assert "greedy" in text and "overall" in text and "100%" in text and "mini" in text
    assert "greedy match" not in text  # the near-tie / bug note only follows a difference
    # not a terminal (a log file): no live bar, so each finished prompt prints a line
    for i, row in enumerate(on_disk["prompts"], start=1):
        assert f"eval {i}/3 mini {row['id']}: {row['new_tokens']} tokens, tau " in text


def test_oracle_drafter_accepts_whole_chains(tmp_path, target, draft_dir, prompts_file):
    depth = 3
    cfg = _cfg(
        tmp_path, draft_dir, prompts_file, tree=TreeConfig(policy="chain", depth=depth), prompt_lookup=False
    )
    report = evaluate(cfg, target, drafter=OracleDrafter(target.model), console=_quiet())
    overall = report["overall"]
    assert overall["acceptance_length_mean"] == depth + 1
    assert overall["acceptance_length_median"] == depth + 1
    assert overall["per_depth_acceptance"] == [1.0] * depth
    assert overall["greedy_match_rate"] == 1.0
    assert overall["prompt_lookup_tokens_per_second"] is None
    # every prompt ran to max_new_tokens or EOS in ceil(n - 1 / (depth + 1)) verification forwards
    for p in report["prompts"]:
        assert p["target_forwards"] == -(-(p["new_tokens"] - 1) // (depth + 1))


def test_auto_tree_size_reports_autotune(tmp_path, target, draft_dir, prompts_file):
    tree = TreeConfig(policy="dynamic", depth=2, top_k=2, total_tokens="auto")
    cfg = _cfg(
        tmp_path,
        draft_dir,
        prompts_file,
        tree=tree,
        max_new_tokens=6,
        autotune_candidates=[2, 4, 6],
        baseline=True,
        prompt_lookup=False,
        max_prompts=2,
    )
    report = evaluate(cfg, target, console=_quiet())
    t = report["tree"]
    assert t["total_tokens_requested"] == "auto"
    assert t["total_tokens"] in (2, 4, 6) and t["total_tokens"] == t["autotune"]["chosen"]
    assert [r["total_tokens"] for r in t["autotune"]["table"]] == [2, 4, 6]
    assert report["overall"]["num_prompts"] == 2
    assert report["overall"]["greedy_match_rate"] == 1.0


def test_sampling_run_has_no_greedy_match(tmp_path, target, draft_dir, prompts_file):
    cfg = _cfg(
        tmp_path, draft_dir, prompts_file, temperature=0.8, top_k=20, max_prompts=1, prompt_lookup=False
    )
    report = evaluate(cfg, target, console=_quiet())
    assert report["overall"]["greedy_match_rate"] is None and report["greedy_mismatches"] is None
    assert report["overall"]["speedup"] > 0
    assert report["settings"]["temperature"] == 0.8


def test_head_for_another_target_fails_before_any_work(tmp_path, tokenizer, draft_dir, prompts_file):
    other = _target(tokenizer, seed=1, name="tiny-b")
    cfg = _cfg(tmp_path, draft_dir, prompts_file)
    with pytest.raises(EagleError, match="trained for target tiny-a"):
        evaluate(cfg, other, console=_quiet())
    assert not (tmp_path / "eval").exists()


def test_missing_inputs_are_clear_errors(tmp_path, target, draft_dir, prompts_file):
    with pytest.raises(EagleError, match="does not exist"):
        evaluate(_cfg(tmp_path, draft_dir, tmp_path / "nope.jsonl"), target, console=_quiet())
    with pytest.raises(EagleError, match="eagle export"):
        evaluate(_cfg(tmp_path, tmp_path / "no-draft", prompts_file), target, console=_quiet())
    with pytest.raises(EagleError, match="max_position_embeddings"):
        evaluate(_cfg(tmp_path, draft_dir, prompts_file, max_new_tokens=4090), target, console=_quiet())
    with pytest.raises(EagleError, match="temperature"):
        _cfg(tmp_path, draft_dir, prompts_file, temperature=-1.0).validate()
    with pytest.raises(EagleError, match="tree depth"):
        _cfg(tmp_path, draft_dir, prompts_file, tree=TreeConfig(policy="chain", depth=0)).validate()
    assert not (tmp_path / "eval").exists()


def test_draft_dtype_changes_the_head_not_the_output(tmp_path, target, draft_dir, prompts_file):
    reports = {}
    for dtype in ("bfloat16", "float32"):
        cfg = _cfg(tmp_path / dtype, draft_dir, prompts_file, draft_dtype=dtype, prompt_lookup=False)
        reports[dtype] = evaluate(cfg, target, console=_quiet())
        assert reports[dtype]["settings"]["draft_dtype"] == dtype
        assert reports[dtype]["overall"]["greedy_match_rate"] == 1.0
    tokens = {d: [p["new_tokens"] for p in r["prompts"]] for d, r in reports.items()}
    assert tokens["bfloat16"] == tokens["float32"]  # same target outputs, whatever the head computes in
    with pytest.raises(EagleError, match="eval.draft_dtype 'int4'.*bfloat16"):
        _cfg(tmp_path, draft_dir, prompts_file, draft_dtype="int4").validate()


def test_auto_draft_dtype_is_bf16_only_on_cpus_with_bf16_units(monkeypatch):
    import torch

    import eagle.drafter as drafter

    monkeypatch.setattr(drafter, "cpu_has_fast_bf16", lambda: True)
    assert drafter.resolve_draft_dtype("auto", "cpu", torch.float32) == torch.bfloat16
    assert (
        drafter.resolve_draft_dtype("auto", "cpu", torch.float16) == torch.float16
    )  # a half target: its own
    assert drafter.resolve_draft_dtype("auto", "cuda:0", torch.float32) == torch.float32
    assert drafter.resolve_draft_dtype(None, "cpu", torch.float32) == torch.float32
    assert drafter.resolve_draft_dtype("fp32", "cpu", torch.bfloat16) == torch.float32
    monkeypatch.setattr(drafter, "cpu_has_fast_bf16", lambda: False)
    assert drafter.resolve_draft_dtype("auto", "cpu", torch.float32) == torch.float32


def test_tree_sweep_runs_every_tree_with_every_draft_dtype(target, draft_dir, prompts_file):
    import torch

    from eagle.drafter import HeadDrafter
    from eagle.export import load_exported_head
    from eagle.prompts import load_prompt_sets

    tree_sweep = _load_script("tree_sweep")
    drafters = {
        str(d).removeprefix("torch."): HeadDrafter(load_exported_head(draft_dir, target, dtype=d))
        for d in (torch.float32, torch.bfloat16)
    }
    sets = load_prompt_sets([str(prompts_file)], target.tokenizer)
    prompts = [(s, pid, ids) for s, items in sets for pid, ids in items]
    trees = {
        "chain:2": tree_sweep.parse_tree("chain:2"),
        "dynamic:2:2:4+lookup": tree_sweep.parse_tree("dynamic:2:2:4+lookup"),
    }
    rows = tree_sweep.sweep(target, drafters, prompts, trees, 6)["rows"]
    names = {r["tree"] for r in rows}
    assert names == {
        "plain",
        "chain:2@float32",
        "chain:2@bfloat16",
        "dynamic:2:2:4+lookup@float32",
        "dynamic:2:2:4+lookup@bfloat16",
    }
    overall = [r for r in rows if r["set"] == "overall"]
    assert len(overall) == 5 and all(r["greedy_match"] == "3/3" for r in overall)
    assert all(r["tau"] >= 1.0 for r in overall if r["tree"] != "plain")


def test_tree_sweep_compares_heads_prompt_by_prompt(target, draft_dir, prompts_file):
    """Several heads (NAME=DIR): runs named TREE@NAME, each compared with the first prompt by prompt. The same
    head under two names must come out identical on every prompt."""
    tree_sweep = _load_script("tree_sweep")
    from eagle.drafter import HeadDrafter
    from eagle.export import load_exported_head
    from eagle.prompts import load_prompt_sets

    drafts = tree_sweep.parse_drafts([f"a={draft_dir}", f"b={draft_dir}"])
    assert list(drafts) == ["a", "b"]
    drafters = {name: HeadDrafter(load_exported_head(folder, target)) for name, folder in drafts.items()}
    sets = load_prompt_sets([str(prompts_file)], target.tokenizer)
    prompts = [(s, pid, ids) for s, items in sets for pid, ids in items]
    result = tree_sweep.sweep(target, drafters, prompts, {"chain:2": tree_sweep.parse_tree("chain:2")}, 6)
    assert {r["tree"] for r in result["rows"]} == {"plain", "chain:2@a", "chain:2@b"}
    assert [p["id"] for p in result["per_prompt"]["chain:2@a"]] == [pid for _, pid, _ in prompts]
    (pair,) = result["paired"]
    assert (pair["run"], pair["against"], pair["prompts"]) == ("chain:2@b", "chain:2@a", len(prompts))
    assert (pair["higher"], pair["lower"], pair["mean_tau_difference"]) == (0, 0, 0.0)


def test_tree_sweep_paired_counts_and_draft_names():
    tree_sweep = _load_script("tree_sweep")
    per_prompt = {
        "x": [{"tau": 2.0}, {"tau": 3.0}, {"tau": 2.5}],
        "y": [{"tau": 2.5}, {"tau": 2.0}, {"tau": 3.5}],
    }
    (pair,) = tree_sweep.paired(per_prompt)
    assert (pair["higher"], pair["lower"], pair["prompts"]) == (2, 1, 3)
    assert pair["mean_tau_difference"] == pytest.approx((0.5 - 1.0 + 1.0) / 3)
    assert pair["standard_error"] == pytest.approx(statistics.stdev([0.5, -1.0, 1.0]) / 3**0.5)
    assert tree_sweep.parse_drafts(["runs/x"]) == {"": Path("runs/x")}
    with pytest.raises(EagleError, match="NAME=DIR"):
        tree_sweep.parse_drafts(["runs/x", "runs/y"])
    with pytest.raises(EagleError, match="given twice"):
        tree_sweep.parse_drafts(["a=runs/x", "a=runs/y"])


def test_summarize_definitions():
    """Pooled tau over steps, median over prompts, per-depth rates over verification steps."""
    a = GenerationResult(
        tokens=[1] * 7, accept_lengths=[3, 3], target_forwards=2, accepted_per_depth=[2, 2, 0], total_time=1.0
    )
    b = GenerationResult(
        tokens=[1] * 3, accept_lengths=[1, 1], target_forwards=2, accepted_per_depth=[0, 0, 0], total_time=1.0
    )
    from eagle.evaluate import PromptRun

    s = summarize([PromptRun("x", "a", 5, a), PromptRun("x", "b", 5, b)], temperature=0.0)
    assert s["acceptance_length_mean"] == 2.0
    assert s["acceptance_length_median"] == 2.0
    assert s["per_depth_acceptance"] == [0.5, 0.5, 0.0]
    assert s["accept_length_histogram"] == [2, 0, 2, 0]
    assert s["tokens_per_second"] == 5.0 and s["speedup"] is None and s["greedy_match_rate"] is None


def test_benchmark_table_is_rebuilt_from_all_results(tmp_path):
    bench = _load_script("benchmark")

    def result(date, tau_chat, speedup):
        return {
            "date": date,
            "head": "runs/demo/export",
            "target": "smollm2-135m-instruct",
            "device": "cpu",
            "device_name": "cpu",
            "dtype": "float32",
            "settings": {"temperature": 0.0},
            "tree": {
                "policy": "dynamic",
                "depth": 5,
                "top_k": 4,
                "total_tokens": 8,
                "total_tokens_requested": "auto",
            },
            "prompt_sets": {
                "dev-chat": {"acceptance_length_mean": tau_chat},
                "dev-code": {"acceptance_length_mean": 1.5},
            },
            "overall": {"speedup": speedup, "prompt_lookup_speedup": 1.1, "greedy_match_rate": 1.0},
        }

    (tmp_path / "b.json").write_text(json.dumps(result("2026-12-02T10:00:00+00:00", 2.5, 1.8)))
    (tmp_path / "a.json").write_text(json.dumps(result("2026-12-01T10:00:00+00:00", 2.0, 1.3)))
    (tmp_path / "README.md").write_text("# Benchmarks\n\nintro kept\n")
    readme = bench.update_readme(tmp_path).read_text()
    assert readme.startswith("# Benchmarks\n\nintro kept\n")
    lines = [line for line in readme.splitlines() if line.startswith("| 2026")]
    assert len(lines) == 2 and "| a |" in lines[0] and "| b |" in lines[1]  # oldest first
    assert "| 2.00 | 1.50 | 1.30x | 1.10x | 100% |" in lines[0]
    assert "dynamic d5 k4 n8 (auto)" in lines[1]
    lookup = result("2026-12-03T10:00:00+00:00", 2.4, 1.2)
    lookup["tree"]["lookup_ngram"] = 3
    lookup["settings"]["cpu_prepacked_layers"] = 211
    (tmp_path / "c.json").write_text(json.dumps(lookup))
    row = [x for x in bench.update_readme(tmp_path).read_text().splitlines() if "| c |" in x][0]
    assert "| cpu prepacked float32 |" in row and "dynamic d5 k4 n8 (auto) + lookup" in row
    assert "| - | 0 |" in row  # no prompt counts in this synthetic report
    lookup["settings"]["draft_dtype"] = "bfloat16"
    (tmp_path / "c.json").write_text(json.dumps(lookup))
    row = [x for x in bench.update_readme(tmp_path).read_text().splitlines() if "| c |" in x][0]
    assert "| cpu prepacked float32, bfloat16 head |" in row
    served = {**result("2026-12-03T10:00:00+00:00", 2.1, 1.4), "engine": "vllm", "vllm_version": "0.32.0",
              "tree": {"policy": "chain", "depth": 3}}
    (tmp_path / "c.json").write_text(json.dumps(served))
    row = [x for x in bench.update_readme(tmp_path).read_text().splitlines() if "| c |" in x][0]
    assert "| vLLM 0.32.0 cpu float32 | chain d3 |" in row  # an eval through vLLM says so
    (tmp_path / "c.json").unlink()
    (tmp_path / "a.json").unlink()
    again = bench.update_readme(tmp_path).read_text()
    assert again.count("| 2026") == 1 and "intro kept" in again
    regen = {"kind": "regen-throughput", "engines": {e: {
        "conversations": 64, "answer_tokens": 5000, "seconds": s, "conversations_per_s": 64 / s,
        "tokens_per_s": 5000 / s, "capture_features": e == "hf", "answers_identical_to_hf": same,
    } for e, s, same in (("hf", 40.0, 64), ("vllm", 50.0, 63))}}
    (tmp_path / "d.json").write_text(json.dumps(regen))
    text = bench.update_readme(tmp_path).read_text()
    assert "| d | hf | 64 | 5,000 | 40 | 1.60 | 125 | yes | 64 |" in text
    assert "| d | vllm | 64 | 5,000 | 50 | 1.28 | 100 | no | 63 |" in text
    assert text.count("| 2026") == 1  # not a row of the results table
    assert bench.update_readme(tmp_path).read_text() == text  # rebuilding is stable
    # a vLLM speed file: two prompts 2x and 1x faster (per-prompt mean 1.5, SE 0.5; the second writes 20% more
    # tokens than plain decoding in 20% more time), one near-tie and one other mismatch in bf16
    prompts = [{"time_s": 1.0, "baseline_time_s": 2.0, "new_tokens": 10, "baseline_new_tokens": 10},
               {"time_s": 2.4, "baseline_time_s": 2.0, "new_tokens": 12, "baseline_new_tokens": 10}]
    rows, reports = [], {}
    for dtype, eager in (("float32", False), ("bfloat16", True)):
        rows.append({"dtype": dtype, "k": 3, "tau": 1.8, "per_position": [0.45, 0.25, 0.1], "tok_s_plain": 20.0,
                     "tok_s_spec": 26.7, "speedup": 4 / 3, "batched_speedup": 0.5, "greedy_match_rate": 0.5,
                     "mismatches": {"mismatched": 2 * (dtype == "bfloat16"), "near_ties": int(dtype == "bfloat16"),
                                    "not_near_ties": int(dtype == "bfloat16")}})
        reports[f"{dtype}-k3"] = {"settings": {"vllm": {"enforce_eager": eager}}, "prompts": prompts}
    vllm = {"kind": "vllm-speed", "draft": "runs/demo/export", "rows": rows, "reports": reports}
    (tmp_path / "e.json").write_text(json.dumps(vllm))
    text = bench.update_readme(tmp_path).read_text()
    assert ("| e | `runs/demo/export` | float32 | 3 | compiled | 2 | 1.80 | 0.45 | 20.0 | 26.7 | 1.33x | 1.50 ± 0.50 "
            "| 0.50x | 50% | - |") in text
    assert "| bfloat16 | 3 | eager | 2 |" in text and "| 50% (1 near-ties, 1 not) |" in text
    assert text.count("| 2026") == 1 and bench.update_readme(tmp_path).read_text() == text
    # ten prompts whose times follow time/plain = 0.1 + 1.2 / tau: 2x needs tau 1.2 / (1/2 - 0.1) = 3, and a
    # chain of 3 with every draft accepted (tau 4) gives 1 / (0.1 + 1.2 / 4) = 2.5x
    fitted = [{"acceptance_length_mean": tau, "time_s": 0.1 + 1.2 / tau, "baseline_time_s": 1.0, "new_tokens": 96,
               "baseline_new_tokens": 96} for tau in (1.2, 1.5, 1.7, 2.0, 2.2, 2.5, 2.8, 3.1, 3.5, 3.9)]
    vllm["rows"], vllm["reports"] = rows[:1], {"float32-k3": {**reports["float32-k3"], "prompts": fitted}}
    (tmp_path / "f.json").write_text(json.dumps(vllm))
    assert "| 3.00 ± 0.00 (2.50x) |" in bench.update_readme(tmp_path).read_text()
    # rows with unmeasured values (None) render as "-" instead of stopping the whole rebuild
    holes = {"tok_s_plain": None, "tok_s_spec": None, "speedup": None, "greedy_match_rate": None, "tau": None,
             "per_position": []}
    vllm["rows"] = [{**rows[0], **holes}]
    (tmp_path / "f.json").write_text(json.dumps(vllm))
    batch = {"kind": "vllm-batch-schedule", "draft": "d", "k": 3, "schedules": {},
             "rows": [{"dtype": "float32", "batch_size": 2, "tok_s_plain": None, "tok_s_head": 3.0, "speedup": None,
                       "speedup_scheduled": None, "greedy_match_rate": None}]}
    (tmp_path / "g.json").write_text(json.dumps(batch))
    text = bench.update_readme(tmp_path).read_text()
    assert "| f | `runs/demo/export` | float32 | 3 | compiled | 10 | - | - | - | - | - |" in text
    assert "| g | `d` | float32 | 3 | 2 | - | 3.0 | - | `None` | - | - | - |" in text


def test_time_limit_runs_the_sets_in_turn_and_keeps_a_minimum(tmp_path, target, draft_dir, monkeypatch):
    """eval.max_minutes with a hand-wound clock: every prompt takes 20 "seconds"; prompts alternate between the
    sets, none starts that would end after the limit, and each set still gets MIN_PROMPTS_PER_SET."""
    import eagle.evaluate as E
    from eagle.deadline import Deadline

    files = []
    for name in ("first", "second"):
        path = tmp_path / f"{name}.jsonl"
        path.write_text(
            "".join(json.dumps({"id": f"{name}{i}", "prompt": f"Count to {i}:"}) + "\n" for i in range(6))
        )
        files.append(str(path))
    clock = [0.0]
    monkeypatch.setattr(E, "Deadline", lambda minutes: Deadline(minutes, clock=lambda: clock[0]))
    real = E._Methods.run

    def twenty_seconds(self, *args, **kwargs):
        clock[0] += 20.0
        return real(self, *args, **kwargs)

    monkeypatch.setattr(E._Methods, "run", twenty_seconds)
    base = dict(prompts=files, max_new_tokens=4, prompt_lookup=False)
    said = io.StringIO()
    console = Console(file=said, width=200)
    report = evaluate(_cfg(tmp_path, draft_dir, files[0], **base, max_minutes=2.5), target, console=console)
    assert (
        "the time limit (2.5 min, eval.max_minutes) ran out; 5 of 12 prompts were not run" in said.getvalue()
    )
    # starts at 0, 20, ..., 120 s: the 7th prompt ends at 140 s; an 8th would end at 160 s > 150 s
    assert [p["id"] for p in report["prompts"]] == [f"first{i}" for i in range(4)] + [
        f"second{i}" for i in range(3)
    ]
    assert report["settings"]["prompts_not_run"] == 5 and report["settings"]["max_minutes"] == 2.5
    clock[0] = 0.0
    short = evaluate(_cfg(tmp_path, draft_dir, files[0], **base, max_minutes=0.5), target, console=_quiet())
    assert [s["num_prompts"] for s in short["prompt_sets"].values()] == [E.MIN_PROMPTS_PER_SET] * 2
    with pytest.raises(EagleError, match="eval.max_minutes"):
        EvalConfig(max_minutes=0).validate()


def test_a_target_with_a_recurrent_state_is_verified_in_chains_and_the_report_says_so(
    tmp_path, tokenizer, prompts_file
):
    from eagle.testing import family_model

    model = family_model("qwen3_next", vocab_size=VOCAB)
    target = Target.from_model(model, tokenizer, name="tiny-hybrid")
    tree = TreeConfig("dynamic", depth=3, top_k=2, total_tokens="auto", lookup_ngram=2)
    cfg = _cfg(tmp_path, "unused", prompts_file, tree=tree, chain_depth=0)
    console = Console(record=True, width=200, file=open("/dev/null", "w"))  # noqa: SIM115
    report = evaluate(cfg, target, drafter=OracleDrafter(model), console=console)
    # one path a step, as deep as the tree asked for: nothing to autotune
    assert report["tree"]["verification"] == "chain" and report["tree"]["policy"] == "chain"
    assert report["tree"]["depth"] == 3 and report["tree"]["autotune"] is None
    assert report["overall"]["greedy_match_rate"] == 1.0
    assert report["overall"]["acceptance_length_mean"] > 2  # the oracle's chains are accepted
    assert "one path verified a step" in " ".join(console.export_text().split())


# ------------------------------------------------------------------ multi-turn questions (MT-bench) and sampling

MT_QUESTIONS = [
    {"question_id": 1, "category": "writing", "turns": ["Write a haiku about rain.", "Now make it about snow."]},
    {"question_id": 2, "category": "math", "turns": ["What is 12 times 7?", "And divided by 3?"]},
    {"question_id": 3, "category": "writing", "turns": ["Name three colours.", "Sort them by length."]},
]


@pytest.fixture(scope="module")
def mt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("mt") / "question.jsonl"  # MT-bench's own question-file shape
    path.write_text("".join(json.dumps(q) + "\n" for q in MT_QUESTIONS))
    return path


def _pooled(records: list[dict], key: str = "acceptance_length_mean") -> float:
    """tau pooled over verification steps, from the per-prompt records alone."""
    return sum(r[key] * r["target_forwards"] for r in records) / sum(r["target_forwards"] for r in records)


def _speedup(records: list[dict]) -> float:
    spec = sum(r["new_tokens"] for r in records) / sum(r["time_s"] for r in records)
    plain = sum(r["baseline_new_tokens"] for r in records) / sum(r["baseline_time_s"] for r in records)
    return spec / plain


def test_multi_turn_questions_ask_the_second_turn_after_the_targets_own_answer(tmp_path, target, draft_dir,
                                                                               mt_file):
    """Each question's second turn runs right after its first, on the conversation with plain decoding's
    answer; the report breaks tau and speedup down by category and by turn, and prints that table."""
    from eagle.evaluate import eos_token_ids
    from eagle.prompts import prompt_token_ids
    from eagle.sampling import Sampling
    from eagle.speculate import plain_generate

    console = Console(record=True, width=200, file=open("/dev/null", "w"))  # noqa: SIM115
    report = evaluate(_cfg(tmp_path, draft_dir, mt_file, chain_depth=2), target, console=console)
    records = report["prompts"]
    assert [(r["id"], r["turn"], r["category"]) for r in records] == [
        ("1", 1, "writing"), ("1", 2, "writing"), ("2", 1, "math"), ("2", 2, "math"),
        ("3", 1, "writing"), ("3", 2, "writing")]
    assert report["settings"]["prompts_not_run"] == 0
    # the second turn's prompt holds the first turn's plain answer: check its length against a re-render
    for q in MT_QUESTIONS:
        ids = prompt_token_ids({"messages": [{"role": "user", "content": q["turns"][0]}]}, target.tokenizer)
        tokens = plain_generate(target.model, torch.tensor([ids]), 12,
                                Sampling(eos_token_ids=tuple(eos_token_ids(target)))).tokens
        answer = target.tokenizer.decode(tokens, skip_special_tokens=True).strip()
        messages = [{"role": "user", "content": q["turns"][0]}, {"role": "assistant", "content": answer},
                    {"role": "user", "content": q["turns"][1]}]
        second = next(r for r in records if r["id"] == str(q["question_id"]) and r["turn"] == 2)
        assert second["prompt_tokens"] == len(prompt_token_ids({"messages": messages}, target.tokenizer))
    parts = report["breakdown"]["question"]
    assert list(parts["category"]) == ["writing", "math"] and list(parts["turn"]) == ["1", "2"]
    for group, pick in (("category", lambda r, c: r["category"] == c), ("turn", lambda r, t: str(r["turn"]) == t)):
        for value, summary in parts[group].items():
            mine = [r for r in records if pick(r, value)]
            assert summary["num_prompts"] == len(mine)
            assert summary["acceptance_length_mean"] == pytest.approx(_pooled(mine))
            assert summary["chain_acceptance_length_mean"] == pytest.approx(
                _pooled(mine, "chain_acceptance_length_mean"))
            assert summary["speedup"] == pytest.approx(_speedup(mine))
    text = console.export_text()
    assert "question: by category and turn" in text and "writing" in text and "turn 2" in text


def test_follow_up_turns_are_named_in_order_and_refuse_a_prompt_without_one(tokenizer):
    from eagle.prompts import EvalPrompt, next_turn

    first = EvalPrompt("q", [1], "math", ({"role": "user", "content": "a?"},), ("b?", "c?"))
    second = next_turn(first, "A.", tokenizer)
    assert second.turn == 2 and second.follow_ups == ("c?",) and second.category == "math"
    assert [m["content"] for m in second.messages] == ["a?", "A.", "b?"]
    third = next_turn(second, "B.", tokenizer)
    assert third.turn == 3 and third.follow_ups == () and len(third.ids) > len(second.ids)
    with pytest.raises(EagleError, match="has no next turn"):
        next_turn(third, "C.", tokenizer)


def test_mt_bench_is_a_named_set_of_80_two_turn_questions():
    from collections import Counter

    from eagle.prompts import load_prompts

    rows = load_prompts("mt-bench")
    assert len(rows) == 80 and all(len(r["messages"]) == 1 and len(r["follow_ups"]) == 1 for r in rows)
    assert Counter(r["category"] for r in rows) == {c: 10 for c in (
        "writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")}


def test_hf_route_reads_gsm8k_alpaca_and_spec_bench_files(tmp_path):
    """``hf:<file>`` reads question files in the shapes those benchmarks ship (here small local copies in the
    same shapes; online, hf:<hub id>[:split] reads the hub's)."""
    from eagle.prompts import load_prompts

    gsm = tmp_path / "gsm8k.jsonl"
    gsm.write_text(json.dumps({"question": "Tom has 3 apples and buys 2. How many?", "answer": "5"}) + "\n")
    alpaca = tmp_path / "alpaca.json"
    alpaca.write_text(json.dumps([{"instruction": "Translate to French.", "input": "Good morning", "output": "x"},
                                  {"instruction": "Name a prime.", "input": "", "output": "2"}]))
    spec = tmp_path / "question.jsonl"
    spec.write_text(json.dumps({"question_id": "t-1", "category": "translation",
                                "turns": ["Translate: hello", "Now into German."]}) + "\n")
    (q,) = load_prompts(f"hf:{gsm}")
    assert q["messages"] == [{"role": "user", "content": "Tom has 3 apples and buys 2. How many?"}]
    a1, a2 = load_prompts(f"hf:{alpaca}")
    assert a1["messages"][0]["content"] == "Translate to French.\n\nGood morning"
    assert a2["messages"][0]["content"] == "Name a prime."
    (s,) = load_prompts(f"hf:{spec}")
    assert (s["id"], s["category"], s["follow_ups"]) == ("t-1", "translation", ["Now into German."])
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "no question here"}) + "\n")
    with pytest.raises(EagleError, match="'turns' \\(MT-bench, Spec-Bench\\), 'question'"):
        load_prompts(str(bad))
    with pytest.raises(EagleError, match="non-empty strings"):
        spec.write_text(json.dumps({"turns": []}) + "\n")
        load_prompts(str(spec))


def test_sampling_settings_reach_the_loop_and_the_figures_follow_from_the_runs(tmp_path, target, draft_dir,
                                                                               prompts_file, monkeypatch):
    """At T=1 with top-p and top-k: every generation gets the eval's sampling settings (top_k=1 makes sampling
    greedy, so the output must equal greedy decoding), and every summary figure is recomputed from the
    per-prompt records."""
    import eagle.evaluate as ev
    from eagle.sampling import Sampling

    seen, plain_generate = [], ev.plain_generate
    # where each generation function takes the prompt ids and the Sampling, positionally as evaluate calls them
    positions = {"speculative_generate": (2, 5), "plain_generate": (1, 3)}
    for name, (ids_at, sampling_at) in positions.items():
        real = getattr(ev, name)

        def spy(*args, _real=real, _at=(ids_at, sampling_at), **kw):  # records, then runs the real function
            result = _real(*args, **kw)
            seen.append((args[_at[1]], args[_at[0]][0].tolist(), result.tokens))
            return result

        monkeypatch.setattr(ev, name, spy)
    cfg = _cfg(tmp_path, draft_dir, prompts_file, temperature=1.0, top_p=0.9, top_k=1, prompt_lookup=False)
    report = evaluate(cfg, target, console=_quiet())
    eos = tuple(report["settings"]["eos_token_ids"])
    # speculative and plain on 3 prompts (the chain is the tree here, so it is not run twice)
    assert len(seen) == 2 * 3 and all(s == Sampling(1.0, 0.9, 1, eos) for s, _, _ in seen)
    greedy = Sampling(eos_token_ids=eos)
    for _, prompt, tokens in seen:
        assert tokens == plain_generate(target.model, torch.tensor([prompt]), len(tokens), greedy).tokens
    cfg = _cfg(tmp_path, draft_dir, prompts_file, temperature=1.0, top_p=0.8, top_k=30, prompt_lookup=False)
    report = evaluate(cfg, target, console=_quiet())
    records = report["prompts"]
    for summary, mine in ((report["overall"], records), (report["prompt_sets"]["mini"], records)):
        assert summary["num_prompts"] == len(mine) == 3
        assert summary["new_tokens"] == sum(r["new_tokens"] for r in mine)
        assert summary["target_forwards"] == sum(r["target_forwards"] for r in mine)
        assert summary["acceptance_length_mean"] == pytest.approx(_pooled(mine))
        assert summary["acceptance_length_median"] == pytest.approx(
            statistics.median(r["acceptance_length_mean"] for r in mine))
        assert summary["chain_acceptance_length_mean"] == pytest.approx(_pooled(mine, "chain_acceptance_length_mean"))
        assert summary["speedup"] == pytest.approx(_speedup(mine))
    assert (report["settings"]["temperature"], report["settings"]["top_p"], report["settings"]["top_k"]) == (
        1.0, 0.8, 30)


@pytest.mark.parametrize("spec, call", [
    ("hf:openai/gsm8k:main:test", ("openai/gsm8k", "test", "main")),
    ("hf:tatsu-lab/alpaca", ("tatsu-lab/alpaca", None, None)),
    ("hf:org/questions:test[:100]", ("org/questions", "test[:100]", None)),
    ("hf:org/questions:test", ("org/questions", "test", None)),
])
def test_hf_prompt_specs_name_dataset_config_and_split(spec, call, monkeypatch):
    import eagle.prompts as prompts

    calls = []
    monkeypatch.setattr(prompts, "load_hf_dataset", lambda *args: calls.append(args) or [{"question": "q?"}])
    assert prompts.load_prompts(spec)[0]["messages"] == [{"role": "user", "content": "q?"}]
    assert calls == [call]


def test_hf_prompts_offline_say_what_to_do(monkeypatch):
    from eagle.prompts import load_prompts

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(EagleError, match="Hub ids need internet access.*give a local file"):
        load_prompts("hf:no-such-org/no-such-questions:test")
