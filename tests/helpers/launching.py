"""Helpers of the launch tests: a CI-sized copy of configs/tiny-cpu.yaml, the CLI, what a finished run's directory
says (its data order, the trainer's cursors, commits, leftover processes), and the three roles started on their own
(no launcher) for the RL-loop tests."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
KINDS = ["sft", "rl", "rl", "hard_subset", "rl", "eval"]


def ci_config(tmp_path: Path, name: str, model_dir: Path, **launch) -> Path:
    """configs/tiny-cpu.yaml, on the session's tiny model, under tmp_path (its stages as they are: all six kinds)."""
    cfg = yaml.safe_load((REPO / "configs/tiny-cpu.yaml").read_text())
    cfg["run"] = {"name": name, "root": str(tmp_path / "runs"), "seed": 0}
    cfg["model"] = {"path": str(model_dir)}
    cfg["rollout"]["engine"]["kv_cache_memory_mb"] = 64
    cfg["launch"].update(launch)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def rstar(*args: str, env: dict, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "rstar_hpc", *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=REPO)
    if check:
        assert proc.returncode == 0, f"rstar-hpc {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-4000:]}"
    return proc


def status(run: Path, env: dict) -> dict:
    return json.loads(rstar("run", "status", str(run), "--json", env=env).stdout.splitlines()[-1])


def run_facts(run: Path) -> dict:
    """What a finished run has done, from its run directory: prompt uids of each rollout step (its data order),
    the trainer's final step and trajectory cursor of each trainer stage."""
    from rstar_hpc.config import load_config
    from rstar_hpc.exchange.columns import from_table
    from rstar_hpc.exchange.reader import StepReader, consumer_cursors
    from rstar_hpc.exchange.rundir import RunPaths
    from rstar_hpc.exchange.state import read_stage_state

    paths = RunPaths(run)
    cfg = load_config(str(paths.config))
    facts = {"uids": {}, "trainer": {}, "commits": {}}
    for s in cfg.stages:
        state = read_stage_state(paths, s.name)
        assert state.status == "DONE", f"{s.name}: {state}"
        if s.kind in ("sft", "rl"):
            facts["trainer"][s.name] = (state.step, state.data_cursor, consumer_cursors(paths, s.name))
        if s.kind == "sft":
            continue
        reader = StepReader(paths, s.name)
        for step in paths.traj_steps(s.name):
            commits = reader.commits(step)
            facts["commits"][(s.name, step)] = sorted(commits)
            facts["uids"][(s.name, step)] = sorted(t.prompt_uid for t in from_table(reader.read(step, ["rollout"])))
    return facts


def assert_steps_hold_their_prompts(run: Path, stage: str, steps: int) -> None:
    """Every step of `stage` holds exactly the prompts its data order gives it (stage_steps), none twice."""
    from transformers import AutoTokenizer

    from rstar_hpc.config import load_config
    from rstar_hpc.exchange.columns import from_table
    from rstar_hpc.exchange.reader import StepReader
    from rstar_hpc.exchange.rundir import RunPaths
    from rstar_hpc.rollout.tasks import stage_steps

    paths = RunPaths(run)
    cfg = load_config(str(run / "config.yaml"))
    expected = {t.step: sorted(i.prompt_uid for i in t.items)
                for t in stage_steps(cfg, paths, stage, AutoTokenizer.from_pretrained(cfg.model.path),
                                     steps=range(steps))}
    reader = StepReader(paths, stage)
    for s in range(steps):
        trajs = from_table(reader.read(s, ["rollout"]))
        assert sorted(t.prompt_uid for t in trajs) == expected[s] and len({t.key for t in trajs}) == len(trajs), s


def leftover_processes(run: Path) -> list[str]:
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout.splitlines()
    return [line for line in out if str(run) in line and "ps -eo" not in line]


def run_processes(run: Path) -> list[str]:
    """Every process whose command line or environment names the run directory: the batch step's supervisor, the
    role steps' tasks, and whatever they started (a vLLM engine core, a sandbox's children) even when its own
    command line does not say which run it serves (every job step inherits RSTAR_RUN_DIR)."""
    found, key = [], str(run).encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline, environ = (proc / "cmdline").read_bytes(), (proc / "environ").read_bytes()
        except OSError:   # gone meanwhile, or a kernel thread
            continue
        if key in cmdline or key in environ:
            args = cmdline.replace(b"\0", b" ").decode(errors="replace")
            found.append(f"{proc.name} {args[:300]}")
    return found


def check_finished(run: Path, env: dict) -> dict:
    st = status(run, env)
    assert [s["kind"] for s in st["stages"]] == KINDS
    assert [s["state"] for s in st["stages"]] == ["done"] * 6, st["stages"]
    assert all(s["step"] == s["steps"] for s in st["stages"]), st["stages"]
    assert st["done"] and not st["problems"], st["problems"]
    evals = [s for s in st["stages"] if s["kind"] == "eval"]
    assert "demo" in evals[0]["pass1"] and 0.0 <= evals[0]["pass1"]["demo"]["pass1"] <= 1.0
    results = json.loads((run / "eval" / "eval" / "results.json").read_text())
    assert results["policy"]["label"] == "rl" and results["k"] == 4
    stats = json.loads((run / "data" / "hard.stats.json").read_text())
    assert stats["prompts"] == 8 and sum(stats["solved_k_of_n"].values()) == 8
    facts = run_facts(run)
    for (stage, step), commits in facts["commits"].items():
        assert commits == ["rollout"], (stage, step, commits)   # one final commit per step, nothing else left
    deadline = time.monotonic() + 30   # the job's last processes go as Slurm reaps the steps
    while leftover_processes(run) and time.monotonic() < deadline:
        time.sleep(1)
    assert not leftover_processes(run)
    return facts


def _tail(run: Path) -> str:
    logs = sorted((run / "logs").glob("*")) if (run / "logs").is_dir() else []
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}" for p in logs if p.is_file())


def loop_config(tmp_path: Path, name: str, model_dir: Path) -> dict:
    """configs/tiny-cpu.yaml as a fast RL loop on the session's tiny model (short responses, 4 samples a prompt, every
    group kept: the tiny random model rarely earns a reward, and the loop, not learning, is under test); the caller
    sets its stages and knobs, then `run_roles` writes it."""
    cfg = yaml.safe_load((REPO / "configs/tiny-cpu.yaml").read_text())
    cfg["run"] = {"name": name, "root": str(tmp_path / "runs"), "seed": 0}
    cfg["model"] = {"path": str(model_dir)}
    cfg["rollout"]["engine"]["kv_cache_memory_mb"] = 16
    cfg["rollout"]["agent"].update(max_response_length=48)
    cfg["rollout"]["scheduler"].update(heartbeat_s=0.5, policy_wait_s=300)
    cfg["algo"]["num_samples_per_prompt"] = 4
    cfg["algo"]["roc"] = {"reject_equal_reward": False, "down_sample_to_n": 0}
    cfg["trainer"].update(micro_batch_tokens=1024, trajectory_timeout_s=300)
    return cfg


def run_roles(tmp_path: Path, cfg: dict, trainer: list[str], rollout: list[str], env: dict | None = None) -> str:
    """Write `cfg`, then start a sandbox service, `rstar-hpc train CONFIG *trainer` and `rstar-hpc rollout --config
    CONFIG *rollout` at once, as users run the roles by hand: they meet only through the run directory. Returns the
    rollout's stdout once both ended with 0 (each role's log is tmp_path/<role>.log); every role is stopped either
    way."""
    import pytest

    name = cfg["run"]["name"]
    path, run = tmp_path / f"{name}.yaml", tmp_path / "runs" / name
    path.write_text(yaml.safe_dump(cfg))
    cli = [sys.executable, "-m", "rstar_hpc"]
    logs = {role: open(tmp_path / f"{role}.log", "w") for role in ("sandbox", "trainer", "rollout")}  # noqa: SIM115
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **(env or {})}

    def tail(role: str) -> str:
        return (tmp_path / f"{role}.log").read_text()[-4000:]

    procs = {"sandbox": subprocess.Popen([*cli, "sandbox", "serve", "--workers", "1", "--run-dir", str(run), "--host",
                                          "127.0.0.1"], cwd=REPO, env=env, stdout=logs["sandbox"],
                                         stderr=subprocess.STDOUT)}
    try:
        procs["trainer"] = subprocess.Popen([*cli, "train", str(path), *trainer], cwd=REPO, env=env,
                                            stdout=logs["trainer"], stderr=subprocess.STDOUT)
        procs["rollout"] = subprocess.Popen([*cli, "rollout", "--config", str(path), *rollout], cwd=REPO, env=env,
                                            stdout=subprocess.PIPE, stderr=logs["rollout"], text=True)
        try:
            out, _ = procs["rollout"].communicate(timeout=600)
        except subprocess.TimeoutExpired:
            pytest.fail("the rollout did not finish:\n" + tail("rollout") + "\n--- trainer\n" + tail("trainer"))
        assert procs["rollout"].returncode == 0, tail("rollout")
        assert procs["trainer"].wait(timeout=300) == 0, tail("trainer")
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
        for f in logs.values():
            f.close()
    return out


def wait_rl_step(run: Path, phase: str, steps: range, what: str) -> int:
    """The rl step (one of `steps`) whose rollout heartbeat now reads "step N of stage rl: <phase>..." (a regex):
    "generating, 0/" as a step's work reaches the engines, "starting 2 engine\\(s\\), 0 ready" while they load."""
    import re

    deadline = time.monotonic() + 600
    while True:
        try:
            doing = json.loads((run / "heartbeat" / "rollout.json").read_text()).get("doing", "")
        except (FileNotFoundError, json.JSONDecodeError):
            doing = ""
        m = re.match(rf"step (\d+) of stage rl: {phase}", doing)
        if m and int(m.group(1)) in steps:
            return int(m.group(1))
        assert time.monotonic() < deadline, f"no rl step was seen {what}\n" + _tail(run)
        time.sleep(0.02)


def engine_core(rank_pid: int) -> int:
    """The vLLM engine core process an engine rank started (its process title names it)."""
    import psutil

    for child in psutil.Process(rank_pid).children(recursive=True):
        try:
            if "EngineCore" in child.name() + " ".join(child.cmdline()):
                return child.pid
        except psutil.NoSuchProcess:
            continue
    raise AssertionError(f"no vLLM EngineCore process under engine rank pid {rank_pid}")
