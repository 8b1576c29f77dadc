"""Untrusted files: nothing that eagle loads can run code.

Heads, shards and checkpoints are read with safetensors or ``torch.load(weights_only=True)`` only (DeepSpeed's own
checkpoint files are vetted by the weights-only unpickler before DeepSpeed reads them), and a target's own Python
code runs only with ``trust_remote_code=true``. Each test plants a file that *would* create a marker file when
loaded the unsafe way (checked once, so the plant is real), and shows that eagle refuses it with a clear error
and that the marker never appears.
"""

from __future__ import annotations

import ast
import json
import pickle
import shutil
from pathlib import Path

import _train_worker as W
import pytest
import torch
import yaml

from eagle.errors import EagleError
from eagle.heads import HeadConfig
from train import checkpoint as ck
from train.trainer import TrainConfig, train

ROOT = Path(__file__).resolve().parent.parent


class Planted:
    """Unpickling this creates the file ``marker`` (the stand-in for arbitrary code)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def plant_pickle(path: Path, marker: Path, zip_format: bool = True) -> Path:
    """A checkpoint-looking file whose unpickling would create ``marker`` (torch's zip format or raw pickle)."""
    payload = {"state": {0: {"exp_avg": torch.zeros(2)}}, "param_groups": [Planted(marker)]}
    path.parent.mkdir(parents=True, exist_ok=True)
    if zip_format:
        torch.save(payload, path)
    else:
        with open(path, "wb") as fh:
            pickle.dump(payload, fh)
    return path


def assert_plant_is_live(tmp_path: Path, zip_format: bool) -> None:
    """The same payload, loaded the unsafe way, does create its marker: the refusals below are real."""
    marker = tmp_path / "proof-marker"
    probe = plant_pickle(tmp_path / "probe.pt", marker, zip_format)
    try:
        torch.load(probe, weights_only=False)
    except RuntimeError:  # a raw pickle runs first, then fails torch's magic-number check
        pass
    assert marker.exists()
    marker.unlink()


pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")  # tests build Accelerators


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A short online run of the bigram target with a checkpoint to plant things in."""
    root = tmp_path_factory.mktemp("security")
    prepared = W.make_prepared(root / "prepared", n_train=16, n_val=0, length=16)
    cfg = TrainConfig(
        output_dir=str(root / "run"),
        mode="online",
        max_steps=2,
        batch_size=4,
        save_every=2,
        eval_every=0,
        progress=False,
    )
    target = W.bigram_target()
    train(target=target, data_dir=prepared, head=HeadConfig(draft_vocab_size=32), cfg=cfg)
    return target, prepared, cfg, root / "run"


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
@pytest.mark.parametrize("zip_format", [True, False], ids=["torch-zip", "raw-pickle"])
@pytest.mark.parametrize("victim", ["optimizer.pt", "scheduler.pt", "rng/rank-00000.pt"])
def test_planted_pickle_in_a_checkpoint_is_refused_and_never_runs(tmp_path, trained, victim, zip_format):
    target, prepared, cfg, run = trained
    assert_plant_is_live(tmp_path, zip_format)
    out = shutil.copytree(run, tmp_path / "run")
    marker = tmp_path / "marker"
    plant_pickle(out / "checkpoints" / "step-0000002" / victim, marker, zip_format)
    cfg = TrainConfig(**{**cfg.__dict__, "output_dir": str(out), "max_steps": 4})
    with pytest.raises(EagleError) as info:
        train(target=target, data_dir=prepared, head=HeadConfig(draft_vocab_size=32), cfg=cfg)
    message = str(info.value)
    assert f"{victim} holds objects other than tensors and plain values" in message
    assert "refused without running it" in message and "train.resume=never" in message
    assert "weights_only=False" not in message  # torch's own advice would be the wrong one here
    assert not marker.exists()


def test_planted_pickle_through_the_command_line(tmp_path, trained, capsys):
    from recipes import cli

    _, prepared, cfg, run = trained
    out = shutil.copytree(run, tmp_path / "run")
    marker = tmp_path / "marker"
    plant_pickle(out / "checkpoints" / "step-0000002" / "optimizer.pt", marker)
    config = {
        "target": {"name": str(W.save_target_folder(tmp_path / "target"))},
        "data": {"output_dir": str(prepared)},
        "head": {"draft_vocab_size": 32},
        "train": {
            "mode": "online",
            "output_dir": str(out),
            "max_steps": 4,
            "batch_size": 4,
            "progress": False,
        },
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    capsys.readouterr()
    assert cli.main(["train", "--config", str(tmp_path / "run.yaml")]) == 2
    err = capsys.readouterr().err
    assert "eagle train: error:" in err and "refused without running it" in err and "Traceback" not in err
    assert not marker.exists()


def test_deepspeed_checkpoint_files_are_vetted(tmp_path):
    """DeepSpeed unpickles its files fully: they must pass the weights-only unpickler first."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    folder = tmp_path / "deepspeed" / "state"
    folder.mkdir(parents=True)
    # what DeepSpeed itself pickles into ZeRO optimizer states: tensors, plain values and these two classes
    honest = {"optimizer_state_dict": {"zero_stage": ZeroStageEnum.gradients, "loss_scaler": LossScaler(1.0)}}
    torch.save(honest, folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    torch.save({"module": {"w": torch.ones(2)}}, folder / "mp_rank_00_model_states.pt")
    ck.vet_deepspeed_files(tmp_path / "deepspeed")  # passes

    marker = tmp_path / "marker"
    plant_pickle(folder / "zero_pp_rank_1_mp_rank_00_optim_states.pt", marker)
    with pytest.raises(EagleError, match="refused without running it"):
        ck.vet_deepspeed_files(tmp_path / "deepspeed")
    assert not marker.exists()


def test_planted_pickle_as_exported_head_or_target_weights(tmp_path):
    from eagle.export import export_head, load_exported_head
    from eagle.heads import HeadConfig, build_head
    from eagle.targets import Target, load_target
    from eagle.testing import tiny_model

    marker = tmp_path / "marker"
    model = tiny_model("llama", vocab_size=256, hidden_size=32, num_layers=2)
    target = Target.from_model(model, name="tiny")
    cfg = HeadConfig.from_target(
        model.config, "eagle3", target_name="tiny", target_fingerprint=target.fingerprint
    )
    draft = export_head(build_head(cfg).eval(), tmp_path / "draft", dtype="float32", target=target)
    (draft / "model.safetensors").unlink()
    plant_pickle(draft / "pytorch_model.bin", marker)
    with pytest.raises(EagleError, match=r"pickle checkpoints such as \.bin/\.pt are not loaded"):
        load_exported_head(draft, target)

    folder = tmp_path / "target"
    model.save_pretrained(folder)
    (folder / "model.safetensors").unlink()
    plant_pickle(folder / "pytorch_model.bin", marker)
    with pytest.raises(EagleError, match="refused without running them"):
        load_target(str(folder))
    assert not marker.exists()


def _remote_code_folder(tmp_path: Path, marker: Path) -> Path:
    """A model folder whose config asks transformers to import the folder's own module (which makes ``marker``)."""
    folder = tmp_path / "remote"
    folder.mkdir()
    auto_map = {"AutoConfig": "planted.PlantedConfig", "AutoModelForCausalLM": "planted.PlantedModel"}
    (folder / "config.json").write_text(json.dumps({"model_type": "planted", "auto_map": auto_map}))
    tokenizer_map = {"AutoTokenizer": ["planted.PlantedTokenizer", None]}
    (folder / "tokenizer_config.json").write_text(json.dumps({"auto_map": tokenizer_map}))
    (folder / "planted.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n")
    return folder


def test_remote_code_is_off_unless_the_user_turns_it_on(tmp_path, monkeypatch):
    import transformers

    from eagle.targets import TargetConfig, load_target, load_tokenizer
    from recipes.config import load_config

    marker = tmp_path / "marker"
    folder = _remote_code_folder(tmp_path, marker)
    with pytest.raises(EagleError, match=r"not run by default\. Set target\.trust_remote_code=true only if"):
        load_target(str(folder))
    with pytest.raises(EagleError):
        load_tokenizer(str(folder))
    assert not marker.exists()
    assert TargetConfig().trust_remote_code is False
    assert load_config(None, []).target.trust_remote_code is False  # the shipped demo config
    for path in (ROOT / "configs").glob("*.yaml"):
        assert not (yaml.safe_load(path.read_text()).get("target") or {}).get("trust_remote_code"), path

    # the user's explicit choice is passed on (seen at the first transformers call; nothing is imported)
    seen = {}

    def spy(path, **kwargs):
        seen.update(kwargs)
        raise OSError("stop here")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", spy)
    with pytest.raises(EagleError):
        load_target(TargetConfig(name=str(folder), trust_remote_code=True))
    assert seen["trust_remote_code"] is True
    assert not marker.exists()


def _calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            owner = getattr(func.value, "id", "") if isinstance(func, ast.Attribute) else ""
            yield node, owner, name


def test_no_unsafe_loader_in_the_sources():
    """A source audit of eagle/ and train/: every torch.load passes weights_only=True; no pickle, no numpy
    pickles, no trust_remote_code=True."""
    problems = []
    for path in sorted([*(ROOT / "eagle").rglob("*.py"), *(ROOT / "train").rglob("*.py")]):
        tree = ast.parse(path.read_text(), str(path))
        for node, owner, name in _calls(tree):
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            keywords = {k.arg: k.value for k in node.keywords}
            if owner == "torch" and name == "load":
                flag = keywords.get("weights_only")
                if not (isinstance(flag, ast.Constant) and flag.value is True):
                    problems.append(f"{where}: torch.load without weights_only=True")
            if owner in ("pickle", "cPickle", "dill", "joblib") and name in ("load", "loads"):
                problems.append(f"{where}: {owner}.{name}")
            if owner in ("np", "numpy") and name == "load":
                allow = keywords.get("allow_pickle")
                if isinstance(allow, ast.Constant) and allow.value:
                    problems.append(f"{where}: numpy.load(allow_pickle=True)")
            remote = keywords.get("trust_remote_code")
            if isinstance(remote, ast.Constant) and remote.value is True:
                problems.append(f"{where}: trust_remote_code=True")
    assert not problems, problems
