#!/bin/bash
# The GPU checks on a lent device machine (not CI): run from the repo root
#   bash .ci/gpu_device_run.sh          (carry .whl)
# Its image has torch (CUDA) but not MMEngine; first, here, download the
# wheels it lacks into .whl/ (ignored through .git/info/exclude):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_17_x86_64 -d .whl \
#     mmengine==0.10.7 addict yapf termcolor platformdirs
# Idempotent: the machine stays warm between calls, so nothing here writes
# outside /tmp/site and $OUT (a shim written over a link from an earlier
# call once replaced the venv's own python with itself and hung the run).
set -u
PY=python3
if ! $PY -c 'import torch' 2>/dev/null; then
  for c in /opt/torch/.venv/bin/python3 $(which -a python3 python); do
    if [ -x "$c" ] && "$c" -c 'import torch' 2>/dev/null; then PY=$c; break; fi
  done
fi
echo "python: $PY"
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/site .whl/*.whl || exit 3
# A venv's own bin directory has `python`; prepend it rather than link it.
export PATH="$(dirname "$PY"):$PATH" PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
python -c "import torch, mmengine; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'mmengine', mmengine.__version__)" || exit 4
start=$(date +%s)
LOG_DIR=/tmp/gpulog timeout "${CHECK_S:-300}" bash tools/gpu_check.sh > "$OUT/gpu_check.log" 2>&1
echo "gpu_check rc=$? in $(( $(date +%s) - start )) s"
start=$(date +%s)
mkdir -p /tmp/benchout
timeout "${BENCH_S:-120}" python benchmarks/bench_llm.py --device cuda ${BENCH_ARGS:---quick} \
    --out /tmp/benchout > "$OUT/bench_llm.log" 2>&1
echo "bench_llm rc=$? in $(( $(date +%s) - start )) s"
cp /tmp/gpulog/bench/benchmarks.md "$OUT/run_quick_benchmarks.md" 2>/dev/null
cp /tmp/benchout/benchmarks.md "$OUT/bench_llm_benchmarks.md" 2>/dev/null
tail -n 25 "$OUT/gpu_check.log"; tail -n 15 "$OUT/bench_llm.log"
