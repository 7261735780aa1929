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
	$(PY) -m pip install --quiet --upgrade pip

$(VENV)/.installed: setup.cfg pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e .
	touch $@

$(VENV)/.installed-test: setup.cfg pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e ".[test]"
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
