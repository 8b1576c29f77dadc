"""The house: three layers importing downwards only, no import circles, a package that installs and runs outside
the checkout, and ``eagle config show``.

Layers: ``eagle`` (runtime) <- ``train`` (training library) <- ``recipes`` (stages, config, CLI). Every import
counts, also one inside a function: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("eagle", "train", "recipes", "configs")
ALLOWED = {"eagle": {"eagle"}, "train": {"eagle", "train"}, "recipes": {"eagle", "train", "recipes"},
           "configs": {"configs"}}


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the project modules it imports (at any depth of its code)."""
    modules = {}
    for package in PACKAGES:
        for path in (root / package).rglob("*.py"):
            name = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
            modules[name] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            deps |= {t for t in targets if t in modules and t != name}
        graph[name] = deps
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: strongly connected groups of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_layers_import_downwards_only():
    graph = import_graph()
    wrong = [f"{m} -> {d}" for m, deps in graph.items() for d in deps
             if d.split(".")[0] not in ALLOWED[m.split(".")[0]]]
    assert not wrong, wrong


def test_no_import_circles():
    assert circles(import_graph()) == []


def test_the_checks_catch_what_they_guard_against(tmp_path):
    """A planted upward import and a planted circle are found."""
    for package, files in {"eagle": {"a.py": "from train.b import x\n"}, "train": {"b.py": "from train.c import y\n",
                                                                                  "c.py": "import train.b\n"}}.items():
        (tmp_path / package).mkdir()
        for name, text in files.items():
            (tmp_path / package / name).write_text(text)
    for package in ("recipes", "configs"):
        (tmp_path / package).mkdir()
    graph = import_graph(tmp_path)
    assert graph["eagle.a"] == {"train.b"}
    assert circles(graph) == [["train.b", "train.c"]]


def test_config_show_prints_every_key_with_its_default_and_help(capsys, tmp_path, monkeypatch):
    from recipes.cli import main

    monkeypatch.chdir(tmp_path)  # no saved run config in the working directory to read back
    assert main(["config", "show", "train.lr=5e-4"]) == 0
    out = capsys.readouterr().out
    lines = {line.split(":", 1)[0]: line for line in out.splitlines()}
    assert lines["train.lr"] == "train.lr: 0.0005  (default 0.0003)  # peak learning rate (AdamW, cosine schedule)"
    assert lines["eval.vllm.num_speculative_tokens"].endswith("# the chain vLLM drafts per step (it has no tree attention)")
    from recipes.config import RunConfig, describe

    assert set(lines) == {key for key, *_ in describe(RunConfig())}
    assert [key for key, line in lines.items() if "  # " not in line] == []  # every key has its line of help
    # overrides may come before and after the flags
    assert main(["config", "show", "run_dir=elsewhere", "--config", "smollm2_demo", "train.lr=5e-4"]) == 0
    lines = {line.split(":", 1)[0]: line for line in capsys.readouterr().out.splitlines()}
    assert lines["train.lr"].startswith("train.lr: 0.0005") and lines["run_dir"].startswith("run_dir: 'elsewhere'")
    assert main(["config", "show", "train.lrr=1"]) == 2
    assert "did you mean 'lr'" in capsys.readouterr().err


@pytest.mark.slow
def test_the_wheel_installs_and_runs_outside_the_checkout(tmp_path):
    """``pip install .`` (not editable) into a folder; from another directory: ``eagle --version``, the shipped
    demo config and the dev prompt sets."""
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target",
                    str(target), str(ROOT)], check=True, capture_output=True, timeout=600)
    env = {**os.environ, "PYTHONPATH": str(target)}
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    version = subprocess.run([str(target / "bin" / "eagle"), "--version"], cwd=elsewhere, env=env,
                             capture_output=True, text=True, timeout=120)
    assert version.returncode == 0, version.stderr
    assert version.stdout.startswith("eagle-heads 0."), version.stdout
    code = ("import eagle, recipes.config as c; from eagle.prompts import load_prompts; "
            "cfg = c.load_config(None, []); print(eagle.__file__); print(cfg.run_dir, cfg.data.sources); "
            "print(len(load_prompts('dev-chat')), len(load_prompts('dev-code')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=elsewhere, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith(str(target)), lines[0]  # the installed copy, not the checkout
    assert lines[1].startswith("runs/demo ['chitchat:900'") and lines[2] == "40 40"
    missing = subprocess.run([str(target / "bin" / "eagle"), "prepare", "--config", "nope.yaml"], cwd=elsewhere,
                             env=env, capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "nope.yaml does not exist" in missing.stderr
