# Sourced by dist_train.sh and dist_test.sh: run a tool under torchrun.
#   mmpar_torchrun NPROC SCRIPT [script args]
# Environment: NNODES (1), NODE_RANK (0), MASTER_ADDR (127.0.0.1), PORT,
# MAX_RESTARTS (0: restart the whole job up to N times after a rank fails),
# TORCHRUN_ARGS (any other torchrun options).
# PORT: on one node with no PORT set, torchrun's own rendezvous binds a free
# port (--standalone), so jobs started side by side never clash; with
# several nodes, or when set, the master listens on PORT (29500).
mmpar_torchrun() {
    local nproc=$1
    shift
    local root
    root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
    local -a place
    if [ "${NNODES:-1}" = 1 ] && [ -z "${PORT:-}" ]; then
        place=(--standalone)
    else
        place=(--nnodes="${NNODES:-1}"
               --node_rank="${NODE_RANK:-0}"
               --master_addr="${MASTER_ADDR:-127.0.0.1}"
               --master_port="${PORT:-29500}")
    fi
    PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" \
    exec python -m torch.distributed.run \
        "${place[@]}" \
        --nproc_per_node="$nproc" \
        --max-restarts="${MAX_RESTARTS:-0}" \
        ${TORCHRUN_ARGS:-} \
        "$@"
}
