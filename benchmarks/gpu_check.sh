#!/usr/bin/env bash
# One prepared device check for a lent GPU (under 8 minutes): every registered op (benchmarks/gpu_check.py's OPS,
# tested to equal the registry) against its torch reference with timings, the engine's greedy tokens on CUDA
# against the CPU, the video pipeline with the step cache on CUDA and the all-reduce under torchrun (2 GPUs), in
# one table; then the kernel benchmark table, the CUDA rows of the kernel tests and the strict doctor.
# On a CPU-only machine it runs the same steps with the CUDA rows skipped, so it stays working between GPU loans.
#
#   bash benchmarks/gpu_check.sh            # from the repository root; uses the active python
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
PY="${PYTHON:-python}"
status=0
run() {  # run STEP_NAME SECONDS command... ; records failure but keeps going
  local name=$1 limit=$2; shift 2
  echo "== $name"
  local start=$SECONDS
  timeout "$limit" "$@"; local rc=$?
  echo "== $name: exit $rc in $((SECONDS - start)) s"
  [ $rc -eq 0 ] || status=1
}

if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  run doctor 60 "$PY" -m metainfer_gen.apps.cli doctor --strict
  run "every op + end to end (cuda)" 240 "$PY" benchmarks/gpu_check.py --devices cuda
  run "kernel table (cuda)" 120 "$PY" benchmarks/kernel_table.py --device cuda --dtypes float32,bfloat16
  run "cuda test rows" 90 "$PY" -m pytest -q -p no:cacheprovider tests/kernels -k cuda
else
  echo "no CUDA device: CUDA rows skipped, CPU paths only"
  run doctor 60 "$PY" -m metainfer_gen.apps.cli doctor
  run "every op (cpu; cuda rows skipped)" 240 "$PY" benchmarks/gpu_check.py
  run "kernel table (cpu, quick)" 300 "$PY" benchmarks/kernel_table.py --device cpu --quick
  run "cuda test rows (skipped here)" 60 "$PY" -m pytest -q -p no:cacheprovider tests/kernels -k cuda
fi
echo "gpu_check: $([ $status -eq 0 ] && echo PASS || echo FAIL)"
exit $status
