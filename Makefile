# Two commands set everything up on a fresh machine:
#   make run    installs ringcomm in .venv and runs the main job on 4 local workers
#   make test   installs ringcomm with its test dependencies and runs the test suite
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
NPROC  ?= 4

.PHONY: run test install install-test install-bench bench gpu-check gpu-check-standin gpu-wheels lint clean torch-version torch-suite

$(PY):
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: setup.cfg setup.py pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e .
	touch $@

# Open MPI from Debian (apt-get as root, else sudo -n; skipped, saying so, where neither
# works): the tests run ringcomm under the real mpirun, the benchmarks compare with it.
INSTALL_OPENMPI = if command -v mpirun >/dev/null 2>&1 && command -v mpicc >/dev/null 2>&1; then :; \
	elif ! command -v apt-get >/dev/null 2>&1; then echo "make: no apt-get: Open MPI not installed"; \
	else SUDO=; [ "$$(id -u)" = 0 ] || SUDO="sudo -n"; \
	  ( $$SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q \
	    openmpi-bin libopenmpi-dev ) || echo "make: Open MPI (apt) not installed; skipping it"; fi

# SLURM from Debian likewise (root only: its daemons run as root): the tests stand up a
# one-machine cluster (tests/launch/slurm_cluster.py) and run ringcomm under the real srun.
INSTALL_SLURM = if command -v srun >/dev/null 2>&1 && command -v slurmd >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then \
	  echo "make: SLURM not installed (needs root and apt-get); the srun test will be skipped"; \
	else ( apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurmd slurmctld \
	  slurm-client munge ) || echo "make: SLURM (apt) not installed; the srun test will be skipped"; fi

# PyTorch is the tests' independent numerical oracle. Only the CPU wheel 2.13.0 that lies on
# this machine kind's disk is used (--no-index: never a multi-GB CUDA download); without it
# the oracle tests are skipped, saying so.
$(VENV)/.installed-test: setup.cfg setup.py pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e ".[test]"
	( $(PY) -m pip install --quiet --no-index --no-deps "torch==2.13.0" && \
	  $(PY) -m pip install --quiet "torch==2.13.0" ) || \
	  echo "make: PyTorch 2.13.0 (CPU) is not available offline; PyTorch oracle tests will be skipped"
	@$(INSTALL_OPENMPI)
	@$(INSTALL_SLURM)
	touch $@ $(VENV)/.installed

# The bench extra (matplotlib, torch==2.13.0, mpi4py), piece by piece so that a missing peer
# is skipped, not fatal: bench/peers.py then reports it missing. Open MPI as above; torch only
# as the local CPU wheel, as for the tests.
$(VENV)/.installed-bench: setup.cfg setup.py pyproject.toml | $(VENV)/.installed
	@$(INSTALL_OPENMPI)
	$(PY) -m pip install --quiet "matplotlib>=3.7"
	( $(PY) -m pip install --quiet --no-index --no-deps "torch==2.13.0" && \
	  $(PY) -m pip install --quiet "torch==2.13.0" ) || \
	  echo "make: PyTorch 2.13.0 (CPU) is not available offline; Gloo will be reported missing"
	( command -v mpicc >/dev/null 2>&1 && $(PY) -m pip install --quiet "mpi4py>=3.1" ) || \
	  echo "make: mpi4py not installed; Open MPI will be reported missing"
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test
install-bench: $(VENV)/.installed-bench

run: install
	$(PY) -m ringcomm.launch --nproc $(NPROC)

test: install-test
	$(PY) -m pytest -q

# A few minutes on 2 cores: every collective at N=4 (1 KiB..16 MiB), ring vs PS all-reduce at
# 4 MiB for N=2 and 3 (time vs N), ringcomm vs Gloo vs Open MPI at N=2 and 4, then the plots.
# Output: bench/out/ (tables, JSON, CSV, PNG). See bench/README.md for bench/cluster.py.
BENCH_OUT ?= bench/out
bench: install-bench
	$(PY) -m ringcomm.launch --nproc 4 --no-prefix bench/collectives.py --sizes 1K:16M:x4 --out $(BENCH_OUT)
	for n in 2 3; do $(PY) -m ringcomm.launch --nproc $$n --no-prefix bench/collectives.py --out $(BENCH_OUT) \
	  --collectives all_reduce --algorithms ring,ps --sizes 4M --name scaling_n{n} || exit 1; done
	$(PY) bench/peers.py --world-sizes 2,4 --sizes 4K,256K,4M,64M --out $(BENCH_OUT)
	$(PY) bench/plots.py --out $(BENCH_OUT)

# The wheels gpu-check needs on a GPU machine that has Python 3.12, CuPy and pytest but no
# network: pyzmq and pytest-timeout, downloaded here into .whl/ (ignored by git).
GPU_PYTHON ?= 3.12
gpu-wheels: | $(PY)
	mkdir -p .whl
	$(PY) -m pip download --quiet --only-binary=:all: --no-deps --python-version $(GPU_PYTHON) \
	  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
	  --platform manylinux_2_17_x86_64 -d .whl "pyzmq>=25"
	$(PY) -m pip download --quiet --only-binary=:all: --no-deps -d .whl "pytest-timeout>=2.3"
	@ls .whl

# On a machine with a CUDA GPU and CuPy (no install: such machines may be offline). If a
# folder .whl/ holds wheels (make gpu-wheels: pyzmq for that machine's Python), they are
# installed first.
# The same steps on this machine's CPU against the CuPy stand-in (about 2 minutes).
gpu-check-standin: $(VENV)/.installed-test
	$(PY) bench/gpu_check.py --standin --out $(BENCH_OUT)

gpu-check:
	@if ls .whl/*.whl >/dev/null 2>&1; then python3 -m pip install -q --no-index --no-deps \
	  --no-compile --target /tmp/ringcomm-site .whl/*.whl; fi
	PYTHONPATH=/tmp/ringcomm-site:$(CURDIR):$$PYTHONPATH PYTHONUNBUFFERED=1 \
	  python3 bench/gpu_check.py --out $${OUT:-bench/out}

# tests/torch_backend under another torch than make test's 2.13 CPU wheel, in a side virtual
# environment (.venv-torch-<version>, ignored by git): PyPI's Linux wheels of other versions
# are CUDA builds with their libraries (several GB) and run on the CPU too. Opt-in only.
# Output: the pytest summary in bench/out/torch-<version>.txt.
TORCH_VERSION ?= 2.11.0
TORCH_VENV := .venv-torch-$(TORCH_VERSION)
torch-version: SHELL := /bin/bash
torch-version:
	[ -x $(TORCH_VENV)/bin/python ] || $(PYTHON) -m venv $(TORCH_VENV)
	$(TORCH_VENV)/bin/python -m pip install --quiet "torch==$(TORCH_VERSION)"
	$(TORCH_VENV)/bin/python -m pip install --quiet -e ".[test]"
	mkdir -p $(BENCH_OUT)
	$(TORCH_VENV)/bin/python -c "import torch; print('torch', torch.__version__)" | tee $(BENCH_OUT)/torch-$(TORCH_VERSION).txt
	$(TORCH_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/torch_backend 2>&1 | tee -a $(BENCH_OUT)/torch-$(TORCH_VERSION).txt; \
	  exit $${PIPESTATUS[0]}

# PyTorch's own backend test suite (torch.testing._internal.distributed.distributed_test) on
# Gloo and ringcomm at N=2 and 3: about half an hour per backend and N on 2 cores, so not part
# of make test. K="expr" selects tests. Output: bench/out/torch_suite (JSON, logs, the table).
TORCH_SUITE_OUT ?= bench/out/torch_suite
torch-suite: $(VENV)/.installed-test
	$(PY) -m pip install --quiet expecttest
	$(PY) bench/torch_suite.py --backends gloo,ringcomm --world-sizes 2,3 --out $(TORCH_SUITE_OUT) $(if $(K),-k "$(K)")

lint: install-test
	$(PY) -m pip install --quiet "ruff==0.17.6"
	$(VENV)/bin/ruff check ringcomm tests bench

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
