#!/usr/bin/env bash
# Verify CONFIG's layout on NPROC processes against a reference layout.
#   bash tools/dist_verify.sh CONFIG NPROC [--steps K] [--rtol R] [--atol A]
#        [--against one-process|AXIS=SIZE,...[,wrapper=TYPE]]
#        [--memory-budget GIB] [--work-dir DIR] [--cfg-options ...]
# First the reference (one process by default, the same global batch; a
# parallel --against under torchrun at its own world size), then the layout
# under torchrun; rank 0 prints where they first differ (docs/verify.md).
# Exit status: 0 when every step agrees, 1 when not.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
source "$HERE/torchrun.sh"
mmpar_need_args "CONFIG NPROC" "[verify.py options]" "$@"
REF_RANKS=1
AGAINST=()
# A reference other than the default one process: choose it (and refuse a
# bad --against) before anything trains.
if printf '%s\n' "${@:3}" | grep -qE '^--(against|memory-budget)'; then
    if ! OUT=$(python "$HERE/verify.py" "$1" --choose-reference "$2" \
            "${@:3}"); then
        printf '%s\n' "$OUT"  # the refusal (a logger's line) is here
        exit 1
    fi
    read -r _ REF_RANKS LAYOUT <<< "$(printf '%s\n' "$OUT" \
        | grep '^verify-reference: ' | tail -n 1)"
    AGAINST=(--against "$LAYOUT")
fi
if [ "$REF_RANKS" = 1 ]; then
    python "$HERE/verify.py" "$1" --reference-world "$2" "${@:3}" \
        ${AGAINST[@]+"${AGAINST[@]}"}
else
    (mmpar_torchrun "$REF_RANKS" "$HERE/verify.py" "$1" --launcher pytorch \
        --reference-world "$2" "${@:3}" ${AGAINST[@]+"${AGAINST[@]}"})
fi
mmpar_torchrun "$2" "$HERE/verify.py" "$1" --launcher pytorch "${@:3}" \
    ${AGAINST[@]+"${AGAINST[@]}"}
