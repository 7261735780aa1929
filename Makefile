# Two commands set everything up on a fresh machine:
#   make run    installs ringcomm in .venv and runs the main job on 4 local workers
#   make test   installs ringcomm with its test dependencies and runs the test suite
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
NPROC  ?= 4

.PHONY: run test install install-test lint clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: setup.cfg pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e .
	touch $@

# PyTorch is the tests' independent numerical oracle. Only the CPU wheel 2.13.0 that lies on
# this machine kind's disk is used (--no-index: never a multi-GB CUDA download); without it
# the oracle tests are skipped, saying so.
$(VENV)/.installed-test: setup.cfg pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e ".[test]"
	( $(PY) -m pip install --quiet --no-index --no-deps "torch==2.13.0" && \
	  $(PY) -m pip install --quiet "torch==2.13.0" ) || \
	  echo "make: PyTorch 2.13.0 (CPU) is not available offline; PyTorch oracle tests will be skipped"
	touch $@ $(VENV)/.installed

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

run: install
	$(PY) -m ringcomm.launch --nproc $(NPROC)

test: install-test
	$(PY) -m pytest -q

lint: install-test
	$(PY) -m pip install --quiet ruff
	$(VENV)/bin/ruff check ringcomm tests

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
