#!/usr/bin/env bash
# Train on NPROC processes per node with torchrun.
#   bash tools/dist_train.sh CONFIG NPROC [train.py options]
# Several nodes: set NNODES, NODE_RANK, MASTER_ADDR and PORT on every node.
# Restarts: MAX_RESTARTS=N restarts the whole job up to N times after a rank
# fails (pass --resume to continue from the last checkpoint).
# Any other torchrun options: TORCHRUN_ARGS="...".
set -euo pipefail
CONFIG=$1
NPROC=$2
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
PORT=${PORT:-29500}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MAX_RESTARTS=${MAX_RESTARTS:-0}
TORCHRUN_ARGS=${TORCHRUN_ARGS:-}
HERE=$(cd "$(dirname "$0")" && pwd)

PYTHONPATH="$HERE/..${PYTHONPATH:+:$PYTHONPATH}" \
exec python -m torch.distributed.run \
    --nnodes="$NNODES" \
    --node_rank="$NODE_RANK" \
    --master_addr="$MASTER_ADDR" \
    --nproc_per_node="$NPROC" \
    --master_port="$PORT" \
    --max-restarts="$MAX_RESTARTS" \
    $TORCHRUN_ARGS \
    "$HERE/train.py" "$CONFIG" --launcher pytorch "${@:3}"
