# ddplab: `make lab` to learn, `make test` to check. Everything lives in $(VENV).
#
# Setup installs the lock (requirements.lock: every package pinned and hashed, torch
# included) with uv, which reads only PyPI: the same packages on every machine. On Linux
# PyPI's torch is the CUDA build, which also runs on machines without a GPU. To take torch
# from another index (the CPU-only build is a much smaller download), name it:
#   make setup TORCH_INDEX=https://download.pytorch.org/whl/cpu
#   make setup TORCH_INDEX=https://download.pytorch.org/whl/cu128
#   make setup TORCH_INDEX=/path/to/a/folder/of/wheels       (an offline classroom)
# Everything but torch and the CUDA build's own packages then still comes from the lock.

PYTHON      ?= python3
VENV        ?= .venv
LOCK        ?= requirements.lock
TORCH_INDEX ?=
LAB_ARGS    ?=
# Two test processes (pytest-xdist), each taking whole files, so a notebook's cells run in
# order in one kernel. Much of the suite waits (for launchers, rendezvous, hang deadlines),
# so two at once finish in about three quarters of the time even on two cores. The files
# are handed out longest first (tests/conftest.py, FILE_SECONDS), not by their number of
# tests, xdist's default: no long file is left to run alone at the end.
# `make test PYTEST_ARGS=` runs everything in one process.
PYTEST_ARGS ?= -n 2 --dist loadfile --no-loadscope-reorder
# The torch release the lock pins, and the notebooks' outputs were made with.
TORCH       ?= torch==2.13.0
# uv installs and locks; it is bootstrapped into the venv by pip, pinned.
UV_VERSION  := 0.13.9
UV          := $(VENV)/uv/bin/uv
UV_PIP       = $(UV) pip --quiet
# The Pythons `make test-matrix` runs the suite on (each must be on PATH as pythonX.Y).
PYTHONS     ?= 3.10 3.11 3.12 3.13
# The packages that only the CUDA build of torch needs: left out of the lock's install when
# TORCH_INDEX brings torch from elsewhere.
CUDA_ONLY   := ^(torch|triton|nvidia-[a-z0-9-]+|cuda-[a-z]+)==

# Use the venv's Jupyter kernels and config before any in the user's home.
export JUPYTER_PREFER_ENV_PATH = 1
# Compile every installed module to bytecode once, at setup, as pip does and uv does not by
# default. Without it each process compiles torch's Python sources again on import wherever
# caches cannot be written (PYTHONDONTWRITEBYTECODE, a read-only venv): `import torch` then
# costs about 2.8 s of CPU instead of 1.5 s, paid by every kernel, rank server and launcher.
export UV_COMPILE_BYTECODE = 1

STAMP := $(VENV)/.ddplab-setup

.DEFAULT_GOAL := help
.PHONY: help setup lab test quick stress lint notebooks lock test-latest test-matrix clean

help: ## list the targets
	@echo "make <target>   (variables: PYTHON VENV TORCH_INDEX LAB_ARGS PYTEST_ARGS PYTHONS)"
	@awk -F ':.*## ' '/^[a-z-]+:.*## / { printf "  %-12s %s\n", $$1, $$2 }' $(MAKEFILE_LIST)

setup: $(STAMP) ## create the venv from the lock (instant once done)

# A venv with uv bootstrapped into it (pinned) by the venv's own pip: setup's and
# test-latest's, one recipe.
%/uv/bin/uv:
	test -x $*/bin/python || $(PYTHON) -m venv $*
	$*/bin/python -m pip install --quiet --target $*/uv "uv==$(UV_VERSION)"

$(STAMP): $(LOCK) pyproject.toml | $(UV)
ifeq ($(strip $(TORCH_INDEX)),)
	$(UV_PIP) sync --python $(VENV)/bin/python --require-hashes $(LOCK)
else
	awk '/^[^ #]/ { skip = ($$0 ~ /$(CUDA_ONLY)/) } !skip' $(LOCK) > $(VENV)/lock-without-torch.txt
	$(UV_PIP) sync --python $(VENV)/bin/python --require-hashes $(VENV)/lock-without-torch.txt
	$(UV_PIP) install --python $(VENV)/bin/python --no-deps \
	    $(if $(wildcard $(TORCH_INDEX)),--no-index --find-links,--index-url) $(TORCH_INDEX) \
	    "torch==$(shell sed -n 's/^torch==\([^ ;]*\).*/\1/p' $(LOCK) | head -n 1)"
endif
	$(UV_PIP) install --python $(VENV)/bin/python --no-deps -e .
	touch $@

lab: setup ## open JupyterLab on notebooks/ (pass more options with LAB_ARGS=...)
	$(VENV)/bin/ddplab lab $(LAB_ARGS)

test: lint ## ruff and the import rules, then the unit tests and nbval over every notebook
	$(VENV)/bin/pytest $(PYTEST_ARGS)

quick: setup ## the fast inner loop (under a minute): no chapters, browser, launchers, exercises or slow tests
	$(VENV)/bin/pytest $(PYTEST_ARGS) -m "not notebook and not browser and not launchers and not exercises and not slow" tests

# The stress harness's counts are benchmarks/RESULTS.md's; DDPLAB_STRESS_SCALE=0.1 runs a
# tenth of each, DDPLAB_STRESS_TABLE=FILE also writes the table there.
stress: setup ## the fragile sequences, hundreds of times each beside the whole suite as load (about an hour); a table at the end
	$(VENV)/bin/pytest -p no:xdist -m stress tests/stress

lint: setup ## ruff, and the package's import rules (pyproject.toml, [tool.importlinter])
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports --no-cache

notebooks: setup ## re-execute every notebook in place, so outputs come from the kit
	$(VENV)/bin/ddplab execute notebooks

lock: setup ## refresh requirements.lock: the newest releases (torch as TORCH says) for every supported Python
	echo "$(TORCH)" | $(UV) pip compile pyproject.toml - --extra test --universal \
	    --python-version 3.10 --generate-hashes --upgrade --quiet \
	    --custom-compile-command "make lock" --output-file $(LOCK)

test-latest: .venvs/latest/uv/bin/uv ## the whole suite in .venvs/latest, on the newest release of everything, torch included
	.venvs/latest/uv/bin/uv pip install --quiet --python .venvs/latest/bin/python --upgrade --reinstall-package ddplab -e ".[test]"
	.venvs/latest/bin/pip list --format=freeze 2>/dev/null | grep -iE '^(torch|cloudpickle|ipython|ipykernel|jupyterlab|matplotlib|numpy|nbval|pytest)=='
	.venvs/latest/bin/ruff check .
	.venvs/latest/bin/lint-imports --no-cache
	.venvs/latest/bin/pytest $(PYTEST_ARGS)

test-matrix: ## the whole suite on every Python in PYTHONS, each in .venvs/pyX.Y from the lock; a table at the end
	@for py in $(PYTHONS); do \
	    $(MAKE) --no-print-directory test PYTHON=python$$py VENV=.venvs/py$$py \
	        PYTEST_ARGS="$(PYTEST_ARGS) --junitxml=.venvs/py$$py/junit.xml" || true; \
	done
	@$(PYTHON) tests/matrix_table.py $(foreach py,$(PYTHONS),.venvs/py$(py))

clean: ## remove the venv (and the matrix's and test-latest's, in .venvs/)
	rm -rf $(VENV) .venvs
