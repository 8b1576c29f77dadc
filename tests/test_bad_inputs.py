"""The bad-input sweep (the table in tests/BAD_INPUTS.md): each row feeds one bad input to an ``eagle`` stage.

A module fixture makes a complete tiny run (prepare -> collect -> train -> export -> eval on a 2-layer llama with
the SmolLM2 tokenizer). Every row then runs the command line (``recipes.cli.main``, the console script's entry
point, in this process; two rows also through the real ``eagle`` executable) with one bad input, and checks:
exit status 2 (argparse's own errors: also 2), exactly one ``error:`` line that names the problem and the fix,
no traceback, and every file of the run byte-identical afterwards. Where a stage can write, the row points it at
the run's own output (data, features, report) so that "nothing already written is damaged" is really tested.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from safetensors.torch import load_file, save_file

from recipes import cli

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 49152  # the SmolLM2 tokenizer's


@dataclass
class Run:
    """A finished tiny run and the paths the rows need."""

    root: Path  # everything the fixture wrote (the snapshot covers all of it)
    config: Path
    target: Path
    other: Path  # a tiny target with another vocabulary (256) and the same tokenizer
    data: Path
    features: Path
    train: Path
    export: Path
    report: Path
    chats: Path


pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")  # tests build Accelerators


def _config_text(root: Path) -> str:
    return f"""
run_dir: {root}/run
target: {{name: {root}/target}}
data: {{sources: [{root}/chats.jsonl], regenerate: false, max_length: 64, val_fraction: 0.2,
       output_dir: "{{run_dir}}/data"}}
collect: {{output_dir: "{{run_dir}}/features", dtype: float32, batch_tokens: 512, shard_tokens: 400}}
head: {{kind: eagle3, draft_vocab_size: 64}}
train: {{output_dir: "{{run_dir}}/train", max_steps: 4, batch_size: 4, eval_every: 0, save_every: 2,
        keep_last: 2, report_to: [none], progress: false}}
export: {{checkpoint: "{{run_dir}}/train/final", output_dir: "{{run_dir}}/export", dtype: float32}}
eval: {{draft: "{{run_dir}}/export", prompts: [{root}/prompts.jsonl], max_new_tokens: 8, warmup: 0,
       prompt_lookup: false, report: "{{run_dir}}/eval/report.json", tree: {{policy: chain, depth: 2}}}}
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_target_folder) -> Run:
    from eagle.testing import save_tiny_target

    root = tmp_path_factory.mktemp("bad-inputs")
    shutil.copytree(tiny_target_folder, root / "target")
    save_tiny_target(root / "other", "llama", vocab_size=256, hidden_size=32, num_layers=2)
    chats = [
        {
            "messages": [
                {"role": "user", "content": f"Question {i}: what is {i} plus {i}?"},
                {"role": "assistant", "content": f"The answer is {2 * i}. Anything else about {i}?"},
            ]
        }
        for i in range(24)
    ]
    (root / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    prompts = [{"id": str(i), "prompt": f"Count to {i}:"} for i in range(3)]
    (root / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    (root / "run.yaml").write_text(_config_text(root))
    for stage in ("prepare", "collect", "train", "export", "eval"):
        assert cli.main([stage, "--config", str(root / "run.yaml")]) == 0, stage
    run_dir = root / "run"
    return Run(
        root=root,
        config=root / "run.yaml",
        target=root / "target",
        other=root / "other",
        data=run_dir / "data",
        features=run_dir / "features",
        train=run_dir / "train",
        export=run_dir / "export",
        report=run_dir / "eval" / "report.json",
        chats=root / "chats.jsonl",
    )


def snapshot(folder: Path) -> dict[str, str]:
    """sha256 of every file under ``folder``."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


# ----------------------------------------------------------------------------------------- bad input makers


def write(path: Path, data: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return path


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def jsonl(*records) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def chat(user: str, answer: str) -> dict:
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}


def tool_chat(function: dict) -> dict:
    """A conversation whose answer calls a tool, OpenAI-style, with ``function`` as the call."""
    call = {"id": "c1", "type": "function", "function": function}
    return {"messages": [{"role": "user", "content": "weather?"},
                         {"role": "assistant", "content": None, "tool_calls": [call]}]}


def first_shard(features: Path) -> Path:
    return sorted((features / "train").glob("shard-*.safetensors"))[0]


def shard_changed(r: Run, tmp: Path, change: Callable[[dict], None]) -> Path:
    """A copy of the features whose first shard's tensors were changed (and its checksum updated to match)."""
    from train.shards import sha256_file

    features = copy(r.features, tmp / "features")
    path = first_shard(features)
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path))
    manifest = json.loads((features / "manifest.json").read_text())
    for entry in manifest["splits"]["train"]["shards"]:
        if entry["file"] == path.name:
            entry["sha256"] = sha256_file(path)
    (features / "manifest.json").write_text(json.dumps(manifest))
    return features


def manifest_changed(r: Run, tmp: Path, change: Callable[[dict], None]) -> Path:
    features = copy(r.features, tmp / "features")
    manifest = json.loads((features / "manifest.json").read_text())
    change(manifest)
    (features / "manifest.json").write_text(json.dumps(manifest))
    return features


def head_changed(r: Run, tmp: Path, change: Callable[[dict], None]) -> Path:
    export = copy(r.export, tmp / "export")
    tensors = load_file(str(export / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(export / "model.safetensors"))
    return export


def prepared(tmp: Path, ids: list[list], masks: list[list]) -> Path:
    """Prepared data (train + val) from raw rows, saved as `eagle prepare` saves it."""
    from datasets import Dataset

    for split in ("train", "val"):
        Dataset.from_dict({"input_ids": ids, "loss_mask": masks}).save_to_disk(str(tmp / "prep" / split))
    return tmp / "prep"


def truncate(path: Path, keep: int) -> Path:
    path.write_bytes(path.read_bytes()[:keep])
    return path


def flip_bytes(path: Path, start: int, count: int = 16) -> Path:
    data = bytearray(path.read_bytes())
    for i in range(start, start + count):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))
    return path


def latest_checkpoint(train_dir: Path) -> Path:
    return sorted((train_dir / "checkpoints").glob("step-*"))[-1]


def custom_code_target(tmp: Path) -> Path:
    folder = tmp / "remote"
    write(
        folder / "config.json",
        json.dumps(
            {
                "model_type": "planted",
                "auto_map": {"AutoConfig": "planted.Config", "AutoModelForCausalLM": "x.M"},
            }
        ),
    )
    write(folder / "planted.py", f"import pathlib\npathlib.Path({str(tmp / 'RAN')!r}).touch()\n")
    return folder


def pickle_only_head(r: Run, tmp: Path) -> Path:
    export = copy(r.export, tmp / "export")
    torch.save(load_file(str(export / "model.safetensors")), export / "pytorch_model.bin")
    (export / "model.safetensors").unlink()
    return export


def mkdir(path: Path) -> Path:
    path.mkdir(parents=True)
    return path


# -------------------------------------------------------------------------------------------------- the table


def cmd(stage: str, r: Run, *args: str) -> list[str]:
    return [stage, "--config", str(r.config), *args]


def train_with(r: Run, tmp: Path, *args: str) -> list[str]:
    """``eagle train`` into a fresh output folder."""
    return cmd("train", r, f"train.output_dir={tmp / 'train-out'}", *args)


def train_features(r: Run, tmp: Path, features: Path) -> list[str]:
    return train_with(r, tmp, f"collect.output_dir={features}")


def resume_copy(r: Run, tmp: Path, damage: Callable[[Path], object]) -> list[str]:
    """``eagle train`` resuming a copy of the run's train/ whose latest checkpoint was damaged."""
    out = copy(r.train, tmp / "train-copy")
    damage(latest_checkpoint(out))
    return cmd("train", r, f"train.output_dir={out}", "train.max_steps=6")


def evaluate_with(r: Run, *args: str) -> list[str]:
    """``eagle eval`` writing over the run's own report (which a failed run must leave alone)."""
    return cmd("eval", r, f"--out={r.report}", *args)


def eval_prompts(r: Run, tmp: Path, content: str | bytes) -> list[str]:
    return evaluate_with(r, f"--prompts={write(tmp / 'p.jsonl', content)}")


def eval_draft(r: Run, draft: Path) -> list[str]:
    return evaluate_with(r, f"--draft={draft}")


def eval_target(r: Run, target: Path) -> list[str]:
    return evaluate_with(r, f"--target={target}")


def prepare_with(r: Run, tmp: Path, content: str | bytes, *args: str, name: str = "d.jsonl") -> list[str]:
    """``eagle prepare`` of a data file into the run's own prepared data (which a failed run must leave alone)."""
    return cmd("prepare", r, f"data.sources=[{write(tmp / name, content)}]", *args)


def collect_rows(r: Run, tmp: Path, ids: list[list], masks: list[list]) -> list[str]:
    return cmd(
        "collect", r, f"data.output_dir={prepared(tmp, ids, masks)}", f"collect.output_dir={tmp / 'f'}"
    )


def corrupt_arrow(r: Run, tmp: Path) -> list[str]:
    data = copy(r.data, tmp / "data")
    for arrow in (data / "train").glob("*.arrow"):
        truncate(arrow, 40)
    return cmd("collect", r, f"data.output_dir={data}")


def damaged_shard(r: Run, tmp: Path, damage: Callable[[Path], object]) -> list[str]:
    features = copy(r.features, tmp / "features")
    damage(first_shard(features))
    return train_features(r, tmp, features)


def damaged_manifest(r: Run, tmp: Path) -> list[str]:
    features = copy(r.features, tmp / "features")
    truncate(features / "manifest.json", 30)
    return train_features(r, tmp, features)


def narrower_aux(d: dict) -> None:
    d["aux_hidden"] = d["aux_hidden"][:, :40].clone()


def float_ids(d: dict) -> None:
    d["input_ids"] = d["input_ids"].float()


def narrower_fc(d: dict) -> None:
    d["fc.weight"] = d["fc.weight"][:, :10].clone()


def integer_fc(d: dict) -> None:
    d["fc.weight"] = d["fc.weight"].int()


class Case(NamedTuple):
    id: str
    make: Callable[[Run, Path], list[str]]  # (run, scratch dir) -> argv
    problem: str  # regex the error line must match: what is wrong
    fix: str  # regex stderr must match: what to do


NO_ASSISTANT = jsonl({"messages": [{"role": "user", "content": "hi"}]})
BAD_ROLE = jsonl({"messages": [{"role": "wizard", "content": "x"}]})

CASES = [
    # ---- command line
    Case("cli-unknown-subcommand", lambda r, t: ["bake"], r"invalid choice: 'bake'", r"choose from"),
    Case(
        "cli-flag-not-a-number",
        lambda r, t: cmd("eval", r, "--max-new-tokens", "many"),
        r"invalid int value: 'many'",
        r"usage: eagle eval",
    ),
    # ---- configs
    Case(
        "config-missing",
        lambda r, t: ["train", "--config", str(t / "nope.yaml")],
        r"nope\.yaml does not exist",
        r"pass --config with an existing YAML file",
    ),
    Case(
        "config-not-utf8",
        lambda r, t: ["train", "--config", str(write(t / "c.yaml", b"train:\n  lr: \xff\xfe\n"))],
        r"is not UTF-8",
        r"save it as UTF-8",
    ),
    Case(
        "config-truncated-yaml",
        lambda r, t: ["train", "--config", str(write(t / "c.yaml", r.config.read_text()[:200]))],
        r"is not valid YAML .*line \d+",
        r"fix the syntax there",
    ),
    Case(
        "config-not-a-mapping",
        lambda r, t: ["train", "--config", str(write(t / "c.yaml", "- 1\n- 2\n"))],
        r"must hold a mapping of sections",
        r"see configs/smollm2_demo\.yaml",
    ),
    Case(
        "config-unknown-key-in-file",
        lambda r, t: ["train", "--config", str(write(t / "c.yaml", "train:\n  lrr: 0.1\n"))],
        r"unknown config key 'train\.lrr'",
        r"did you mean 'lr'",
    ),
    Case(
        "override-unknown-section",
        lambda r, t: cmd("train", r, "trian.lr=0.1"),
        r"unknown config key 'trian'",
        r"did you mean 'train'",
    ),
    Case(
        "override-not-key-value",
        lambda r, t: cmd("train", r, "trainlr"),
        r"'trainlr' is not of the form key=value",
        r"e\.g\. train\.lr=1e-4",
    ),
    Case(
        "config-wrong-type",
        lambda r, t: cmd("train", r, "train.batch_size=eight"),
        r"'train\.batch_size'.*got 'eight'",
        r"must be an integer",
    ),
    Case(
        "config-zero-batch",
        lambda r, t: cmd("train", r, "train.batch_size=0"),
        r"train\.batch_size.*got 0",
        r"must be >= 1",
    ),
    Case(
        "config-negative-shard-size",
        lambda r, t: cmd("collect", r, "collect.shard_tokens=-5"),
        r"collect\.shard_tokens.*got -5",
        r"must be >= 1",
    ),
    Case(
        "config-unknown-collect-target-dtype",
        lambda r, t: cmd("collect", r, "collect.target_dtype=int8"),
        r"collect\.target_dtype.*got 'int8'",
        r"null \(target\.dtype\) or one of",
    ),
    Case(
        "config-zero-max-length",
        lambda r, t: cmd("prepare", r, "data.max_length=0"),
        r"data\.max_length.*got 0",
        r"must be an integer >= 8",
    ),
    Case(
        "config-zero-new-tokens",
        lambda r, t: cmd("eval", r, "--max-new-tokens=0"),
        r"eval\.max_new_tokens.*got 0",
        r"must be >= 1",
    ),
    Case(
        "config-unknown-target-attention",
        lambda r, t: evaluate_with(r, "target.attention=no_such_kernel"),
        r"target\.attention=no_such_kernel cannot load",
        r"Use target\.attention=auto",
    ),
    Case(
        "config-nan-learning-rate",
        lambda r, t: cmd("train", r, "train.lr=.nan"),
        r"'train\.lr'.*got nan",
        r"must be a finite number",
    ),
    Case(
        "config-unknown-keep-best-metric",
        lambda r, t: cmd("train", r, "train.keep_best=foo"),
        r"train\.keep_best must be one of \['sim_tau', 'val_loss'\]",
        r"or null \(final/ = the last weights\), got 'foo'",
    ),
    Case(
        "config-draft-vocab-above-target-vocab",
        lambda r, t: train_with(r, t, "head.draft_vocab_size=100000"),
        r"draft_vocab_size=100000 is larger than the target's vocabulary \(49152\)",
        r"lower head\.draft_vocab_size",
    ),
    Case(
        "config-batch-larger-than-data",
        lambda r, t: train_with(r, t, "train.batch_size=100000"),
        r"too small for one optimizer step",
        r"lower train\.batch_size",
    ),
    # ---- chat data files (`eagle prepare` into the run's own prepared data)
    Case(
        "data-missing-file",
        lambda r, t: cmd("prepare", r, f"data.sources=[{t / 'none.jsonl'}]"),
        r"none\.jsonl' is neither a known name .* nor an existing file",
        r"check the path",
    ),
    Case(
        "data-not-utf8",
        lambda r, t: prepare_with(r, t, b'{"messages": [{"role": "user", "content": "caf\xe9"}]}\n'),
        r"line 1: not valid UTF-8",
        r"re-encode the file as UTF-8",
    ),
    Case(
        "data-empty-file",
        lambda r, t: prepare_with(r, t, ""),
        r"d\.jsonl is empty",
        r"give a file with at least one record",
    ),
    Case(
        "data-truncated-jsonl",
        lambda r, t: prepare_with(r, t, r.chats.read_bytes()[:-25]),
        r"line 24: invalid JSON",
        r"fix or remove that line",
    ),
    Case(
        "data-truncated-gzip",
        lambda r, t: prepare_with(r, t, gzip.compress(r.chats.read_bytes())[:60], name="d.jsonl.gz"),
        r"is not a complete gzip file",
        r"download or compress it again",
    ),
    Case(
        "data-wrong-record-shape",
        lambda r, t: prepare_with(r, t, jsonl({"text": "hello"})),
        r"line 1: expected a 'conversations' \(ShareGPT\) or 'messages' \(OpenAI\) list",
        r"found keys \['text'\]",
    ),
    Case(
        "data-unknown-role",
        lambda r, t: prepare_with(r, t, BAD_ROLE),
        r"unknown role 'wizard'",
        r"rename or drop such messages",
    ),
    Case(
        "data-tool-call-without-name",
        lambda r, t: prepare_with(r, t, jsonl(tool_chat({"arguments": "{}"}))),
        r"line 1: message 1 tool call 0: a tool call has no function name",
        r"give every call a 'name'",
    ),
    Case(
        "data-tool-arguments-not-json",
        lambda r, t: prepare_with(r, t, jsonl(tool_chat({"name": "get_weather", "arguments": "{city: Paris"}))),
        r"line 1: message 1 tool call 0: the arguments of tool call 'get_weather' are not valid JSON",
        r"write them as a JSON object",
    ),
    Case(
        "data-thinking-outside-assistant",
        lambda r, t: prepare_with(r, t, jsonl({"messages": [
            {"role": "user", "content": "hi", "reasoning_content": "I wonder"},
            {"role": "assistant", "content": "hello"}]})),  # fmt: skip
        r"line 1: message 0: a user message has thinking",
        r"only assistant turns think: move it to the assistant turn that wrote it, or drop it",
    ),
    Case(
        "data-unclosed-thinking",
        lambda r, t: prepare_with(r, t, jsonl(chat("hi", "<think>Let me see"))),
        r"line 1: message 1: the assistant message opens <think> and never closes it",
        r"write each assistant turn's thinking as one <think>\.\.\.</think> block",
    ),
    Case(
        "data-huge-conversation",
        lambda r, t: prepare_with(r, t, jsonl(chat("hi", "word " * 20_000)), "data.on_overlong=error"),
        r"has \d+ tokens > data\.max_length=64",
        r"raise max_length, or set data\.on_overlong to truncate or skip",
    ),
    Case(
        "data-no-assistant-turns",
        lambda r, t: prepare_with(r, t, NO_ASSISTANT),
        r"has no assistant turns",
        r"set data\.regenerate=true",
    ),
    # ---- prepared data (`eagle collect`)
    Case(
        "prepared-float-token-ids",
        lambda r, t: cmd("collect", r, f"data.output_dir={prepared(t, [[1.5, 2.5, 3.5]], [[1, 1, 1]])}"),
        r"column 'input_ids' holds list<item: double>, not lists of integers",
        r"rerun `eagle prepare`",
    ),
    Case(
        "prepared-negative-token-ids",
        lambda r, t: collect_rows(r, t, [[5, -2, 7]], [[1, 1, 1]]),
        r"has token id -2 but .* has a vocabulary of 49152",
        r"rerun `eagle prepare`",
    ),
    Case(
        "prepared-mask-length-mismatch",
        lambda r, t: collect_rows(r, t, [[5, 6, 7]], [[1]]),
        r"has 3 tokens but 1 loss-mask entries",
        r"rerun `eagle prepare`",
    ),
    Case(
        "prepared-corrupt-arrow-file",
        corrupt_arrow,
        r"train is not a prepared dataset",
        r"rerun `eagle prepare`",
    ),
    Case(
        "prepared-for-another-vocabulary",
        lambda r, t: cmd("collect", r, f"target.name={r.other}", f"collect.output_dir={t / 'f'}"),
        r"has token id \d+ but .*other has a vocabulary of 256",
        r"prepared for another tokenizer; rerun `eagle prepare`",
    ),
    # ---- feature shards and manifests (`eagle train`, offline)
    Case(
        "shard-truncated",
        lambda r, t: damaged_shard(r, t, lambda p: truncate(p, 100)),
        r"shard .* is corrupt",
        r"rerun `eagle collect` to rebuild it",
    ),
    Case(
        "shard-corrupted-bytes",
        lambda r, t: damaged_shard(r, t, lambda p: flip_bytes(p, 2000)),
        r"shard .* is corrupt \(checksum mismatch\)",
        r"rerun `eagle collect` to rebuild it",
    ),
    Case(
        "shard-wrong-shape",
        lambda r, t: train_features(r, t, shard_changed(r, t, narrower_aux)),
        r"does not have the feature layout \(aux_hidden F32 \[\d+, 40\] \(expected F32 \[\d+, 64\]\)\)",
        r"rerun `eagle collect` into a fresh collect\.output_dir",
    ),
    Case(
        "shard-wrong-dtype",
        lambda r, t: train_features(r, t, shard_changed(r, t, float_ids)),
        r"does not have the feature layout \(input_ids F32 \[\d+\] \(expected I32",
        r"rerun `eagle collect`",
    ),
    Case(
        "manifest-not-json",
        damaged_manifest,
        r"manifest\.json is unreadable",
        r"delete it and rerun `eagle collect`",
    ),
    Case(
        "manifest-missing-field",
        lambda r, t: train_features(r, t, manifest_changed(r, t, lambda m: m.pop("aux_layers"))),
        r"manifest\.json is malformed \('aux_layers' must be a list",
        r"rerun `eagle collect` into a fresh collect\.output_dir",
    ),
    Case(
        "manifest-unfinished",
        lambda r, t: train_features(r, t, manifest_changed(r, t, lambda m: m.update(complete=False))),
        r"feature collection in .* is unfinished",
        r"rerun `eagle collect` to finish it",
    ),
    Case(
        "features-of-another-target",
        lambda r, t: train_with(r, t, f"target.name={r.other}"),
        r"were collected for target .*target \(fingerprint \w+\), not the configured one",
        r"rerun `eagle collect` for this target into another collect\.output_dir",
    ),
    # ---- checkpoints (`eagle train` resuming a damaged copy of the run's train/)
    Case(
        "checkpoint-garbage-optimizer",
        lambda r, t: resume_copy(r, t, lambda ckpt: write(ckpt / "optimizer.pt", b"junk")),
        r"optimizer\.pt is unreadable",
        r"start fresh \(train\.resume=never\)",
    ),
    Case(
        "checkpoint-truncated-weights",
        lambda r, t: resume_copy(r, t, lambda ckpt: truncate(ckpt / "model.safetensors", 50)),
        r"holds an unreadable head",
        r"use another checkpoint",
    ),
    Case(
        "checkpoint-garbage-draft-vocab",
        lambda r, t: resume_copy(r, t, lambda ckpt: write(ckpt / "draft_vocab.safetensors", b"x")),
        r"draft vocabulary file .* is unreadable",
        r"start fresh \(train\.resume=never\)",
    ),
    Case(
        "checkpoint-of-another-target",
        lambda r, t: cmd(
            "train",
            r,
            f"target.name={r.other}",
            "train.mode=online",
            f"train.output_dir={copy(r.train, t / 'tr')}",
        ),
        r"checkpoint .* was trained for target .*target",
        r"use another train\.output_dir, or start fresh with train\.resume=never",
    ),
    Case(
        "resume-from-a-non-checkpoint",
        lambda r, t: train_with(r, t, f"train.resume={r.data}"),
        r"train\.resume=.* is neither a complete checkpoint nor a folder holding one",
        r"pass a checkpoints/step-\* folder",
    ),
    # ---- exporting
    Case(
        "export-missing-checkpoint",
        lambda r, t: cmd("export", r, f"--checkpoint={t / 'none'}", f"--out={t / 'x'}"),
        r"no trained head at",
        r"run `eagle train` first",
    ),
    Case(
        "export-for-another-target",
        lambda r, t: cmd("export", r, f"--target={r.other}", f"--out={t / 'x'}"),
        r"this head was trained for target .*but the target given is .*other",
        r"retrain the head for this target",
    ),
    # ---- exported heads (`eagle eval` over the run's own report)
    Case(
        "head-folder-empty",
        lambda r, t: eval_draft(r, mkdir(t / "empty")),
        r"no exported draft head at",
        r"`eagle export`",
    ),
    Case(
        "head-truncated-weights",
        lambda r, t: eval_draft(r, truncate(copy(r.export, t / "x") / "model.safetensors", 300).parent),
        r"the file is truncated or corrupt",
        r"export the head again",
    ),
    Case(
        "head-wrong-shape",
        lambda r, t: eval_draft(r, head_changed(r, t, narrower_fc)),
        r"fc\.weight has shape \[32, 10\], expected \[32, 64\]",
        r"Re-export it",
    ),
    Case(
        "head-wrong-dtype",
        lambda r, t: eval_draft(r, head_changed(r, t, integer_fc)),
        r"fc\.weight has dtype torch\.int32, expected torch\.float32",
        r"Re-export it",
    ),
    Case(
        "head-config-not-json",
        lambda r, t: eval_draft(r, write(copy(r.export, t / "x") / "config.json", "{nope").parent),
        r"could not read .*config\.json",
        r"re-export the head",
    ),
    Case(
        "head-as-pickle",
        lambda r, t: eval_draft(r, pickle_only_head(r, t)),
        r"pickle checkpoints such as \.bin/\.pt are not loaded",
        r"convert them to safetensors",
    ),
    Case(
        "head-for-another-target",
        lambda r, t: eval_target(r, r.other),
        r"this head was trained for target .*but the target given is .*other.*mismatch: fingerprint, vocab size",
        r"Pass --target .*target or retrain the head",
    ),
    # ---- prompt files (`eagle eval` over the run's own report)
    Case(
        "prompts-missing-file",
        lambda r, t: evaluate_with(r, f"--prompts={t / 'none.jsonl'}"),
        r"prompts file .*none\.jsonl' does not exist",
        r"give a JSONL file, hf:<dataset>\[:split\] or one of",
    ),
    Case(
        "prompts-not-utf8",
        lambda r, t: eval_prompts(r, t, b'{"prompt": "caf\xe9"}\n'),
        r"line 1: not valid UTF-8",
        r"re-encode the file as UTF-8",
    ),
    Case(
        "prompts-empty-file",
        lambda r, t: eval_prompts(r, t, ""),
        r"p\.jsonl is empty",
        r"give a file with at least one record",
    ),
    Case(
        "prompts-truncated-line",
        lambda r, t: eval_prompts(r, t, jsonl({"prompt": "a"}) + '{"prompt": "b'),
        r"line 2: invalid JSON",
        r"fix or remove that line",
    ),
    Case(
        "prompts-no-prompt-field",
        lambda r, t: eval_prompts(r, t, jsonl({"text": "a"})),
        r"line 1: expected 'messages', 'prompt', 'turns' \(MT-bench, Spec-Bench\), 'question' \(GSM8K\)",
        r"'instruction' \(Alpaca\); found keys \['text'\]",
    ),
    Case(
        "prompts-empty-prompt",
        lambda r, t: eval_prompts(r, t, jsonl({"id": "blank", "prompt": ""})),
        r"prompt 'blank' is empty after tokenization",
        r"remove it from the file",
    ),
    Case(
        "prompts-huge-prompt",
        lambda r, t: eval_prompts(r, t, jsonl({"id": "big", "prompt": "word " * 5000})),
        r"prompt 'big' of p has \d+ tokens.*more than the target's max_position_embeddings=4096",
        r"lower eval\.max_new_tokens, use a smaller tree .* or drop that prompt",
    ),
    Case(
        "tree-larger-than-context",
        lambda r, t: evaluate_with(r, "eval.tree.policy=dynamic", "eval.tree.total_tokens=5000"),
        r"a 5000-token tree it needs \d+ positions, more than the target's max_position_embeddings=4096",
        r"use a smaller tree",
    ),
    Case(
        "new-tokens-beyond-context",
        lambda r, t: evaluate_with(r, "--max-new-tokens=100000"),
        r"max_new_tokens=100000 .* more than the target's max_position_embeddings=4096",
        r"lower eval\.max_new_tokens",
    ),
    # ---- targets
    Case(
        "target-missing-path",
        lambda r, t: eval_target(r, t / "nothing"),
        r"local target path .*nothing' does not exist",
        r"check the path",
    ),
    Case(
        "target-truncated-weights",
        lambda r, t: eval_target(r, truncate(copy(r.target, t / "tg") / "model.safetensors", 1000).parent),
        r"could not load target .*tg'",
        r"Pass a folder with config\.json and weights",
    ),
    Case(
        "target-config-not-json",
        lambda r, t: eval_target(r, write(copy(r.target, t / "tg") / "config.json", "{garbage").parent),
        r"could not load target .*tg'.*not a valid JSON file",
        r"Pass a folder with config\.json and weights",
    ),
    Case(
        "target-needs-remote-code",
        lambda r, t: eval_target(r, custom_code_target(t)),
        r"it needs its own Python code, which is not run by default",
        r"Set target\.trust_remote_code=true only if you trust that code",
    ),
]


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    """``eagle ARGV`` in this process: (exit status, stderr)."""
    capsys.readouterr()
    try:
        rc = cli.main(argv)
    except SystemExit as exc:  # argparse's own usage errors
        rc = exc.code
    return rc, capsys.readouterr().err


def check_error(rc: int, err: str, case: Case) -> str:
    """Exit status 2, one error line naming the problem and the fix, no traceback; returns the message."""
    assert rc == 2, err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if re.match(r"eagle( \w+)?: error: ", line)]
    assert len(lines) == 1, err
    message = lines[0]
    assert re.search(case.problem, message), f"problem not named: {message}"
    assert re.search(case.fix, err), f"fix not named: {message}"
    return message


def test_the_table_has_enough_distinct_rows():
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids)) >= 25


def test_the_table_is_documented():
    doc = (ROOT / "tests" / "BAD_INPUTS.md").read_text()
    documented = set(re.findall(r"^\| `([a-z0-9-]+)` \|", doc, flags=re.M))
    assert documented == {c.id for c in CASES}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_gives_one_clear_error_and_damages_nothing(case, run, tmp_path, capsys):
    argv = case.make(run, tmp_path)
    before = snapshot(run.root)
    rc, err = run_cli(argv, capsys)
    check_error(rc, err, case)
    assert snapshot(run.root) == before, "files of the finished run changed"
    assert not (tmp_path / "RAN").exists()  # no code from a planted file ran


@pytest.mark.slow
def test_the_console_script_exits_2_without_traceback(run, tmp_path):
    """Two rows through the real ``eagle`` executable (in parallel: they are mostly start-up time)."""
    chosen = {c.id: c for c in CASES if c.id in ("override-unknown-section", "prompts-not-utf8")}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    eagle = Path(sys.executable).parent / "eagle"
    before = snapshot(run.root)
    procs = {
        cid: subprocess.Popen(
            [str(eagle), *case.make(run, tmp_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for cid, case in chosen.items()
    }
    for cid, proc in procs.items():
        _, err = proc.communicate(timeout=240)
        check_error(proc.returncode, err, chosen[cid])
    assert snapshot(run.root) == before
