"""The families matrix (tests/_families.py): every decoder family of eagle.testing.FAMILY_MATRIX through every stage
of the product, and docs/FAMILIES.md, which must be this run's table."""

from __future__ import annotations

import pytest
from _families import DOC, STAGES, UNSUPPORTED, render_table, run_family

from eagle.testing import FAMILY_MATRIX

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")

RESULTS: dict[str, dict] = {}  # family -> stage -> result, filled by the matrix test for the docs check


@pytest.mark.parametrize("name", [entry.name for entry in FAMILY_MATRIX])
def test_family_goes_through_every_stage(name, tmp_path):
    results = run_family(name, tmp_path)
    RESULTS[name] = results
    failed = {stage: r["note"] for stage, r in results.items() if r["status"] == "fail"}
    assert not failed, failed
    assert list(results) == list(STAGES)
    unsupported = {stage for stage, r in results.items() if r["status"] == "unsupported"}
    assert unsupported == set(UNSUPPORTED.get(name, {}))


def test_the_matrix_spans_what_people_train_for():
    kinds = [entry.kind for entry in FAMILY_MATRIX]
    assert len(FAMILY_MATRIX) >= 15
    assert kinds.count("moe") + kinds.count("hybrid") >= 6
    assert len({entry.name for entry in FAMILY_MATRIX}) == len(FAMILY_MATRIX)


def test_the_docs_table_is_this_runs_table():
    if set(RESULTS) != {entry.name for entry in FAMILY_MATRIX}:
        pytest.skip("the docs table is checked after the whole matrix ran in this session")
    assert DOC.read_text() == render_table(RESULTS), (
        "docs/FAMILIES.md is not this run's table: rewrite it with `python tests/_families.py`"
    )


def test_the_chain_verification_benchmark_runs_and_checks_its_outputs(tmp_path):
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "chain_verification_benchmark.py"
    spec = importlib.util.spec_from_file_location("chain_verification_benchmark", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "bench.json"
    assert bench.main(["--families", "qwen3_5", "llama", "--accept", "0.5", "1.0", "--prompts", "2",
                       "--max-new-tokens", "12", "--out", str(out)]) == 0
    rows = {(r["family"], r["draft_accept_rate"]): r for r in json.loads(out.read_text())["rows"]}
    assert rows[("qwen3_5", 1.0)]["verification"] == "chain" and rows[("llama", 1.0)]["verification"] == "tree"
    # right drafts are accepted whole (no replay) but past the reference's end; wrong ones are replayed after
    assert rows[("qwen3_5", 1.0)]["replays_per_step"] < rows[("qwen3_5", 0.5)]["replays_per_step"]
    assert rows[("llama", 0.5)]["replays_per_step"] == 0
    assert rows[("qwen3_5", 1.0)]["tau"] > rows[("qwen3_5", 0.5)]["tau"]


def test_a_vllm_refusal_is_recorded_with_the_cause_vllm_gave(tmp_path):
    """``python tests/_families.py --vllm`` keeps, for a family vLLM refuses, the first exception line of the
    worker's whole output that states a cause (vLLM prints it long before the errors that end the worker)."""
    from _families import root_cause

    log = tmp_path / "worker.log"
    log.write_text("(EngineCore pid=1) ERROR [core.py:1] Exception: WorkerProc initialization failed due to ...\n"
                   "(Worker pid=2) ERROR [runner.py:9] RuntimeError: Model does not support EAGLE3 interface\n"
                   "(EngineCore pid=1) ERROR [core.py:2] RuntimeError: Engine core initialization failed.\n")
    message = f"vLLM on the tiny x target: the vLLM worker failed (exit status 1; its whole output is in {log}):"
    assert root_cause(message) == "RuntimeError: Model does not support EAGLE3 interface"
    assert root_cause("vLLM on the tiny x target: KeyError: 'layers.1.mlp.gate.bias'\n...") == (
        "KeyError: 'layers.1.mlp.gate.bias'")
