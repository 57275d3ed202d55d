# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
# Each creates .venv and installs into it on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# CPU set-up path: this exact version takes the CPU build (an unpinned torch pulls
# a multi-GB CUDA build).  A GPU machine uses its own torch: make gpu-check (scripts/gpu-check.sh).
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= test,viz

.PHONY: demo test bench profile clean gpu-wheels gpu-check
$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	touch $@

demo: $(VENV)/.installed
	$(PY) -m mpmd demo

test: $(VENV)/.installed
	$(PY) -m pytest -q tests

bench: $(VENV)/.installed
	$(PY) -m mpmd bench steps

profile: $(VENV)/.installed
	$(PY) -m mpmd profile

clean:
	rm -rf $(VENV) *.egg-info

# The CUDA checks (README, "GPUs"): gpu-wheels on a CPU machine, then gpu-check on the GPU one.
gpu-wheels:
	bash scripts/gpu-wheels.sh

gpu-check:
	bash scripts/gpu-check.sh
