#!/usr/bin/env bash
# Train, export and evaluate an EAGLE-3 head for SmolLM2-135M-Instruct on ONE GPU (configs/smollm2_1gpu.yaml).
#
# Needs: one CUDA GPU (~10 GB is plenty), the project installed (`pip install -e .`, or the repo's .venv), and
# ~20 GB of free disk under run_dir for the offline features. No network: the target and data are embedded.
#
#   scripts/launch_1gpu.sh                                  # the whole recipe
#   scripts/launch_1gpu.sh run_dir=runs/try2 train.lr=3e-4  # key=value overrides go to every stage
#   CONFIG=configs/my_run.yaml scripts/launch_1gpu.sh       # another run config
#
# Every stage resumes when rerun: prepare keeps the answers it already regenerated, collect keeps verified
# shards, train continues from its latest checkpoint (train.resume: auto); export and eval simply redo.
# `eagle demo --config configs/smollm2_1gpu.yaml` runs the same stages in one process and skips finished ones.
set -euo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/_preamble.sh" "$@"  # --help, repo root, .venv on PATH
CONFIG="${CONFIG:-configs/smollm2_1gpu.yaml}"

# 1. chat data -> tokens + loss masks; the target (on the GPU) rewrites every assistant answer
eagle prepare --config "$CONFIG" "$@"
# 2. offline mode: hidden states of the 3 aux layers + the last layer, bf16 shards (~4.5 KB/token)
eagle collect --config "$CONFIG" "$@"
# 3. train (one process; `eagle train --config ...` is equivalent on one GPU)
accelerate launch --config_file configs/accelerate/single_gpu.yaml -m recipes train --config "$CONFIG" "$@"
# 4. the EAGLE-3 layout SGLang and vLLM load (model.safetensors + config.json)
eagle export --config "$CONFIG" "$@"
# 5. speculative vs plain decoding on dev-chat + dev-code: report.json and plots under run_dir/eval/
eagle eval --config "$CONFIG" "$@"
