#!/usr/bin/env bash
# The demo end to end on a CPU: SmolLM2-135M-Instruct (embedded), prepare with regeneration -> collect ->
# train -> export -> eval, everything under runs/demo/ (~30 minutes on 2 cores; no GPU, no network).
#
#   scripts/demo.sh                      # resumes: finished stages are skipped on a rerun
#   scripts/demo.sh --budget 60          # more data and steps for a better head
#   scripts/demo.sh --fresh train.lr=5e-4
#
# Arguments go to `eagle demo` (flags and key=value overrides of configs/smollm2_demo.yaml).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [[ -z "${VIRTUAL_ENV:-}" && -x .venv/bin/eagle ]]; then
    export PATH="$PWD/.venv/bin:$PATH"
fi
exec eagle demo --config configs/smollm2_demo.yaml "$@"
