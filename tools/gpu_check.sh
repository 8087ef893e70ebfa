#!/usr/bin/env bash
# One GPU check, one command: the CUDA tests and the GPU path's four headline figures.
# Size: one device call of at most 8 minutes (4.5 measured on an H200: ~3.3 for the tests, whose
# first Triton compiles dominate, ~3 for the figures), so that 15 minutes of GPU time leave room
# to fix something and run it once more. Carries .whl/ from `make gpu-wheels` (~18 MB), like
# tools/gpu_session.sh; no network, no model download.
#   1. pytest on CUDA: Triton kernels, fused layer, CUDA graphs, async scheduling, batch invariance
#      (tests/test_kernels.py, test_fused.py, test_cuda_graphs.py, test_batch_invariant.py, then
#      test_engine.py -k async, test_fused_moe.py), at most 5 minutes 15 s
#   2. tools/gpu_check.py: Qwen3-0.6B and Qwen3-8B shapes with random bfloat16 weights made on the
#      GPU, each with and without async scheduling: batch-1 decode tok/s (CUDA graphs), the 8B
#      decode's share of the HBM roofline, nano-vllm's workload (256 requests, lengths 100-1024)
#      on 0.6B, and an 8k-token prefill in ms; at most 3.5 minutes, JSON written after each shape
# Leaves in $OUT (default /tmp/gpu_out): pytest.log, gpu_check.log, gpu_check.json and
# summary.txt, one PASS/FAIL line per item; exits non-zero if any item failed.
# Dry mode (tools/gpu_check.sh --dry, or GPU_CHECK_DRY=1): everything but the CUDA parts, on the
# CPU at toy sizes, in seconds; `make test` runs it so that its Python is checked without a GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_out}
DRY=${GPU_CHECK_DRY:-0}
[ "${1:-}" = --dry ] && DRY=1
mkdir -p "$OUT"
: > "$OUT/summary.txt"
note() {  # note ITEM RC: one line of the summary
  if [ "$2" = 0 ]; then echo "PASS $1"; else echo "FAIL $1"; fi | tee -a "$OUT/summary.txt"
}

if [ "$DRY" = 1 ]; then
  PY=${PYTHON:-.venv/bin/python}
  echo "dry run: no CUDA tests (make test runs them on the CPU), figures at toy sizes on the CPU"
else
  PY=python3
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton",
              triton.__version__, torch.cuda.get_device_name())' || exit 1
  timeout 210 python3 -m pytest -q -m "not slow" tests/test_kernels.py tests/test_fused.py \
    tests/test_cuda_graphs.py tests/test_batch_invariant.py 2>&1 | tee "$OUT/pytest.log"
  note "pytest on CUDA: kernels, fused layer, CUDA graphs, batch invariance" "${PIPESTATUS[0]}"
  timeout 45 python3 -m pytest -q -m "not slow" tests/test_engine.py -k async 2>&1 |
    tee -a "$OUT/pytest.log"
  note "pytest on CUDA: async scheduling" "${PIPESTATUS[0]}"
  timeout 60 python3 -m pytest -q -m "not slow" tests/test_fused_moe.py 2>&1 |
    tee -a "$OUT/pytest.log"
  note "pytest on CUDA: fused MoE (bfloat16 included)" "${PIPESTATUS[0]}"
fi

timeout 210 "$PY" tools/gpu_check.py "$OUT" $([ "$DRY" = 1 ] && echo --dry) 2>&1 |
  tee "$OUT/gpu_check.log" | grep -E '^(PASS|FAIL)' | tee -a "$OUT/summary.txt"
note "figures: tools/gpu_check.py ($OUT/gpu_check.json, gpu_check.log)" "${PIPESTATUS[0]}"
echo "== summary"; cat "$OUT/summary.txt"
! grep -q '^FAIL' "$OUT/summary.txt"
