"""The sandbox against the interpreter it imitates: every program of programs.yaml runs through
`rstar-hpc sandbox exec` and through plain `python3 main.py` in a temporary directory; stdout, the exit code
and the last line of stderr must match, except where a documented limit applies (the entry says which, and
what the sandbox reports instead)."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from sandbox.bwrap import bwrap_env

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
PROGRAMS = yaml.safe_load((HERE / "programs.yaml").read_text())


def test_the_program_list_is_well_formed():
    names = [p["name"] for p in PROGRAMS]
    assert len(names) == len(set(names)), "duplicate names"
    assert len(PROGRAMS) >= 60
    for p in PROGRAMS:
        assert ("code" in p) != ("cells" in p), p["name"]
        assert set(p) <= {"name", "code", "cells", "stdin", "limit", "python", "expect"}, p["name"]
        assert ("limit" in p) == ("expect" in p), f"{p['name']}: a documented limit says what the sandbox reports"


@pytest.fixture(scope="module")
def sandboxed() -> dict[str, list[dict]]:
    """name -> results (one per cell), all programs in one `rstar-hpc sandbox exec` run."""
    lines, owners = [], []
    for p in PROGRAMS:
        for cell in p.get("cells") or [p["code"]]:
            call = {"id": len(lines), "code": cell, "stdin": p.get("stdin", "")}
            if "cells" in p:
                call["session"] = "diff-" + p["name"]
            lines.append(json.dumps(call))
            owners.append(p["name"])
    proc = subprocess.run([sys.executable, "-m", "rstar_hpc", "sandbox", "exec", "--workers", "2"],
                          input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results: dict[str, list[dict]] = {}
    for owner, line in zip(owners, proc.stdout.splitlines(), strict=True):
        results.setdefault(owner, []).append(json.loads(line))
    return results


def run_python(p: dict, tmp_path: Path) -> subprocess.CompletedProcess:
    """`python3 main.py` in a fresh directory, in the environment a sandbox gives its cells."""
    code = "\n".join(p["cells"]) if "cells" in p else p["code"]
    (tmp_path / "main.py").write_text(code)
    return subprocess.run([sys.executable, "main.py"], cwd=tmp_path, input=p.get("stdin", ""), capture_output=True,
                          text=True, timeout=120, env={**bwrap_env(), "TMPDIR": str(tmp_path)})


def last_line(text: str) -> str:
    return text.rstrip("\n").rpartition("\n")[2]


def exit_code(result: dict) -> int | None:
    if result.get("signal"):
        return -getattr(signal, result["signal"])
    return result.get("exit_code")


@pytest.mark.parametrize("p", PROGRAMS, ids=[p["name"] for p in PROGRAMS])
def test_sandbox_matches_python(p, sandboxed, tmp_path):
    results = sandboxed[p["name"]]
    last = results[-1]
    stdout = "".join(r["stdout"] for r in results)
    if "limit" in p:
        expect = p["expect"]
        assert last["status"] == expect["status"], (p["limit"], last)
        for key in ("exc_type", "stdout"):
            if key in expect:
                allowed = expect[key] if isinstance(expect[key], list) else [expect[key]]
                assert last[key] in allowed, (p["limit"], last)
        if "reason" in expect:
            assert expect["reason"] in (last["reason"] or ""), (p["limit"], last)
        if "stdout_marker" in expect:
            assert expect["stdout_marker"] in last["stdout"], last
        if p.get("python") == "stdout":
            py = run_python(p, tmp_path)
            head, _, tail = last["stdout"].partition("\n...[")
            tail = tail.partition("truncated]...\n")[2]
            assert py.stdout.startswith(head) and py.stdout.endswith(tail), (head[-200:], tail[:200])
        return
    assert not any(r["status"] in ("internal_error", "unavailable", "invalid_request") for r in results), results
    if "cells" in p:
        assert all(r["session"]["state"] in ("new", "live") for r in results), results
    py = run_python(p, tmp_path)
    assert stdout == py.stdout, (stdout, py.stdout, last)
    assert exit_code(last) == py.returncode, (last, py.returncode, py.stderr[-2000:])
    assert last_line(last["stderr"]) == last_line(py.stderr), (last["stderr"][-2000:], py.stderr[-2000:])
    assert (last["status"] == "ok") == (py.returncode == 0), last
