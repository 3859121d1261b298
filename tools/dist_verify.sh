#!/usr/bin/env bash
# Verify CONFIG's layout on NPROC processes against one process.
#   bash tools/dist_verify.sh CONFIG NPROC [--steps K] [--rtol R] [--atol A]
#        [--against one-process] [--work-dir DIR] [--cfg-options ...]
# First the reference (one process, the same global batch), then the layout
# under torchrun; rank 0 prints where they first differ (docs/verify.md).
# Exit status: 0 when every step agrees, 1 when not.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" \
    python "$HERE/verify.py" "$1" --reference-world "$2" "${@:3}"
source "$HERE/torchrun.sh"
mmpar_torchrun "$2" "$HERE/verify.py" "$1" --launcher pytorch "${@:3}"
