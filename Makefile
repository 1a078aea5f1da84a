# kernelboard — every target bootstraps what it needs. `make help` lists them.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# The CPU build of torch: pinned so pip never pulls a multi-GB CUDA build on a machine without a GPU.
TORCH_CPU ?= torch==2.13.0
DATA   ?= data
OUT    ?= dist
EVAL_ARGS ?=

.DEFAULT_GOAL := help
.PHONY: help site serve eval eval-mega test test-all lint bench clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/:.*## /\t/' | expand -t 12

$(VENV)/.site: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.dev: pyproject.toml $(VENV)/.site
	$(BIN)/pip install -q "$(TORCH_CPU)"
	$(BIN)/pip install -q -e ".[dev,eval,traces]"
	touch $@

site: $(VENV)/.site  ## build the static site from data/ into dist/
	$(BIN)/kernelboard site build --data $(DATA) --out $(OUT)

serve: site  ## build, then serve dist/ on http://127.0.0.1:8000/
	$(BIN)/kernelboard site serve --dir $(OUT)

# Grading needs a CUDA GPU and a CUDA build of torch: .venv-eval sees the machine's own torch
# (--system-site-packages) and adds kernelboard without touching it.
EVAL_VENV ?= .venv-eval

# A virtualenv that sees every package $(PYTHON) sees: --system-site-packages covers a plain or conda
# Python and the NGC container; where $(PYTHON) is itself a virtualenv (the H200 image's python3), a
# .pth file adds that virtualenv's own site-packages, which --system-site-packages alone would miss.
$(EVAL_VENV)/bin/python:
	$(PYTHON) -m venv --system-site-packages $(EVAL_VENV)
	$(PYTHON) -c "import site, sys; print('\n'.join(p for p in site.getsitepackages() if sys.prefix != sys.base_prefix))" \
	  > "$$($(EVAL_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_parent_env.pth"

# One deck's grading (make eval, make eval-mega): the eval virtualenv must see torch and the rest.
define grade_deck
	$(EVAL_VENV)/bin/python -c "import torch, pyarrow, yaml, click, rich" || \
	  { echo "make $@ needs torch (a CUDA build), pyarrow, pyyaml, click and rich in $(PYTHON)"; exit 1; }
	$(EVAL_VENV)/bin/pip install -q --no-deps --no-build-isolation -e .
	$(EVAL_VENV)/bin/kernelboard eval --deck eval/decks/$(1) --submissions $(DATA)/submissions/$(1) \
	  --out $(DATA)/results $(EVAL_ARGS)
endef

eval: $(EVAL_VENV)/bin/python  ## grade data/submissions on this machine's GPU into data/results (EVAL_ARGS=--only GLOB …)
	$(call grade_deck,hard)

eval-mega: $(EVAL_VENV)/bin/python  ## the same for the Mega deck (data/submissions/mega)
	$(call grade_deck,mega)

# System packages the tests need: Chromium (the site tests drive it through Playwright) and bubblewrap
# (the grader's sandbox). Missing ones are installed with apt-get, after saying so; without apt-get
# or root, the line names what to install.
SYSTEM_PACKAGES := chromium:chromium bwrap:bubblewrap

# pytest-xdist workers: a test module to a worker (its graded fixtures stay with it), the longest modules
# first (tests/conftest.py orders them). Two keep a 2-core machine busy while a grading waits out a timeout.
TEST_JOBS ?= 2

test: $(VENV)/.dev  ## lint, then the CPU tests but the slow end-to-end ones (CI=true: all of them)
	@missing=""; for pair in $(SYSTEM_PACKAGES); do command -v $${pair%%:*} >/dev/null || missing="$$missing $${pair##*:}"; done; \
	if [ -n "$$missing" ]; then \
	  echo "make test: installing system packages with apt-get:$$missing (the browser tests and the grader's sandbox need them)"; \
	  { command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; } || { echo "make test: cannot install$$missing here (needs apt-get as root); install them and run again"; exit 1; }; \
	  apt-get update -q && apt-get install -y -q $$missing || { echo "make test: apt-get could not install$$missing (is another apt running?); install them and run again"; exit 1; }; \
	fi
	$(BIN)/ruff check .
	$(BIN)/pytest -q -n $(TEST_JOBS) --dist loadfile --no-loadscope-reorder

test-all:  ## make test with CI=true: every test, the slow end-to-end ones too (what .ci/run runs)
	$(MAKE) test CI=true

lint: $(VENV)/.dev  ## ruff only
	$(BIN)/ruff check .

bench: $(VENV)/.dev  ## CPU benchmarks, each reported as a ratio against a baseline run beside it
	$(BIN)/python bench/site_build.py
	@echo "site_build.py at 10,000 runs (synthetic; a few minutes on 2 cores):"
	$(BIN)/python bench/site_build.py --runs 10000 --skip-small
	$(BIN)/python bench/grader_overhead.py
	$(BIN)/python bench/output_transfer.py

clean:  ## remove built output and caches (keeps the virtualenvs)
	rm -rf $(OUT) .pytest_cache .ruff_cache build *.egg-info
