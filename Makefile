# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
# Each creates .venv and installs into it on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# CPU set-up path: this exact version takes the CPU build (an unpinned torch pulls
# a multi-GB CUDA build).  On a GPU machine: make TORCH_SPEC='torch' EXTRAS='test,viz,gpu'.
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= test,viz

.PHONY: demo test bench profile clean
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
	$(PY) -m mpmd bench

profile: $(VENV)/.installed
	$(PY) -m mpmd profile

clean:
	rm -rf $(VENV) *.egg-info
