# FlashAttention from first principles. `make` lists the targets.
SHELL := /bin/bash
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
# This machine has torch 2.13.0 (CPU) on disk; any torch in pyproject's range works.
TORCH   ?= torch==2.13.0
NBVAL   := -p no:cacheprovider --nbval-lax --nbval-current-env --nbval-cell-timeout=600
export PYTHONPATH := $(CURDIR)

.DEFAULT_GOAL := help
.PHONY: help setup lab grade check test notebooks check-notebooks check-solutions run-solutions e2e bench clean

help:  ## list the targets
	@grep -hE '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-16s %s\n", $$1, $$2}'

setup: $(BIN)/.installed  ## create .venv/ and install everything (one command, fresh machine)

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade --quiet pip
	$(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e ".[test]"
	$(BIN)/python -m ipykernel install --prefix $(VENV) --name python3 --display-name "Python 3 (course)" >/dev/null
	@touch $@
	@echo "setup done: open the course with 'make lab'"

lab: setup  ## open JupyterLab on notebooks/
	$(BIN)/jupyter lab notebooks/

grade: setup  ## a progress table of your notebooks/ (run headless; files unchanged; NB=<folder> for another)
	@$(BIN)/python -m helpers.grade $(or $(NB),notebooks)

notebooks: setup  ## regenerate notebooks/ from solutions/ (never overwrites your edits; FORCE=1 backs them up)
	$(BIN)/python -m helpers.generate $(if $(FORCE),--force)

test: setup  ## the unit tests (checkers, planted bugs, generator, meter, kernels under the Triton interpreter)
	$(BIN)/python -m pytest -q tests

run-solutions: setup  ## (maintainers) re-run every worked notebook in place, saving its outputs
	COURSE_STRICT=1 $(BIN)/jupyter nbconvert --to notebook --execute --inplace \
	  --ExecutePreprocessor.timeout=600 solutions/[0-9][0-9]_*.ipynb

check-solutions: setup  ## run every worked notebook; every exercise must pass (COURSE_STRICT=1)
	COURSE_STRICT=1 $(BIN)/python -m pytest $(NBVAL) solutions

check-notebooks: setup  ## run every learner notebook; exercises show "not attempted"
	$(BIN)/python -m pytest $(NBVAL) notebooks

e2e: setup  ## every notebook run in JupyterLab in headless Chromium, on a copy (screenshots: artifacts/e2e/)
	$(BIN)/python -m pytest -q -p no:cacheprovider e2e

check: test check-solutions check-notebooks e2e  ## everything CI runs: unit tests, nbval over solutions/ and notebooks/, e2e

bench:  ## time the Triton kernels (forward, decode, backward) against SDPA and train a small GPT (CUDA GPU; writes bench/results/)
	$(if $(wildcard $(BIN)/python),$(BIN)/python,$(PY)) bench/bench.py
	$(if $(wildcard $(BIN)/python),$(BIN)/python,$(PY)) bench/bench_bwd.py
	$(if $(wildcard $(BIN)/python),$(BIN)/python,$(PY)) bench/train_gpt.py

clean:  ## remove caches (keeps .venv/)
	find . -name __pycache__ -prune -exec rm -rf {} + ; rm -rf .pytest_cache
