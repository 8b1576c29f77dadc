"""Decoding step times on a GPU per attention backend: a random SmolLM2-shaped target (timing does not depend on
the weights) and a random EAGLE-3 head, plain vs speculative decoding (dynamic trees of 32 and 12 nodes), first
with PyTorch's default SDPA backends, then without cuDNN attention, then with the math backend alone.

    python scripts/gpu_step_times.py          # on cuda
    python scripts/gpu_step_times.py cpu      # a 2-layer check of the script itself
"""
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from eagle.drafter import HeadDrafter
from eagle.heads import HeadConfig, build_head
from eagle.sampling import Sampling
from eagle.speculate import plain_generate, speculative_generate
from eagle.tree import TreeConfig

dev = sys.argv[1] if len(sys.argv) > 1 else "cuda"
cpu = dev == "cpu"
cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=2 if cpu else 30,
                  num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                  tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=100000.0)
torch.manual_seed(0)
m = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").to(dev, torch.bfloat16).eval().requires_grad_(False)
hc = HeadConfig.from_target(cfg, "eagle3", draft_vocab_size=8192, aux_layers=[0, 1, 1] if cpu else [2, 15, 27])
head = build_head(hc).to(dev, torch.bfloat16).eval().requires_grad_(False)
head.attach_target(m)
drafter = HeadDrafter(head)
ids = torch.randint(0, 49000, (1, 300), device=dev)
N = 8 if cpu else 32


def sync():
    if dev == "cuda":
        torch.cuda.synchronize()


def run(label):
    for tree in (TreeConfig(policy="dynamic", depth=6, top_k=8, total_tokens=32),
                 TreeConfig(policy="dynamic", depth=5, top_k=4, total_tokens=12)):
        for trial in range(2 if tree.total_tokens == 32 else 1):
            sync()
            t0 = time.perf_counter()
            p = plain_generate(m, ids, N, sampling=Sampling(eos_token_ids=[]))
            sync()
            tp = time.perf_counter() - t0
            t0 = time.perf_counter()
            r = speculative_generate(m, drafter, ids, N, tree, sampling=Sampling(eos_token_ids=[]))
            sync()
            ts = time.perf_counter() - t0
            steps = len(r.accept_lengths)
            print(f"{label} tree {tree.total_tokens:>2} trial {trial}: plain {tp / len(p.tokens) * 1e3:.1f} ms/token; "
                  f"spec {ts / max(steps, 1) * 1e3:.1f} ms/step ({steps} steps, draft {r.draft_time / max(steps, 1) * 1e3:.1f} ms/step)",
                  flush=True)


with torch.no_grad():
    run("default")
    if dev == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)
        run("no-cudnn-sdp")
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        run("math-sdp")
