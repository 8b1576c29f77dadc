"""scripts/gpu_session.sh -- what a GPU session runs -- checked here on the CPU with a tiny target, so that the
script is known to work before a device machine is lent: recipe (a) in a time budget, then its benchmark record."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_gpu_session_script_runs_recipe_a_and_records_it(tmp_path, tiny_target_folder):
    env = {**os.environ, "SKIP_SMOKE": "1", "NAME": "gpu-session-test", "RUN_DIR": str(tmp_path / "run"),
           "OUT": str(tmp_path / "out"), "BENCH_DIR": str(tmp_path / "bench"), "OMP_NUM_THREADS": "1"}
    small = [f"target.name={tiny_target_folder}", "target.device=cpu", "target.dtype=float32",
             "data.sources=[chitchat:12]", "data.max_conversations=12", "data.regen_max_new_tokens=8",
             "data.max_length=128", "train.max_steps=6", "train.batch_size=2", "train.bf16=false",
             "eval.max_prompts=2", "eval.max_new_tokens=8", "eval.tree.total_tokens=8", "head.draft_vocab_size=256",
             "eval.prompt_lookup=false", "eval.cpu_prepack=false"]
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_session.sh"), "2", *small], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads((tmp_path / "bench" / "gpu-session-test.json").read_text())
    assert record["train_steps"] == 6 and record["train_tokens_per_s_median"] > 0
    assert record["eval"]["prompts"] == 4 and record["eval"]["greedy_match_rate"] == 1.0
    assert set(record["eval"]["tau"]) == {"dev-chat", "dev-code"}
    assert {"report.json", "metrics.jsonl", "gpu-session-test.json"} <= {p.name for p in (tmp_path / "out").iterdir()}
