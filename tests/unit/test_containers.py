"""The container images (containers/): one per role, each installing the wheel on a base that brings what would
otherwise compile (the trainer's Transformer Engine, the rollout's CUDA vLLM), and the sandbox's slim list of
dependencies covering what its service imports. No image can be built on this machine (no docker, no apptainer);
the launch side of containers (the srun lines) is tested in test_placement.py."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CONTAINERS = REPO / "containers"
ROLES = ("trainer", "rollout", "sandbox")


def _requirement_names(specs: str) -> set[str]:
    return {re.match(r"[A-Za-z0-9_.-]+", s).group(0).lower().replace("_", "-") for s in specs.split()}


@pytest.mark.parametrize("role", ROLES)
def test_each_role_has_an_image_that_installs_the_wheel_and_compiles_nothing(role):
    docker = (CONTAINERS / f"{role}.Dockerfile").read_text()
    assert re.search(r"^ARG WHEEL=dist/rstar_hpc-[\d.]+-py3-none-any\.whl$", docker, re.M)
    assert "COPY ${WHEEL} /tmp/" in docker and re.search(r"pip install .*/tmp/\$\(basename \$\{WHEEL\}\)", docker)
    assert not re.search(r"pip install[^\n]*(transformer[-_]engine|\s\.\s|-e )", docker), "nothing builds from source"
    assert "ENTRYPOINT []" in docker     # pyxis and apptainer run the step's own command
    definition = (CONTAINERS / f"{role}.def").read_text()
    assert f"From: rstar-hpc-{role}:" in definition and f"-f containers/{role}.Dockerfile -t rstar-hpc-{role}:" in \
        definition


def test_the_heavy_bases_keep_their_own_torch():
    assert "nvcr.io/nvidia/pytorch" in (CONTAINERS / "trainer.Dockerfile").read_text()
    assert "vllm/vllm-openai" in (CONTAINERS / "rollout.Dockerfile").read_text()
    for role in ("trainer", "rollout"):
        assert "--constraint /tmp/keep.txt" in (CONTAINERS / f"{role}.Dockerfile").read_text()
    setup = (REPO / "setup.py").read_text()
    assert '"torch>=' in setup.split("install_requires = [")[1].split("]")[0], "a pinned base torch would replace theirs"


def test_the_sandbox_image_has_what_the_service_imports_and_no_torch():
    docker = (CONTAINERS / "sandbox.Dockerfile").read_text()
    listed = _requirement_names(re.search(r'^ARG SANDBOX_DEPS="([^"]+)"$', docker, re.M).group(1))
    assert "--no-deps" in docker and not listed & {"torch", "vllm", "megatron-core", "transformers"}
    # what `rstar-hpc sandbox serve` imports (the service, its pools, the run-dir bookkeeping), as distributions
    probe = ("import sys, json, importlib.metadata as md\n"
             "import rstar_hpc.cli.sandbox, sandbox.server, sandbox.pool, sandbox.bwrap, sandbox.client\n"
             "import sandbox.worker.server, rstar_hpc.exchange.placement, rstar_hpc.logs, rstar_hpc.config\n"
             "from rstar_hpc.config import load_config; load_config('tiny-cpu')\n"
             "dists = md.packages_distributions()\n"
             "print(json.dumps(sorted({d for m in list(sys.modules) for d in dists.get(m.split('.')[0], [])})))\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    imported = {d.lower().replace("_", "-") for d in json.loads(out.stdout)}
    transitive = {"rstar-hpc", "setuptools", "annotated-types", "pydantic-core", "typing-inspection",
                  "typing-extensions"}   # the wheel itself, and pydantic's own dependencies
    assert imported - transitive <= listed, f"the sandbox image lacks {sorted(imported - transitive - listed)}"
    # the model's math cells run numpy and sympy inside the sandbox (sandbox/limits.py preloads them)
    assert {"numpy", "sympy", "uvloop"} <= listed
    setup = (REPO / "setup.py").read_text().split("install_requires = [")[1].split("]")[0]
    assert listed <= _requirement_names(" ".join(re.findall(r'^\s*"([^"]+)"', setup, re.M)))
