# FlashAttention from first principles. `make` lists the targets.
SHELL := /bin/bash
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
NBVAL   = -p no:cacheprovider --nbval-lax --nbval-current-env --nbval-cell-timeout=600 -n $(WORKERS) --dist loadfile
export PYTHONPATH := $(CURDIR)
# Tests, notebooks and browser tests run on WORKERS processes (pytest-xdist; a notebook's cells stay on one):
# most of the work is single-threaded Python (Triton's interpreter, notebook kernels) and CI has two cores.
WORKERS ?= 2

# Which torch `make setup` installs: TORCH (one pip requirement) and, optionally, TORCH_INDEX (an index
# URL, e.g. PyTorch's CPU-only one). Given on the command line they are installed, replacing the torch
# there; left out, the venv keeps what the last `make setup` installed (.venv/torch-spec), and a first
# setup takes torch==2.13.0 (this course's CI machine has its CPU wheel on disk; elsewhere it comes
# from PyPI, which on Linux is the CUDA build). Any torch in pyproject's range works.
TORCH_DEFAULT := torch==2.13.0
TORCH_SPEC    := $(VENV)/torch-spec
ifeq ($(origin TORCH),undefined)
  TORCH := $(or $(shell sed -n 1p $(TORCH_SPEC) 2>/dev/null),$(TORCH_DEFAULT))
  ifeq ($(origin TORCH_INDEX),undefined)
    TORCH_INDEX := $(shell sed -n 2p $(TORCH_SPEC) 2>/dev/null)
  endif
endif
# One stamp per torch request, so a new TORCH or TORCH_INDEX reinstalls (a checksum: make-safe file name).
STAMP := $(BIN)/.installed-$(shell printf '%s\n%s\n' '$(TORCH)' '$(TORCH_INDEX)' | cksum | cut -d' ' -f1)
# JupyterLab defaults for the course's lab only (the venv's settings; the user's own config is untouched).
LAB_OVERRIDES := $(VENV)/share/jupyter/lab/settings/overrides.d/flash-attention-course.json

# FORCE=1 (or y, yes, true, on, any case) forces; FORCE=0 (n, no, false, off) or nothing does not.
lower    = $(shell printf '%s' '$(1)' | tr '[:upper:]' '[:lower:]')
truthy   = $(if $(filter 1 y yes true on,$(call lower,$(1))),1)
boolean  = $(if $(filter-out 0 1 n y no yes false true off on,$(call lower,$(1))),$(error $(2)=$(1): use $(2)=1 or $(2)=0),$(call truthy,$(1)))

.DEFAULT_GOAL := help
.PHONY: help setup check-setup lab grade check check-runs check-gpu test notebooks check-notebooks check-solutions run-solutions \
        e2e site bench clean

help:  ## list the targets
	@grep -hE '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-16s %s\n", $$1, $$2}'

setup: $(STAMP) $(LAB_OVERRIDES)  ## create .venv/ and install everything (TORCH="torch==..." TORCH_INDEX=URL: another torch)

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade --quiet pip
	@if [ -f $(TORCH_SPEC) ] && [ "$$(cat $(TORCH_SPEC))" != "$$(printf '%s\n%s' '$(TORCH)' '$(TORCH_INDEX)')" ]; then \
	  echo "torch: asked for '$(TORCH)' $(TORCH_INDEX); removing the torch installed before"; \
	  $(BIN)/python -m pip uninstall --yes --quiet torch; fi
	$(BIN)/python -m pip install --quiet "$(TORCH)" $(if $(TORCH_INDEX),--index-url "$(TORCH_INDEX)")
	$(BIN)/python -m pip install --quiet -e ".[lab,test,site]"
	$(BIN)/python -m ipykernel install --prefix $(VENV) --name python3 --display-name "Python 3 (course)" >/dev/null
	@printf '%s\n%s\n' '$(TORCH)' '$(TORCH_INDEX)' > $(TORCH_SPEC)
	@rm -f $(BIN)/.installed $(BIN)/.installed-*
	@touch $@
	@$(BIN)/python -c "import torch; print('torch', torch.__version__, '- CUDA available:', torch.cuda.is_available())"
	@echo "setup done: 'make check-setup' checks this machine in under a minute, then 'make lab' opens the course"

$(LAB_OVERRIDES): jupyterlab-overrides.json | $(STAMP)
	@mkdir -p $(@D)
	cp jupyterlab-overrides.json $@

check-setup: setup  ## does this machine run the course? (under a minute: torch, Triton's mode, a checker, a kernel, a notebook)
	@$(BIN)/python -m helpers.setup_check

# As root (a container, a cloud GPU box) JupyterLab refuses to start without --allow-root. LAB_ARGS: more of
# JupyterLab's options, e.g. on a remote box LAB_ARGS="--no-browser --port 8888" (README: an SSH tunnel).
ROOT_USER := $(filter 0,$(shell id -u 2>/dev/null))
LAB_ARGS  ?=
lab: setup  ## open JupyterLab on notebooks/, at 00_start_here (the course's lab: no pop-ups, saves every 15 s)
	$(BIN)/jupyter lab $(if $(ROOT_USER),--allow-root) $(LAB_ARGS) notebooks/00_start_here.ipynb

grade: setup  ## a progress table of your saved notebooks/ (only what changed is run; NB=<folder>, VERBOSE=1: hints, ALL=1)
	@$(BIN)/python -m helpers.grade $(or $(NB),notebooks) $(if $(call boolean,$(VERBOSE),VERBOSE),--verbose) \
	  $(if $(call boolean,$(ALL),ALL),--all)

notebooks: setup  ## regenerate notebooks/ from solutions/ (never overwrites your edits; FORCE=1 backs them up)
	$(BIN)/python -m helpers.generate $(if $(call boolean,$(FORCE),FORCE),--force)

test: setup  ## the unit tests (checkers, planted bugs, generator, meter, kernels under the Triton interpreter)
	$(BIN)/python -m pytest -q -n $(WORKERS) --dist worksteal tests

run-solutions: setup  ## (maintainers) re-run every worked notebook in place, saving its outputs
	COURSE_STRICT=1 $(BIN)/jupyter nbconvert --to notebook --execute --inplace \
	  --ExecutePreprocessor.timeout=600 solutions/[0-9][0-9]_*.ipynb

# The notebooks (under nbval) and the browser tests run through one pytest plugin, e2e/notebook_runs.py: a notebook's
# cells stay on one worker, the long runs go out first, and each worked notebook's kernel runs strict
# (COURSE_STRICT=1: every exercise must pass) and, but for the TRITON_LESSONS (whose GPU part needs Triton), with
# `import triton` failing (tests/hide_modules), as on macOS and Windows: one run proves both that it passes and that
# it needs no Triton. (tests/test_learner_machines.py checks what 07, 08 and 10 do without Triton.)
TRITON_LESSONS := 07 08 10
RUNS  = $(BIN)/python -m pytest -p no:cacheprovider -p e2e.notebook_runs --triton-lessons="$(TRITON_LESSONS)" \
        -n $(WORKERS) --dist loadscope --no-loadscope-reorder
NBVAL = --nbval-lax --nbval-current-env --nbval-cell-timeout=600
SOLUTIONS := $(sort $(wildcard solutions/[0-9][0-9]_*.ipynb))

check-solutions: setup  ## run every worked notebook; every exercise must pass (COURSE_STRICT=1)
	$(RUNS) $(NBVAL) $(SOLUTIONS)

check-notebooks: setup  ## run every learner notebook; exercises show "not attempted"
	$(RUNS) $(NBVAL) notebooks

e2e: setup  ## every notebook run in JupyterLab in headless Chromium, on a copy, and the site's pages (screenshots: artifacts/)
	$(RUNS) -q e2e

site: setup  ## the course as a static site in build/site/: the worked notebooks as saved, the results (offline; no re-run)
	$(BIN)/python site/build.py --repo $(CURDIR) --out build/site

# `make check` runs check-solutions, e2e and, where e2e cannot run the learner copies, check-notebooks as one pytest
# session, so that xdist balances them together. Each learner copy runs once: in JupyterLab by e2e (which checks what
# nbval does, no error, and more: nothing on stderr, figures, widgets, a ⏳ per exercise) where e2e runs here, else by
# nbval. Decided once, as check's command is made: COURSE_E2E_REQUIRED=1 (CI: no browser is a failure) says e2e runs;
# else e2e/conftest.py's own look-up (JupyterLab, Playwright, a Chromium that starts), after which e2e is required.
LAB_HERE = $(if $(filter 1,$(COURSE_E2E_REQUIRED)),1,$(shell $(BIN)/python e2e/conftest.py))
check_run = $(if $(1),COURSE_E2E_REQUIRED=1 )$(RUNS) $(NBVAL) $(SOLUTIONS) $(if $(1),,notebooks )e2e

check-runs: setup  ## (check's second part) nbval over solutions/ (and notebooks/ where e2e cannot run) and e2e, one session
	$(call check_run,$(LAB_HERE))

check: test check-runs  ## everything CI runs: the unit tests, then check-runs

# The GPU targets run with the venv's Python where there is one, else the machine's (a GPU box with torch and triton).
GPU_PY = $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PY))
BENCH_SCRIPTS := bench.py bench_paths.py bench_varlen.py bench_kvcache.py bench_bwd.py train_gpt.py \
                 "bench_bwd.py --gqa-head-dims" "bench_masks.py --d 128 64 --bwd --scaling --targets" train_llama.py
# On sm_90 (H100, H200) only: lesson 11's Gluon kernels.
GLUON_BENCH := "--variant one ws overlap pp" \
  "--variant one pp pp128 --N 16384 --dtype bfloat16 --causal --group 1 4 --out bench/results/gluon_h200_causal.json" \
  "--variant auto --N 4096 16384 --causal --out bench/results/gluon_forward_h200.json" \
  "--bwd --N 4096 16384 --causal --out bench/results/gluon_backward_h200.json"

check-gpu:  ## (CUDA GPU) kernel and checker tests natively, every notebook in a real Jupyter kernel; writes bench/results/check_gpu.json
	$(GPU_PY) bench/check_gpu.py

bench:  ## (CUDA GPU) time the kernels against SDPA's backends and FlexAttention, train a GPT and a Llama-style model; writes bench/results/
	@set -e; for s in $(BENCH_SCRIPTS); do echo "== bench/$$s"; $(GPU_PY) bench/$$s; done
	@if $(GPU_PY) -c 'import torch, sys; sys.exit(torch.cuda.get_device_capability() != (9, 0))'; then \
	  set -e; for a in $(GLUON_BENCH); do echo "== bench/bench_gluon.py $$a"; $(GPU_PY) bench/bench_gluon.py $$a; done; fi

clean:  ## remove caches (keeps .venv/)
	find . -name __pycache__ -prune -exec rm -rf {} + ; rm -rf .pytest_cache
