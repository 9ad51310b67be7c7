"""`rstar-hpc launch` refuses, before it submits, an MPI the rollout's ranks cannot join on (they join through Open
MPI 4's ompi-server), naming the version and the way out; it lets this machine's Open MPI 4.1 through."""
from __future__ import annotations

import pytest

from rstar_hpc.config import load_config
from rstar_hpc.launch.launcher import LaunchError, mpi_refusal, preflight, rollout_mpi_problem


@pytest.mark.parametrize("version, has_server, says", [
    ("Open MPI v5.0.5, package: Open MPI conda", True, "Open MPI v5.0.5, which has none"),
    ("MPICH Version:      4.2.0", True, "MPICH Version:      4.2.0, which has none"),
    ("Intel(R) MPI Library 2021.12 for Linux* OS", True, "Intel(R) MPI Library 2021.12 for Linux* OS, which has none"),
    ("Open MPI v4.1.6, package: Open MPI", False, "ompi-server, not found on PATH"),
    (None, True, "cannot import mpi4py"),
])
def test_an_mpi_without_ompi_server_is_refused_with_the_way_out(version, has_server, says):
    text = mpi_refusal(version, has_server, "/opt/py/bin/python", "ImportError: libmpi.so.40")
    assert says in text and "launch.modules" in text and "launch.rollout.container" in text, text


def test_open_mpi_4_passes_and_this_machine_launches(tmp_path):
    assert mpi_refusal("Open MPI v4.1.4, package: Debian OpenMPI", True, "python3") is None
    cfg = load_config("tiny-cpu", [f"run.root={tmp_path}"])
    assert rollout_mpi_problem(cfg) is None   # the venv's mpi4py on Debian's Open MPI 4.1.4
    # a rollout in an image, or an MPI the job's modules load, is not judged from here
    assert rollout_mpi_problem(load_config("tiny-cpu", ["launch.modules=[openmpi/5.0]"])) is None


def test_preflight_stops_a_launch_on_a_python_without_mpi4py(tmp_path):
    cfg = load_config("tiny-cpu", [f"run.root={tmp_path}", "launch.python=/usr/bin/python3"])
    with pytest.raises(LaunchError, match="cannot import mpi4py"):
        preflight(cfg)
