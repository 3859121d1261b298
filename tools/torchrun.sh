# Sourced by dist_train.sh and dist_test.sh: run a tool under torchrun.
#   mmpar_torchrun NPROC SCRIPT [script args]
# Environment: NNODES (1), NODE_RANK (0), MASTER_ADDR (127.0.0.1), PORT (29500),
# MAX_RESTARTS (0: restart the whole job up to N times after a rank fails),
# TORCHRUN_ARGS (any other torchrun options).
mmpar_torchrun() {
    local nproc=$1
    shift
    local root
    root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
    PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" \
    exec python -m torch.distributed.run \
        --nnodes="${NNODES:-1}" \
        --node_rank="${NODE_RANK:-0}" \
        --master_addr="${MASTER_ADDR:-127.0.0.1}" \
        --nproc_per_node="$nproc" \
        --master_port="${PORT:-29500}" \
        --max-restarts="${MAX_RESTARTS:-0}" \
        ${TORCHRUN_ARGS:-} \
        "$@"
}
