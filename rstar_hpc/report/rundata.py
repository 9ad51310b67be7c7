"""One run, loaded for the report: per-step series on the RL step axis (series.py), and its eval results."""
from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import dataclass, field

from rstar_hpc.eval.results import read_val_results
from rstar_hpc.exchange.rundir import RunPaths
from rstar_hpc.report.records import ReadCounts, iter_records
from rstar_hpc.report.series import ROLLOUT_KEYS, TRAINER_KEYS, derive

LABEL_ORDER = {"base": 0, "sft": 1, "rl": 2}


@dataclass
class RunData:
    label: str
    paths: RunPaths
    rl_stages: list[str] = field(default_factory=list)        # in run order
    offsets: dict[str, int] = field(default_factory=dict)     # x of a stage's step 0 on the RL step axis
    series: dict[str, list[tuple[int, float]]] = field(default_factory=dict)   # name -> [(x, value)], x ascending
    evals: list[dict] = field(default_factory=list)           # eval/<stage>/results.json objects, in run order
    validation: list[dict] = field(default_factory=list)      # eval/<stage>/val/step-*.json of each rl stage
    records: dict[str, int] = field(default_factory=dict)     # role -> records read
    notes: list[str] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not any(self.records.values()) and not self.evals

    def values(self, name: str) -> list[float]:
        return [v for _, v in self.series.get(name, [])]


def _config_stages(paths: RunPaths) -> tuple[list[dict], str | None]:
    """The resolved config's `stages` (name, kind, num_steps), and why it could not be read, if so."""
    if not paths.config.exists():
        return [], None
    try:
        import yaml

        stages = (yaml.safe_load(paths.config.read_text()) or {}).get("stages") or []
        return [s for s in stages if isinstance(s, dict) and isinstance(s.get("name"), str)], None
    except Exception as e:   # noqa: BLE001  (a broken config must not stop the report; the kinds are guessed)
        return [], f"{type(e).__name__}: {e}"


def _stream(paths: RunPaths, role: str, keys: dict[str, str], shift: int, run: RunData,
            by_step: dict[tuple[str, int], dict[str, float]], seen: list[str]) -> None:
    """Keep `keys` of each record by (stage, step + shift); a later record of a step wins (a requeued job redoes
    the steps after its last checkpoint)."""
    counts = ReadCounts()
    for rec in iter_records(paths.metrics(role), counts):
        stage, step = rec.get("stage"), rec.get("step")
        if not isinstance(stage, str) or not isinstance(step, int):
            continue
        if stage not in seen:
            seen.append(stage)
        values = {name: float(rec[key]) for name, key in keys.items()
                  if isinstance(rec.get(key), (int, float)) and math.isfinite(rec[key])}
        by_step[(stage, step + shift)].update(values)
        by_step[(stage, step + shift)].setdefault(f"_{role}", 1.0)
    run.records[role] = counts.records
    if counts.bad_lines:
        run.notes.append(f"{run.label}: skipped {counts.bad_lines} unreadable line(s) of metrics/{role}.jsonl "
                         f"(a killed job can leave a torn last line)")


def _rl_stages(config: list[dict], by_step: dict, seen: list[str], evals: list[str]) -> list[str]:
    if config:
        return [s["name"] for s in config if s.get("kind") == "rl"]
    # no config: RL stages are those whose trainer records carry a reward; else rollout stages that are not evals
    rewarded = [s for s in seen if any(st == s and "mean_reward" in v for (st, _), v in by_step.items())]
    return rewarded or [s for s in seen if s not in evals and any(st == s and "_rollout" in v
                                                                  for (st, _), v in by_step.items())]


def load_run(paths: RunPaths, label: str) -> RunData:
    run = RunData(label=label, paths=paths)
    config, error = _config_stages(paths)
    if error:
        run.notes.append(f"{label}: config.yaml unreadable ({error[:200]}); RL stages guessed from the metrics")
    by_step: dict[tuple[str, int], dict[str, float]] = defaultdict(dict)
    seen: list[str] = []
    _stream(paths, "trainer", TRAINER_KEYS, 0, run, by_step, seen)
    _stream(paths, "rollout", ROLLOUT_KEYS, 1, run, by_step, seen)
    run.evals = _evals(paths, config, run)
    run.records["eval"] = len(run.evals)
    run.rl_stages = _rl_stages(config, by_step, seen, [e["stage"] for e in run.evals])
    planned = {s["name"]: s.get("num_steps") for s in config}
    x0 = 0
    for stage in run.rl_stages:
        run.offsets[stage] = x0
        seen_max = max((st_step for (st, st_step) in by_step if st == stage), default=0)
        n = planned.get(stage)
        x0 += max(seen_max, n if isinstance(n, int) else 0)
    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for (stage, step), values in sorted(by_step.items(), key=lambda kv: (run.offsets.get(kv[0][0], -1), kv[0][1])):
        if stage not in run.offsets:
            continue
        for name, v in derive(values).items():
            if not name.startswith("_"):
                series[name].append((run.offsets[stage] + step, v))
    run.validation = [v for stage in run.rl_stages for v in read_val_results(paths, stage)]
    for v in run.validation:   # the mean over the validation files, on the RL step axis
        scores = [m["pass1"] for m in v["benchmarks"].values() if isinstance(m.get("pass1"), (int, float))]
        if scores:
            series["val_pass1"].append((run.offsets[v["stage"]] + v["step"], sum(scores) / len(scores)))
    run.series = {k: sorted(v) for k, v in series.items()}
    return run


def _evals(paths: RunPaths, config: list[dict], run: RunData) -> list[dict]:
    """results.json of every eval stage: base, sft, rl models, each in config order (else by trainer step)."""
    out = []
    for stage in paths.eval_stages():
        if (paths.eval_dir(stage) / "val").is_dir():   # an rl stage's validation passes, not an eval stage
            continue
        try:
            results = json.loads((paths.eval_dir(stage) / "results.json").read_text())
        except FileNotFoundError:
            run.notes.append(f"{run.label}: eval stage {stage} has no results.json yet")
            continue
        except (OSError, ValueError) as e:
            run.notes.append(f"{run.label}: eval/{stage}/results.json unreadable: {e}")
            continue
        if isinstance(results, dict) and isinstance(results.get("benchmarks"), dict):
            out.append({**results, "stage": results.get("stage") or stage})
    order = [s["name"] for s in config]

    def key(r: dict):
        policy = r.get("policy") or {}
        return (LABEL_ORDER.get(policy.get("label"), 3), order.index(r["stage"]) if r["stage"] in order else len(order),
                policy.get("trainer_step") or 0, r["stage"])

    return sorted(out, key=key)
