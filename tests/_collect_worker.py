"""Runs `train.collect.collect` in its own process (for the kill/resume and torchrun tests in test_collect.py).

usage: python tests/_collect_worker.py MODEL_DIR DATA_DIR OUT_DIR SHARD_TOKENS BATCH_TOKENS DTYPE
(under `torchrun --nproc_per_node N` each process takes its slice of the shards)
"""

import sys

import torch
from transformers import AutoModelForCausalLM

from eagle.targets import Target
from train.collect import CollectConfig, collect


def main() -> None:
    model_dir, data_dir, out_dir, shard_tokens, batch_tokens, dtype = sys.argv[1:7]
    torch.set_num_threads(1)  # same numerics in every process and run (the tests compare bytes)
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager")
    target = Target.from_model(model, name="tiny-saved")
    cfg = CollectConfig(
        output_dir=out_dir, shard_tokens=int(shard_tokens), batch_tokens=int(batch_tokens), dtype=dtype
    )
    collect(cfg, data_dir, target)
    print("worker done", flush=True)


if __name__ == "__main__":
    main()
