# Two commands that work on a fresh machine from nothing:
#   make test   the test suite; Triton kernels run on the CPU through the interpreter
#   make run    the main job: on a GPU the benchmark suite; without one every op's
#               self-check through the interpreter and the per-op byte budget
VENV ?= .venv
PY := $(VENV)/bin/python

$(VENV)/.installed: pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0 triton==3.6.0 "numpy<2.3"
	$(PY) -m pip install -q -c constraints.txt -e ".[test,hf]"
	touch $@

.PHONY: test run
test: $(VENV)/.installed
	$(PY) -m ruff check src tests benchmarks examples
	TRITON_INTERPRET=1 $(PY) -m pytest -q -n auto

run: $(VENV)/.installed
	$(PY) -m onepass.cli run
