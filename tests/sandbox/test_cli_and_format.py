"""The CLI contract (`rstar-hpc sandbox exec`), the rStar2 renderer, request validation and config parity."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sandbox.limits import Limits
from sandbox.protocol import validate_call
from sandbox.results import make_result, render_rstar2, truncate_middle

REPO = Path(__file__).resolve().parents[2]


def cli(*args, stdin: str = "", timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "from rstar_hpc.cli import main; main()", "sandbox", *args],
                          input=stdin, capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})


def test_exec_local_pool_answers_every_line_in_order_and_survives_bad_lines():
    lines = [json.dumps({"id": "a", "code": "print(6*7)"}),
             "{this is not json",
             json.dumps({"id": "b", "code": 123}),
             json.dumps({"id": "c", "code": "x = 1", "session": "s"}),
             json.dumps({"id": "d", "code": "x + 1", "session": "s", "stdin": "", "timeout_s": 4}),
             json.dumps(["a", "list"]),
             json.dumps({"id": "e", "code": "import time\ntime.sleep(3)", "timeout_s": 0.3})]
    p = cli("exec", "--workers", "1", "--render", stdin="\n".join(lines) + "\n")
    assert p.returncode == 0, p.stderr
    out = [json.loads(line) for line in p.stdout.splitlines()]
    assert len(out) == 7
    for r in out:
        assert {"id", "status", "stdout", "stderr", "wall_s"} <= set(r)
    assert [r["status"] for r in out] == ["ok", "invalid_request", "invalid_request", "ok", "ok",
                                          "invalid_request", "timeout"]
    assert out[0]["id"] == "a" and out[0]["stdout"] == "42\n"
    assert "not JSON" in out[1]["reason"] and out[2]["id"] == "b"
    assert out[4]["stdout"] == "2\n"
    assert out[6]["text"].startswith("Tool call failure\nreason: worker_timeout")


def test_exec_against_a_running_service(tmp_path):
    serve = subprocess.Popen([sys.executable, "-c", "from rstar_hpc.cli import main; main()", "sandbox", "serve",
                              "--workers", "1", "--host", "127.0.0.1", "--run-dir", str(tmp_path), "--name", "n1"],
                             cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        ann = tmp_path / "rendezvous" / "sandbox" / "n1.json"
        for _ in range(600):
            if ann.exists() or serve.poll() is not None:
                break
            import time
            time.sleep(0.1)
        assert ann.exists(), serve.stderr.read() if serve.poll() is not None else "no announcement"
        rec = json.loads(ann.read_text())
        p = cli("exec", "--address", f"{rec['host']}:{rec['port']}",
                stdin=json.dumps({"id": 1, "code": "import numpy\nnumpy.arange(5).sum()"}) + "\nnope\n")
        out = [json.loads(line) for line in p.stdout.splitlines()]
        assert [r["status"] for r in out] == ["ok", "invalid_request"], p.stdout + p.stderr
        assert out[0]["stdout"] == "np.int64(10)\n"
        st = cli("stats", "--run-dir", str(tmp_path))
        assert json.loads(st.stdout)[f"{rec['host']}:{rec['port']}"]["calls"] == 1
    finally:
        serve.terminate()
        assert serve.wait(30) == 0   # SIGTERM is a clean shutdown
    assert not ann.exists()        # and withdraws the announcement


def test_render_success_matches_rstar2():
    r = make_result(1, "ok", stdout="4\n", wall_s=0.0123)
    assert render_rstar2(r) == "Tool call success\nstdout: 4\n\nexecution time: 0.01s"
    r = make_result(1, "ok", wall_s=1.5)
    assert render_rstar2(r) == "Tool call success\nexecution time: 1.50s"


def test_render_failures_match_rstar2():
    assert render_rstar2(make_result(1, "timeout", "wall", wall_s=4.0)) == \
        "Tool call failure\nreason: worker_timeout\nexecution time: 4.00s"
    err = make_result(1, "error", stderr="Traceback ...\nZeroDivisionError: division by zero\n", wall_s=0.01)
    assert render_rstar2(err).startswith("Tool call failure\nreason: \nstderr: Traceback")
    assert render_rstar2(make_result(1, "output_truncated", "output exceeded 10 bytes; killed")).startswith(
        "Tool call failure")


def test_render_middle_truncation_like_verl():
    text = render_rstar2(make_result(1, "ok", stdout="x" * 1000, wall_s=0.1), max_chars=256)
    assert len(text) == 256 + len("...(truncated)...")
    assert text.startswith("Tool call success") and text.endswith("execution time: 0.10s")
    assert truncate_middle("short", 256) == "short"


@pytest.mark.parametrize("obj,msg", [
    ({"code": "x" * 2_000_000}, "max_code_bytes"), ({"code": "1", "stdin": 5}, "stdin"),
    ({"code": "1", "timeout_s": 10_000}, "timeout_s"), ({"code": "1", "timeout_s": True}, "timeout_s"),
    ({"code": "1", "session": ""}, "session"), ({"code": "1", "session_seq": -1}, "session_seq"),
    ({"code": "a\x00b"}, "NUL"), ("just a string", "JSON object"), ({"code": "1", "extra": 1}, "unknown keys"),
])
def test_validation_rejects_with_a_message(obj, msg):
    call, bad = validate_call(obj, Limits())
    assert call is None and bad["status"] == "invalid_request" and msg in bad["reason"], bad


def test_config_section_mirrors_limits():
    from rstar_hpc.config.sandbox import SandboxConfig

    cfg_fields = set(SandboxConfig.model_fields) - {"stats_interval_s"}
    lim = Limits()
    internal = {"start_timeout_s", "hang_grace_s", "root_uid_base", "warmup"}   # operational, not run knobs
    assert cfg_fields == {f.name for f in dataclasses.fields(Limits)} - internal
    converted = SandboxConfig().to_limits()
    for name in cfg_fields:
        assert getattr(converted, name) == getattr(lim, name), name


def test_sandbox_package_never_imports_torch_or_vllm():
    code = ("import sys, sandbox, sandbox.pool, sandbox.server, sandbox.client, rstar_hpc.cli.sandbox\n"
            "bad = [m for m in ('torch', 'vllm', 'numpy', 'pydantic') if m in sys.modules]\nprint(bad)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert p.stdout.strip() == "[]", p.stdout + p.stderr
