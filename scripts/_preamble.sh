# Shared start of the launch scripts (sourced, not run): `--help` prints the calling script's header comment;
# then work from the repository root (config paths such as configs/deepspeed/... are relative to it) with the
# project's .venv on PATH when no virtual environment is active. A CONFIG given relative to the caller's
# directory is made absolute first.
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
    sed -n '2,/^set -euo/{/^#/s/^# \{0,1\}//p}' "$0"
    exit 0
fi
if [[ -n "${CONFIG:-}" ]]; then CONFIG="$(realpath "$CONFIG")"; fi
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [[ -z "${VIRTUAL_ENV:-}" && -x .venv/bin/eagle ]]; then
    export PATH="$PWD/.venv/bin:$PATH"
fi
