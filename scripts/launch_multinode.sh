#!/usr/bin/env bash
# Train an EAGLE-3 head on several nodes (default: configs/llama31_8b_8gpu.yaml, online, DeepSpeed ZeRO-2).
# Run this SAME script on EVERY node; only NODE_RANK differs.
#
# Needs: the repo at the same path, the same environment and the same config on every node; run_dir on
# storage shared by all nodes (checkpoints are written by every process and renamed into place by rank 0);
# nodes that reach MASTER_ADDR:MASTER_PORT over TCP (NCCL picks the fastest interconnect itself); and the data
# prepared ONCE beforehand, from any one node:  eagle prepare --config <config> [key=value ...]
# Export and eval afterwards run on one node:   eagle export --config ... && eagle eval --config ...
#
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 scripts/launch_multinode.sh     # on node 0
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 scripts/launch_multinode.sh     # on node 1
#   srun --nodes 2 --ntasks-per-node 1 scripts/launch_multinode.sh          # Slurm fills the variables
#
# Environment: NNODES, NODE_RANK, MASTER_ADDR (required unless Slurm sets SLURM_NNODES / SLURM_NODEID /
# SLURM_JOB_NODELIST), MASTER_PORT (29500), GPUS_PER_NODE (8), LAUNCHER (accelerate | torchrun), CONFIG.
# Key=value arguments are config overrides (the same on every node!).
set -euo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/_preamble.sh" "$@"  # --help, repo root, .venv on PATH
CONFIG="${CONFIG:-configs/llama31_8b_8gpu.yaml}"
NNODES="${NNODES:-${SLURM_NNODES:-}}"
NODE_RANK="${NODE_RANK:-${SLURM_NODEID:-}}"
if [[ -z "${MASTER_ADDR:-}" && -n "${SLURM_JOB_NODELIST:-}" ]]; then
    MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
fi
MASTER_PORT="${MASTER_PORT:-29500}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
LAUNCHER="${LAUNCHER:-accelerate}"

for name in NNODES NODE_RANK MASTER_ADDR; do
    if [[ -z "${!name:-}" ]]; then
        echo "launch_multinode.sh: set $name (see the header of this script)" >&2
        exit 2
    fi
done

# The prepared data must already be on shared storage: preparing on every node would race.
data_dir="$(python - "$CONFIG" "$@" <<'EOF'
import sys
from recipes.config import load_config
print(load_config(sys.argv[1], sys.argv[2:]).data.output_dir)
EOF
)"
if [[ ! -f "$data_dir/prepare_meta.json" ]]; then
    echo "launch_multinode.sh: no prepared data at $data_dir: run once, on shared storage:" >&2
    echo "    eagle prepare --config $CONFIG $*" >&2
    exit 2
fi

echo "node $NODE_RANK of $NNODES: $GPUS_PER_NODE processes, rendezvous $MASTER_ADDR:$MASTER_PORT ($LAUNCHER)"
case "$LAUNCHER" in
    accelerate)
        # configs/accelerate/multi_node.yaml: DeepSpeed, standard launcher; the flags below override its
        # num_machines / num_processes / machine_rank / main_process_* for this cluster
        accelerate launch --config_file configs/accelerate/multi_node.yaml \
            --num_machines "$NNODES" --num_processes "$((NNODES * GPUS_PER_NODE))" \
            --machine_rank "$NODE_RANK" --main_process_ip "$MASTER_ADDR" --main_process_port "$MASTER_PORT" \
            -m recipes train --config "$CONFIG" "$@" ;;
    torchrun)
        # DeepSpeed (or DDP with train.deepspeed=null) is chosen by the trainer from the run config
        torchrun --nnodes "$NNODES" --nproc-per-node "$GPUS_PER_NODE" --node-rank "$NODE_RANK" \
            --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
            -m recipes train --config "$CONFIG" "$@" ;;
    *)
        echo "LAUNCHER must be accelerate or torchrun (got '$LAUNCHER')" >&2
        exit 2 ;;
esac
