# ddplab: `make lab` to learn, `make test` to check. Everything lives in $(VENV).
#
# GPU users pick a CUDA build of torch, CPU-only laptops a CPU build, e.g.
#   make setup TORCH_INDEX=https://download.pytorch.org/whl/cu128
#   make setup TORCH_INDEX=https://download.pytorch.org/whl/cpu
# (an existing venv keeps its torch: `make clean` first.)

PYTHON      ?= python3
VENV        ?= .venv
TORCH       ?= torch==2.13.0
TORCH_INDEX ?=
LAB_ARGS    ?=
# Two test processes (pytest-xdist), each taking whole files, so a notebook's cells run in
# order in one kernel. Much of the suite waits (for launchers, rendezvous, hang deadlines),
# so two at once finish in about three quarters of the time even on two cores.
# `make test PYTEST_ARGS=` runs everything in one process.
PYTEST_ARGS ?= -n 2 --dist loadfile

# Use the venv's Jupyter kernels and config before any in the user's home.
export JUPYTER_PREFER_ENV_PATH = 1

STAMP := $(VENV)/.ddplab-setup

.DEFAULT_GOAL := help
.PHONY: help setup lab test quick lint notebooks clean

help: ## list the targets
	@echo "make <target>   (variables: PYTHON VENV TORCH TORCH_INDEX LAB_ARGS PYTEST_ARGS)"
	@awk -F ':.*## ' '/^[a-z]+:.*## / { printf "  %-10s %s\n", $$1, $$2 }' $(MAKEFILE_LIST)

setup: $(STAMP) ## create the venv with torch first, then ddplab[test] (instant once done)

# torch is installed on its own, first, so that the pinned build (or the one from
# TORCH_INDEX) is the one that satisfies ddplab's `torch>=...` requirement.
$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH)"
	$(VENV)/bin/python -m pip install -e ".[test]"
	touch $@

lab: setup ## open JupyterLab on notebooks/ (pass more options with LAB_ARGS=...)
	$(VENV)/bin/ddplab lab $(LAB_ARGS)

test: lint ## ruff, then the unit tests and nbval over every notebook
	$(VENV)/bin/pytest $(PYTEST_ARGS)

quick: setup ## the fast inner loop (under a minute): no chapters, browser, launchers, exercises or slow tests
	$(VENV)/bin/pytest $(PYTEST_ARGS) -m "not notebook and not browser and not launchers and not exercises and not slow" tests

lint: setup ## ruff check
	$(VENV)/bin/ruff check .

notebooks: setup ## re-execute every notebook in place, so outputs come from the kit
	$(VENV)/bin/ddplab execute notebooks

clean: ## remove the venv
	rm -rf $(VENV)
