#!/usr/bin/env bash
# Train on NPROC processes per node with torchrun.
#   bash tools/dist_train.sh CONFIG NPROC [train.py options]
# Several nodes: set NNODES, NODE_RANK, MASTER_ADDR and PORT on every node.
# Restarts: MAX_RESTARTS=N restarts the whole job up to N times after a rank
# fails; a restarted attempt resumes from the newest complete checkpoint in
# the work dir by itself (docs/fault_tolerance.md).
# Any other torchrun options: TORCHRUN_ARGS="...".
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/torchrun.sh"
mmpar_need_args "CONFIG NPROC" "[train.py options]" "$@"
mmpar_torchrun "$2" "$HERE/train.py" "$1" --launcher pytorch "${@:3}"
