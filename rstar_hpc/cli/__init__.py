"""The `rstar-hpc` command: a verb table, each verb a module of this package imported only when used,
so `rstar-hpc --help` stays fast and never imports torch or vLLM.

Adding a verb: write `rstar_hpc/cli/<verb>.py` exposing a click command named `command`, and add one
line to VERBS. tests/unit/test_cli.py pins the verb list, so growth is a reviewed diff.
"""
from __future__ import annotations

import difflib
import importlib
import sys

import click

from rstar_hpc import __version__
from rstar_hpc.cli.exit_codes import EXIT_CONFIG, EXIT_USAGE, Refused

# verb -> (module under rstar_hpc.cli, one-line summary shown by --help)
VERBS: dict[str, tuple[str, str]] = {
    "demo": ("demo", "The rStar2 recipe in miniature through launch on the local cluster (SFT, RL modes, report)."),
    "launch": ("launch", "Submit a whole run (every stage of a config) as one Slurm job; --wait follows it."),
    "doctor": ("doctor", "Preflight a node or login host: bwrap, Slurm, MPI, vLLM, GPUs, run dir, offline."),
    "cluster": ("cluster", "Bring up, inspect or stop an emulated multi-node Slurm cluster on this machine."),
    "config": ("config", "Show, validate and explain run configs (YAML + dotted overrides)."),
    "data": ("data", "Show how a data file is read (layout, drops, rows normalised) or check it (exit 0 or 3)."),
    "make-tiny-model": ("make_tiny_model", "Build a random-init Qwen3, Qwen2 or Llama model + BPE tokenizer."),
    "generate": ("generate", "Generate from prompts with the policy in vLLM (sbatch/generate.sbatch)."),
    "train": ("train", "The trainer role (SFT, GRPO-RoC RL) with Megatron-core; --follow walks every stage; --plan "
                       "its per-GPU memory plan, no GPU needed."),
    "trainer": ("trainer", "Deprecated: `train CONFIG --plan` (the trainer's per-GPU memory plan)."),
    "plan": ("plan", "Plan a run's RL steps: step time, GPU-hours, idle GPUs, on-policy vs overlap, node split."),
    "rollout": ("rollout", "The rollout role: vLLM engine ranks over MPI, agent loop, sandbox calls; walks its stages."),
    "sandbox": ("sandbox", "Run or call the bubblewrap Python sandbox service."),
    "traj": ("traj", "List, show and export trajectory shards of a run."),
    "run": ("run", "Follow a run: status (stages, steps, ETA, jobs, health), logs, cancel."),
    "report": ("report", "Render a run's report (md, html, PNG plots; runs compared); TensorBoard: RUN/tb."),
    "eval": ("eval", "Evaluate a policy on benchmark files the paper's way (avg@k pass@1, pass@k, maj@k, ...)."),
    "export": ("export", "A trainer checkpoint as a Hugging Face model: safetensors, training chat template, sampling."),
}


class VerbGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(VERBS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in VERBS:
            return None
        module = importlib.import_module(f"rstar_hpc.cli.{VERBS[name][0]}")
        return module.command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # summaries come from the table, so listing verbs imports none of them
        with formatter.section("Commands"):
            formatter.write_dl([(name, summary) for name, (_, summary) in VERBS.items()])

    def resolve_command(self, ctx: click.Context, args: list[str]):
        name = args[0] if args else ""
        if name and not name.startswith("-") and name not in VERBS:
            near = difflib.get_close_matches(name, list(VERBS), n=1)
            hint = f" Did you mean {near[0]!r}?" if near else ""
            ctx.fail(f"no verb {name!r}.{hint} Verbs: {', '.join(VERBS)}")
        return super().resolve_command(ctx, args)


@click.group(cls=VerbGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="rstar-hpc")
def cli() -> None:
    """rstar-hpc: rStar2-Agent (agentic RL with GRPO-RoC) as Slurm batch jobs.

    Roles: trainer (Megatron-core, GPU nodes), rollout (vLLM engine ranks, GPU nodes), sandbox
    (bubblewrap Python pools, CPU nodes); they meet through files in the run directory on shared storage.
    """


def main(argv: list[str] | None = None) -> None:
    from rstar_hpc.config import ConfigError
    from rstar_hpc.data.sets import DatasetError

    if argv is None:   # the program (not a test calling it in-process): torch's kernel cache goes when it exits
        from rstar_hpc.scratch import private_torch_cache
        private_torch_cache()
    try:
        cli.main(args=argv, prog_name="rstar-hpc", standalone_mode=False)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except Refused as e:
        e.show()
        e.record()
        sys.exit(e.exit_code)
    except click.ClickException as e:
        e.show()
        sys.exit(EXIT_USAGE if isinstance(e, click.UsageError) else e.exit_code)
    except click.Abort:
        sys.exit(130)
    except (ConfigError, DatasetError) as e:
        click.echo(f"rstar-hpc: {e}", err=True)
        sys.exit(EXIT_CONFIG)
