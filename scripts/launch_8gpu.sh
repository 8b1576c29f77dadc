#!/usr/bin/env bash
# Train, export and evaluate an EAGLE-3 head for Llama-3.1-8B-Instruct on 8 GPUs of one node
# (configs/llama31_8b_8gpu.yaml: online mode, DeepSpeed ZeRO-2 through train.deepspeed).
#
# Needs: 8 CUDA GPUs, 80 GB class assumed (every process holds the whole frozen bf16 target, 16 GB, plus
# its share of the head and the activations of batch_size x max_length tokens over 7 TTT steps: lower
# train.batch_size / train.max_length on smaller cards); the project installed with deepspeed; access to
# meta-llama/Llama-3.1-8B-Instruct (HF login, or a local folder via target.name=...); the data sources of
# the config (sharegpt comes with `make setup`; data/ultrachat_200k.jsonl must exist); disk for the
# prepared tokens only (online mode writes no features).
#
#   scripts/launch_8gpu.sh
#   NUM_GPUS=4 scripts/launch_8gpu.sh train.grad_accum=4          # fewer GPUs, same global batch
#   LAUNCHER=deepspeed scripts/launch_8gpu.sh                      # the deepspeed launcher
#   LAUNCHER=torchrun scripts/launch_8gpu.sh train.deepspeed=null  # plain DDP, no DeepSpeed
#   STAGES="train export eval" scripts/launch_8gpu.sh              # skip stages that are done
#
# Key=value arguments are config overrides passed to every stage. Rerunning resumes: prepare keeps regenerated
# answers, collect keeps verified shards, train continues from its latest checkpoint.
set -euo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/_preamble.sh" "$@"  # --help, repo root, .venv on PATH
CONFIG="${CONFIG:-configs/llama31_8b_8gpu.yaml}"
NUM_GPUS="${NUM_GPUS:-8}"
LAUNCHER="${LAUNCHER:-accelerate}"  # accelerate | deepspeed | torchrun
STAGES="${STAGES:-prepare collect train export eval}"

# One value of the resolved run config (YAML + overrides), e.g. `config_value train.mode`.
config_value() {
    python - "$CONFIG" "$1" "${@:2}" <<'EOF'
import sys
from recipes.config import load_config
cfg = load_config(sys.argv[1], sys.argv[3:])
value = cfg
for part in sys.argv[2].split("."):
    value = getattr(value, part)
print(value)
EOF
}

# Run a python module on NUM_GPUS processes with the chosen launcher.
launch() {
    case "$LAUNCHER" in
        accelerate)
            accelerate launch --config_file configs/accelerate/multi_gpu_8.yaml --num_processes "$NUM_GPUS" \
                -m "$@" ;;
        deepspeed) deepspeed --num_gpus "$NUM_GPUS" --module "$@" ;;
        torchrun) torchrun --nproc-per-node "$NUM_GPUS" -m "$@" ;;
        *) echo "LAUNCHER must be accelerate, deepspeed or torchrun (got '$LAUNCHER')" >&2; exit 2 ;;
    esac
}

has_stage() { [[ " $STAGES " == *" $1 "* ]]; }

# 1. prepare: one process on one GPU (HF generate regenerates the answers; see docs/MULTI_GPU.md for its cost)
if has_stage prepare; then
    eagle prepare --config "$CONFIG" "$@"
fi
# 2. collect only in offline mode (each process takes every NUM_GPUS-th shard); online mode needs no features
if has_stage collect; then
    if [[ "$(config_value train.mode "$@")" == "offline" ]]; then
        launch recipes collect --config "$CONFIG" "$@"
    else
        echo "collect: skipped (train.mode is online: the target runs inside each training step)"
    fi
fi
# 3. train on all GPUs (train.batch_size is per GPU: global batch = NUM_GPUS x batch_size x grad_accum)
if has_stage train; then
    launch recipes train --config "$CONFIG" "$@"
fi
# 4-5. export (CPU) and evaluate (one GPU)
if has_stage export; then
    eagle export --config "$CONFIG" "$@"
fi
if has_stage eval; then
    eagle eval --config "$CONFIG" "$@"
fi
