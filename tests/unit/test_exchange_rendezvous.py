import json
import os
import subprocess
import sys

import pytest

from rstar_hpc.exchange import rendezvous as rv


def test_announce_read_withdraw(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "118")
    rec = rv.announce(tmp_path, "sandbox", "node3-0", 8123, host="node3", capacity=64)
    path = tmp_path / "rendezvous" / "sandbox" / "node3-0.json"
    on_disk = json.loads(path.read_text())
    assert on_disk == rec
    assert set(rv.REQUIRED_KEYS) <= set(on_disk)
    assert on_disk["slurm_job_id"] == "118" and on_disk["capacity"] == 64 and on_disk["pid"] == os.getpid()
    rv.announce(tmp_path, "sandbox", "node4-0", 8124, host="node4")
    assert [r["name"] for r in rv.read_announcements(tmp_path, "sandbox")] == ["node3-0", "node4-0"]
    assert list(rv.read_roles(tmp_path)) == ["sandbox"]
    assert rv.withdraw(tmp_path, "sandbox", "node3-0") is True
    assert rv.withdraw(tmp_path, "sandbox", "node3-0") is False
    assert [r["name"] for r in rv.read_announcements(tmp_path, "sandbox")] == ["node4-0"]
    assert rv.read_announcements(tmp_path, "rollout") == []
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]   # no tmp left behind


def test_reannounce_is_heartbeat(tmp_path):
    first = rv.announce(tmp_path, "rollout", "rank0", 9000)
    second = rv.announce(tmp_path, "rollout", "rank0", 9000)
    assert second["started_at"] == first["started_at"]
    assert second["updated_at"] >= first["updated_at"]


def test_bad_input_named(tmp_path):
    with pytest.raises(ValueError, match="port"):
        rv.announce(tmp_path, "sandbox", "a", 0)
    with pytest.raises(ValueError, match="plain file name"):
        rv.announce(tmp_path, "sandbox", "../escape", 80)
    with pytest.raises(ValueError, match="overwrite required keys"):
        rv.announce(tmp_path, "sandbox", "a", 80, pid=1)
    bad = tmp_path / "rendezvous" / "sandbox" / "junk.json"
    bad.parent.mkdir(parents=True)
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="junk.json"):
        rv.read_announcements(tmp_path, "sandbox")


def test_wait_times_out_with_what_came(tmp_path):
    rv.announce(tmp_path, "sandbox", "only-one", 7000, host="h")
    assert len(rv.wait_for_announcements(tmp_path, "sandbox", 1, timeout_s=1)) == 1
    with pytest.raises(TimeoutError, match=r"got 1 \(only-one@h:7000\)"):
        rv.wait_for_announcements(tmp_path, "sandbox", 2, timeout_s=0.2, poll_s=0.05)


def test_import_is_stdlib_only():
    code = ("import sys, rstar_hpc.exchange.rendezvous; "
            "heavy = [m for m in ('pyarrow', 'numpy', 'pydantic', 'click', 'rich', 'yaml') if m in sys.modules]; "
            "print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
