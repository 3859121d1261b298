#!/usr/bin/env bash
# Evaluate a checkpoint on NPROC processes per node with torchrun.
#   bash tools/dist_test.sh CONFIG CHECKPOINT NPROC [test.py options]
# Same environment as dist_train.sh (NNODES, NODE_RANK, MASTER_ADDR, PORT).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/torchrun.sh"
mmpar_need_args "CONFIG CHECKPOINT NPROC" "[test.py options]" "$@"
mmpar_torchrun "$3" "$HERE/test.py" "$1" "$2" --launcher pytorch "${@:4}"
