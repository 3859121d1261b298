#!/usr/bin/env bash
# Every CUDA path of mmpar in one command, with a short summary at the end.
#   bash tools/gpu_check.sh
# Runs the `gpu`-marked tests (tests/gpu/: one-process training on CUDA,
# tools/dist_train.sh CFG 1 with nccl, --amp fp16 and bf16, FSDP1/FSDP2 at
# world size 1 with and without cpu_offload, a CUDA checkpoint loaded on
# CPU, the device module and a layout search at world size 1 on CUDA) and
# the benchmark smoke run on CUDA. Exits non-zero if any fails.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
LOG_DIR=${LOG_DIR:-$(mktemp -d /tmp/mmpar_gpu_check.XXXXXX)}

python - <<'PY'
import torch
print(f'torch {torch.__version__}, CUDA {torch.version.cuda}, '
      f'available: {torch.cuda.is_available()}')
for i in range(torch.cuda.device_count()):
    print(f'  device {i}: {torch.cuda.get_device_name(i)}')
if not torch.cuda.is_available():
    print('No CUDA device: the gpu tests would only skip. Nothing to check.')
    raise SystemExit(2)
PY
status=$?
[ "$status" -eq 0 ] || exit "$status"

python -m pytest -m gpu -v -rA tests/gpu 2>&1 | tee "$LOG_DIR/pytest.log"
tests_rc=${PIPESTATUS[0]}

python benchmarks/run.py --device cuda --world-size 1 --quick \
    --out "$LOG_DIR/bench" >"$LOG_DIR/bench.log" 2>&1
bench_rc=$?

echo
echo "== mmpar GPU check summary (logs: $LOG_DIR) =="
grep -E '^tests/gpu/.* (PASSED|FAILED|ERROR|SKIPPED)' "$LOG_DIR/pytest.log" \
    | sed -E 's/ +\[ *[0-9]+%\]//'
tail -n 1 "$LOG_DIR/pytest.log"
if [ "$bench_rc" -eq 0 ]; then
    echo "benchmarks/run.py --device cuda --world-size 1 --quick: PASSED"
else
    echo "benchmarks/run.py --device cuda --world-size 1 --quick: FAILED" \
        "(rc $bench_rc; see $LOG_DIR/bench.log)"
fi
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
