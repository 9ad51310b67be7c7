"""A service whose Python environment lives under /tmp (a node-local venv in $TMPDIR, the usual way to make imports
fast on a cluster; CI's fresh clone too). The interpreter is bound inside the sandbox at its own path, so under the
sandbox's /tmp; the wipe after each call must not walk or delete it. It once did: a trivial call cost ~225 ms
instead of ~1 ms, walking 66,000 entries of a real environment."""
from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from tests.helpers.sandbox_pools import make_pool

REPO = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import asyncio, json, statistics, sys, time
from sandbox.limits import Limits
from sandbox.pool import Pool
from sandbox.protocol import validate_call

async def main():
    async with Pool(Limits(num_workers=1, light_workers=1, preload=(), timeout_s=10)) as pool:
        def call(code, **kw):
            c, bad = validate_call({"code": code, **kw}, pool.limits)
            assert bad is None, bad
            return pool.run(c)
        # a math sandbox (it imports what a light one lacks), whose interpreter runs site, so sys.prefix is the venv
        prefix = (await call("import sys, sysconfig\nprint(sys.prefix)"))["stdout"].strip()
        for _ in range(20):
            await call("print(1 + 1)")
        lat, statuses = [], set()
        for _ in range(150):
            t = time.perf_counter()
            r = await call("print(1 + 1)")
            lat.append(time.perf_counter() - t)
            statuses.add(r["status"])
        s1 = await call("x = 20", session="s")
        s2 = await call("import json\nprint(x + 22)", session="s")
        print(json.dumps({"prefix": prefix, "p50_ms": statistics.median(lat) * 1000, "statuses": sorted(statuses),
                          "session": [s1["status"], s2["stdout"], s2["session"]["state"]],
                          "s2": {k: s2.get(k) for k in ("status", "reason", "stderr", "wall_s")}}))

asyncio.run(main())
"""


def tree(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*"))}


@pytest.mark.skipif(not shutil.which("bwrap"), reason="needs bubblewrap")
def test_an_environment_under_tmp_is_neither_walked_nor_slow():
    root = Path(tempfile.mkdtemp(prefix="rstar-tmpenv-", dir="/tmp"))
    try:
        venv = root / "venv"
        subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
        # as many entries as a small real environment: a wipe that walked it would pay ~20,000 failed unlinks a call
        site = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
        for i in range(200):
            pkg = site / "bulk" / f"p{i}"
            pkg.mkdir(parents=True)
            for j in range(100):
                (pkg / f"m{j}.py").write_text("x = 1\n")
        before = tree(venv)
        proc = subprocess.run([str(venv / "bin" / "python"), "-c", SCRIPT], capture_output=True, text=True,
                              timeout=600, cwd=root, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert proc.returncode == 0, proc.stderr[-3000:]
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        assert out["prefix"] == str(venv), out   # the sandboxes really ran the environment under /tmp
        assert out["statuses"] == ["ok"] and out["session"] == ["ok", "42\n", "live"], out
        # ~1-3 ms on 2 busy cores; walking the tree took ~70 ms a call here, a real environment's ~225 ms
        assert out["p50_ms"] < 25, out
        assert tree(venv) == before   # nothing under the bound environment was removed or changed
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("memfd", [True, False], ids=["memfd", "no-memfd"])
def test_the_worker_code_reaches_sandboxes_as_files_without_a_path(memfd, monkeypatch, tmp_path):
    """The worker package goes into each sandbox as data (bwrap's --ro-bind-data): nothing of it under $TMPDIR for a
    killed service to leave behind, a copy there once was. Kernels without memfd_create (before 3.17: RHEL 7) get
    unlinked files instead."""
    if not memfd:
        def missing(*a, **k):
            raise OSError(errno.ENOSYS, "Function not implemented")
        monkeypatch.setattr(os, "memfd_create", missing)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    monkeypatch.setattr(tempfile, "tempdir", None)
    p = make_pool(num_workers=1, light_workers=1)
    try:
        for code, kind in (("print(6 * 7)", "light"), ("import sympy\nprint(6 * 7)", "math")):
            r = p.run(code)
            assert r["status"] == "ok" and r["stdout"] == "42\n" and r["sandbox"] == kind, r
        assert not list(scratch.iterdir())   # while the sandboxes run, too
    finally:
        p.close()
    assert not list(scratch.iterdir())
