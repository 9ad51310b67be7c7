"""rstar-hpc as a site installs it: the wheel built from this tree, installed (not editable) into a fresh venv, and
its commands run from a directory that is no checkout. The venv reaches the suite's own dependencies through a .pth
line (reinstalling torch and vLLM would take minutes and gigabytes); that directory holds no rstar_hpc or sandbox
package, and a path listed in a .pth file is not itself scanned for .pth files, so the checkout's editable hook stays
out: `rstar_hpc` and `sandbox` can only come from the wheel."""
from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


@dataclasses.dataclass(frozen=True)
class Installed:
    wheel: Path
    venv: Path
    site_packages: Path
    cwd: Path              # an empty directory outside the checkout, where its commands run

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    def rstar(self, *args: str, env: dict, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        """The installed console script, from `cwd`, with no PYTHONPATH."""
        env = {k: v for k, v in env.items() if k != "PYTHONPATH"}
        proc = subprocess.run([str(self.venv / "bin" / "rstar-hpc"), *args], capture_output=True, text=True, env=env,
                              timeout=timeout, cwd=self.cwd)
        if check:
            assert proc.returncode == 0, f"rstar-hpc {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-4000:]}"
        return proc


def _tree_copy(dest: Path) -> Path:
    """The files git would commit (tracked, and new ones not ignored), so no build output or venv of the checkout
    goes into the wheel."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True,
                           check=True).stdout.decode().split("\0")
    for name in filter(None, files):
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


def install(root: Path) -> Installed:
    src = _tree_copy(root / "src")
    dist = root / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist),
                    str(src)], check=True, capture_output=True, timeout=300)
    wheel = next(dist.glob("rstar_hpc-*.whl"))
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = Path(subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path("
                                "'purelib'))"], capture_output=True, text=True, check=True).stdout.strip())
    (site / "suite_dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "--no-deps",
                    "--no-index", "-q", str(wheel)], check=True, capture_output=True, timeout=300)
    cwd = root / "elsewhere"
    cwd.mkdir()
    return Installed(wheel, venv, site, cwd)
