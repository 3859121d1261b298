# Sourced by dist_train.sh, dist_test.sh and dist_verify.sh: check their
# arguments, and run a tool under torchrun.
#   mmpar_need_args "CONFIG NPROC" "[options]" "$@"
#   mmpar_torchrun NPROC SCRIPT [script args]
# Environment: NNODES (1), NODE_RANK (0), MASTER_ADDR (127.0.0.1), PORT,
# MAX_RESTARTS (0: restart the whole job up to N times after a rank fails),
# TORCHRUN_ARGS (any other torchrun options).
# PORT: on one node with no PORT set, torchrun's own rendezvous binds a free
# port (--standalone), so jobs started side by side never clash; with
# several nodes, or when set, the master listens on PORT (29500).
# The usage line and exit 2 (as argparse does) when an argument NAMES lists
# is missing, before set -u stops at it ("$2: unbound variable"); -h or
# --help first: the usage line and exit 0.
mmpar_need_args() {
    local names=$1 more=$2
    shift 2
    local usage="usage: bash $0 $names $more"
    if [ "${1:-}" = -h ] || [ "${1:-}" = --help ]; then
        echo "$usage"
        exit 0
    fi
    local -a need
    read -r -a need <<< "$names"
    if [ "$#" -lt "${#need[@]}" ]; then
        echo "$usage" >&2
        echo "$(basename "$0"): error: missing ${need[*]:$#}" >&2
        exit 2
    fi
}

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
