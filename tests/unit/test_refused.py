"""A role that refuses its config or inputs (cli/exit_codes.Refused) exits 78, and neither launcher starts it again:
the sbatch supervisor stops the job without a requeue, a submitit RoleJob fails, its siblings stop; `run status` says
what to fix. Roles and launchers run here without Slurm (the real job: tests/integration)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from rstar_hpc.cli.exit_codes import EXIT_REFUSED, Refused, refusal, refusing
from rstar_hpc.config import ConfigError, dump_config, load_config
from rstar_hpc.data.files import DatasetError
from rstar_hpc.exchange.events import read_events
from rstar_hpc.exchange.rundir import RunPaths
from rstar_hpc.launch.record import add_launch

QWEN3 = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 1024, "hidden_size": 64,
         "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 16}
MISTRAL = {**QWEN3, "model_type": "mistral", "architectures": ["MistralForCausalLM"]}


def _model(tmp_path, config: dict):
    model = tmp_path / "Some-Model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(config))
    return model


def _role(tmp_path, *argv: str) -> tuple[subprocess.CompletedProcess, dict]:
    """`rstar-hpc ARGV` as a launcher starts it (RSTAR_RUN_DIR set); also whether it imported torch or vLLM."""
    code = ("import sys\nfrom rstar_hpc.cli import main\ntry:\n    main(sys.argv[1:])\nfinally:\n"
            "    print('heavy:', sorted(m for m in ('torch', 'vllm', 'megatron') if m in sys.modules))")
    env = {**os.environ, "RSTAR_RUN_DIR": str(tmp_path / "run")}
    r = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, env=env, timeout=120)
    return r, json.loads(RunPaths(tmp_path / "run").refusal(argv[0].replace("train", "trainer")).read_text())


@pytest.mark.parametrize("argv", [["train", "tiny-cpu", "--follow"], ["rollout", "--config", "tiny-cpu"],
                                  ["sandbox", "serve", "--config", "tiny-cpu"]])
def test_a_role_refuses_an_unknown_family_with_its_exit_code_before_importing_torch(tmp_path, argv):
    model = _model(tmp_path, MISTRAL)
    t0 = time.monotonic()
    r, found = _role(tmp_path, *argv, f"run.root={tmp_path}", "run.name=run", f"model.path={model}",
                     "model.tiny=null")
    assert r.returncode == EXIT_REFUSED, r.stderr[-2000:]
    assert time.monotonic() - t0 < 60
    assert "model_type='mistral'" in r.stderr and "not a model family rstar-hpc trains" in r.stderr
    assert "no restart can fix this" in r.stderr and "Traceback" not in r.stderr
    assert "heavy: []" in r.stdout
    assert "model_type='mistral'" in found["message"]   # what its launcher reads


def test_the_trainer_refuses_a_missing_model_on_every_rank_before_torch(tmp_path):
    model = _model(tmp_path, QWEN3)   # a config.json, no weights
    r, found = _role(tmp_path, "train", "tiny-cpu", f"run.root={tmp_path}", "run.name=run", f"model.path={model}",
                     "model.tiny=null", "--follow")
    assert r.returncode == EXIT_REFUSED and "heavy: []" in r.stdout, r.stderr[-2000:]
    assert "missing *.safetensors" in r.stderr and "missing *.safetensors" in found["message"]


def test_only_errors_of_inputs_are_refusals():
    for error in (ConfigError("model.path: x"), DatasetError("data.jsonl row 1: no answer"), FileNotFoundError("x")):
        with pytest.raises(Refused) as e, refusing("trainer"):
            raise error
        assert e.value.exit_code == EXIT_REFUSED and e.value.role == "trainer" and str(error) in e.value.message
    with pytest.raises(ValueError, match="a bug in a step"), refusing("trainer"):   # restarted, as before
        raise ValueError("a bug in a step")
    with pytest.raises(Refused), refusing("trainer", KeyError):
        raise KeyError("num_hidden_layers")


# -- the sbatch supervisor --------------------------------------------------------------------------------------

def _supervisor(tmp_path, monkeypatch, name="refused"):
    from rstar_hpc.launch import supervise

    cfg = load_config("tiny-cpu", [f"run.root={tmp_path}", f"run.name={name}"])
    paths = RunPaths(tmp_path / name)
    paths.create()
    sup = supervise.Supervisor(cfg, paths, {"trainer": 0, "rollout": 1, "sandbox": 2})
    monkeypatch.setattr(supervise, "lost_nodes", lambda nodelist: {})
    monkeypatch.setattr(sup, "start", lambda role: pytest.fail(f"{role} started again after it refused"))
    return sup, paths


def _saving_rollout(tmp_path):
    saved = tmp_path / "rollout-saved"
    proc = subprocess.Popen([sys.executable, "-c", "import signal, sys, time, pathlib\n"
                             f"def save(*a): pathlib.Path({str(saved)!r}).write_text('saved'); sys.exit(0)\n"
                             "signal.signal(signal.SIGTERM, save)\nprint('ready', flush=True)\ntime.sleep(60)"],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc, saved


def test_the_supervisor_stops_the_job_at_once_when_a_role_refuses(tmp_path, monkeypatch):
    """Exit 78: no restart, no crash counted, a `refused` event with the end of the role's log, the other roles told
    to save and stop (TERM, as when one fails too often), and the job ends 78 without `scontrol requeue`; run
    status names it as what to fix, until the run is launched again."""
    from rstar_hpc.launch import supervise
    from rstar_hpc.launch.status import run_status

    sup, paths = _supervisor(tmp_path, monkeypatch)
    rollout, saved = _saving_rollout(tmp_path)
    sup.procs["rollout"] = rollout
    log = paths.logs / "trainer-local.log"
    log.write_text("starting\nrstar-hpc trainer: refused: model.path: /m does not exist\n  no restart can fix this\n")
    sup.log_of["trainer"] = log
    sup.restart("trainer", EXIT_REFUSED)
    assert sup.refused == "trainer" and sup.restarts["trainer"] == 0
    assert sup.stop_reason == "trainer refused its config or inputs"
    assert rollout.wait(30) == 0 and saved.read_text() == "saved"
    events = read_events(paths)
    assert [(e["kind"], e["role"], e["exit"]) for e in events] == [("refused", "trainer", EXIT_REFUSED)]
    assert "model.path: /m does not exist" in events[0]["message"]
    with monkeypatch.context() as m:
        m.setenv("SLURM_JOB_ID", "7")
        m.setattr(supervise.subprocess, "run", lambda argv, **kw: pytest.fail(f"ran {argv}: no requeue"))
        assert sup.finish() == EXIT_REFUSED

    problems = run_status(sup.cfg, paths, with_slurm=False)["problems"]
    assert any(p.startswith("the trainer refused its config or inputs (exit 78): starting rstar-hpc trainer: "
                            "refused: model.path: /m does not exist") and "the run cannot go on until it is fixed"
               in p and f"`rstar-hpc launch {paths.config} [key=value ...]` continues it" in p for p in problems), \
        problems
    time.sleep(0.01)
    add_launch(paths, "sbatch", {"run": "8"})   # launched again, fixed: the refusal is history
    assert not [p for p in run_status(sup.cfg, paths, with_slurm=False)["problems"] if "refused" in p]


def test_a_refusal_srun_reports_as_a_signal_is_read_from_the_roles_record(tmp_path, monkeypatch):
    """srun reports a rank killed by --kill-on-bad-exit over the refusing rank's 78: the supervisor reads the
    refusal the rank recorded since the run's launch; one recorded before it (the run since fixed) is a crash."""
    sup, paths = _supervisor(tmp_path, monkeypatch)
    paths.refusal("trainer").parent.mkdir(parents=True, exist_ok=True)
    paths.refusal("trainer").write_text(json.dumps({"role": "trainer", "time": time.time() - 100,
                                                    "message": "model.path: old"}))
    add_launch(paths, "sbatch", {"run": "7"})
    assert refusal(paths, "trainer") is None
    started = []
    monkeypatch.setattr(sup, "start", started.append)
    monkeypatch.setattr(sup, "wait_unless_stopped", lambda seconds: False)
    sup.restart("trainer", 143)
    assert started == ["trainer"] and sup.refused is None   # a crash: started again
    paths.refusal("trainer").write_text(json.dumps({"role": "trainer", "time": time.time(),
                                                    "message": "invalid config: model_type='mistral'"}))
    monkeypatch.setattr(sup, "start", lambda role: pytest.fail(f"{role} started again after it refused"))
    monkeypatch.setattr(sup, "on_signal", lambda *a: None)
    sup.restart("trainer", 143)
    assert sup.refused == "trainer"
    assert [(e["kind"], e.get("message")) for e in read_events(paths)][-1] == \
        ("refused", "invalid config: model_type='mistral'")


def test_the_supervisor_refuses_a_config_it_cannot_load_and_does_not_requeue(tmp_path):
    model = _model(tmp_path, QWEN3)
    cfg = load_config("tiny-cpu", [f"run.root={tmp_path}", "run.name=bad", f"model.path={model}", "model.tiny=null"])
    paths = RunPaths(cfg.run.dir)
    paths.create()
    paths.config.write_text(dump_config(cfg))
    (model / "config.json").write_text(json.dumps(MISTRAL))   # changed since the launch checked it
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    r = subprocess.run([sys.executable, "-m", "rstar_hpc.launch.supervise", str(paths.dir)], capture_output=True,
                       text=True, env=env, timeout=120)
    assert r.returncode == EXIT_REFUSED, r.stderr[-2000:]
    assert [(e["kind"], e["role"]) for e in read_events(paths)] == [("refused", "supervisor")]


# -- the submitit RoleJob ---------------------------------------------------------------------------------------

def test_a_submitit_role_that_refuses_is_not_started_again(tmp_path, monkeypatch):
    """The RoleJob runs the real trainer command (one task: no srun): it refuses a model without weights before
    torch, exit 78; the RoleJob records it and fails the job (no restart, no requeue)."""
    from rstar_hpc.launch.submitit_launch import RoleJob

    model = _model(tmp_path, QWEN3)
    cfg = load_config("tiny-cpu", [f"run.root={tmp_path}", "run.name=sub", f"model.path={model}", "model.tiny=null",
                                   "launch.role_restarts=3"])
    paths = RunPaths(cfg.run.dir)
    paths.create()
    paths.config.write_text(dump_config(cfg))
    for var in ("SLURM_JOB_NODELIST", "SLURM_JOB_ID"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(RuntimeError, match=r"trainer refused to run \(exit 78\): model.path: .*\(missing "
                                           r"\*.safetensors"):
        RoleJob(str(paths.dir), "trainer")()
    assert [(e["kind"], e["role"], e["exit"]) for e in read_events(paths)] == [("refused", "trainer", 78)]


def test_submitit_roles_stop_when_another_refused(tmp_path, monkeypatch):
    """The rollout's and the sandbox's jobs see the trainer's refusal: a running role is ended (it saves on TERM)
    and not started again; one not started yet is not started."""
    from rstar_hpc.launch import submitit_launch
    from rstar_hpc.launch.submitit_launch import RoleJob

    cfg = load_config("tiny-cpu", [f"run.root={tmp_path}", "run.name=sib"])
    paths = RunPaths(cfg.run.dir)
    paths.create()
    paths.config.write_text(dump_config(cfg))
    job = RoleJob(str(paths.dir), "sandbox")
    job._child, saved = _saving_rollout(tmp_path)
    monkeypatch.setenv("RSTAR_RUN_DIR", str(paths.dir))
    Refused("trainer", "model.path: /m does not exist").record()
    code, hung = job._watch(cfg, paths, [sys.executable])
    assert code == 0 and hung is None and saved.read_text() == "saved" and job._stop
    monkeypatch.setattr(submitit_launch.subprocess, "Popen", lambda *a, **k: pytest.fail("started after a refusal"))
    assert RoleJob(str(paths.dir), "rollout")() == "rollout: stopped, the trainer refused its config or inputs"
