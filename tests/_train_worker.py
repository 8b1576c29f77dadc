"""Helpers for the trainer tests, and a worker script they launch in subprocesses.

``python tests/_train_worker.py ARGS.json`` trains with the settings in the JSON file (``train`` = TrainConfig
fields, ``head`` = HeadConfig fields, ``data_dir`` / ``features_dir``). With ``"hang_after_step": N`` the process
prints ``CHECKPOINT N`` after checkpoint N is in place and then sleeps, so a test can SIGKILL it at a known point.
It works alone, under ``torchrun`` and under the ``deepspeed`` launcher (which adds ``--local_rank``).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

VOCAB = 256


def bigram_target(seed: int = 0):
    """A tiny llama target whose greedy next token is mostly a fixed function of the current token.

    Its lm_head rows are permuted, scaled copies of its input embeddings, so the logits peak at ``perm^-1(x)``
    (~93% of positions on random text; the random decoder layers decide the rest). A draft head can learn that
    quickly, which makes "accuracy far above chance" a fast, meaningful test. Same seed -> same weights and
    fingerprint in every process.
    """
    from eagle.targets import Target
    from eagle.testing import tiny_model

    model = tiny_model("llama", seed=seed, vocab_size=VOCAB)
    perm = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():
        model.lm_head.weight.copy_(model.model.embed_tokens.weight[perm] * 20)
    return Target.from_model(model, None, name=f"bigram-{seed}")


def save_target_folder(folder: str | Path, seed: int = 0) -> Path:
    """The bigram target as an HF folder (weights + a word-level tokenizer) that ``load_target`` can read."""
    folder = Path(folder)
    bigram_target(seed).model.save_pretrained(folder)
    save_word_tokenizer(folder)
    return folder


def save_word_tokenizer(folder: str | Path, vocab_size: int = VOCAB) -> None:
    """A word-level tokenizer of ``vocab_size`` words t0, t1, ... (t0 pads, t2 ends) saved into ``folder``."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", pad_token="t0", eos_token="t2")
    fast.save_pretrained(folder)


def make_prepared(
    folder: str | Path,
    n_train: int = 96,
    n_val: int = 16,
    length: int | tuple[int, int] = 32,
    seed: int = 0,
    prefix: int = 4,
) -> Path:
    """Random token sequences in the prepared-data layout (``<folder>/train|val`` via ``save_to_disk``).

    ``length`` is a fixed length or a (min, max) range; the first ``prefix`` tokens of each sequence are not
    loss-masked (like a prompt)."""
    from datasets import Dataset

    folder = Path(folder)
    gen = torch.Generator().manual_seed(seed)
    for split, n in (("train", n_train), ("val", n_val)):
        if n == 0:
            continue
        ids, masks = [], []
        for _ in range(n):
            if isinstance(length, tuple):
                t = int(torch.randint(length[0], length[1] + 1, (1,), generator=gen))
            else:
                t = length
            ids.append(torch.randint(3, VOCAB, (t,), generator=gen).tolist())
            masks.append([0] * min(prefix, t) + [1] * max(0, t - prefix))
        Dataset.from_dict({"input_ids": ids, "loss_mask": masks}).save_to_disk(str(folder / split))
    return folder


def collect_features(data_dir: str | Path, out_dir: str | Path, target=None) -> Path:
    """Offline features of the bigram target over prepared data (float32 storage, for exact comparisons)."""
    from eagle.features import default_aux_layers
    from train.collect import CollectConfig, collect

    target = target or bigram_target()
    cfg = CollectConfig(
        output_dir=str(out_dir),
        aux_layers=default_aux_layers(target.num_layers),
        dtype="float32",
        shard_tokens=2000,
    )
    collect(cfg, data_dir, target)
    return Path(out_dir)


def main(argv: list[str]) -> int:
    from eagle.errors import EagleError
    from eagle.heads import HeadConfig
    from train.trainer import TrainConfig, train

    args = json.loads(Path([a for a in argv if not a.startswith("--local_rank")][0]).read_text())
    hang = args.get("hang_after_step")

    def on_checkpoint(path: Path, step: int) -> None:
        if step == hang:
            print(f"CHECKPOINT {step}", flush=True)
            time.sleep(3600)

    try:
        train(
            target=bigram_target(),
            data_dir=args.get("data_dir"),
            features_dir=args.get("features_dir"),
            head=HeadConfig(**args.get("head", {})),
            cfg=TrainConfig(**args["train"]),
            on_checkpoint=on_checkpoint,
        )
    except EagleError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
