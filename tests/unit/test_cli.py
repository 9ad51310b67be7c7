"""The CLI is a verb table: pinned, lazily imported, and every verb and subcommand describes itself."""
from __future__ import annotations

import subprocess
import sys

import click
import pytest
from click.testing import CliRunner

from rstar_hpc.cli import VERBS, cli

PINNED_VERBS = ["demo", "launch", "doctor", "cluster", "config", "data", "make-tiny-model", "generate", "train", "trainer", "plan", "rollout", "sandbox", "traj", "run", "report", "eval", "export"]


def test_verb_list_is_pinned():
    # growing the CLI is a reviewed change: update this list with the verb table
    assert list(VERBS) == PINNED_VERBS


def _all_commands():
    runner_ctx = click.Context(cli)
    for name in VERBS:
        cmd = cli.get_command(runner_ctx, name)
        yield [name], cmd
        if isinstance(cmd, click.Group):
            for sub in cmd.list_commands(runner_ctx):
                yield [name, sub], cmd.get_command(runner_ctx, sub)


@pytest.mark.parametrize("path", [p for p, _ in _all_commands()], ids=lambda p: " ".join(p))
def test_every_command_has_help(path):
    result = CliRunner().invoke(cli, [*path, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage: " in result.output
    cmd = dict((tuple(p), c) for p, c in _all_commands())[tuple(path)]
    summary = (cmd.help or "").strip()
    assert len(summary) > 20, f"{' '.join(path)} has no real description"
    assert summary.split("\n")[0][:30] in " ".join(result.output.split())


def test_top_level_help_lists_verbs_without_importing_heavy_modules():
    code = ("import sys; from rstar_hpc.cli import main\n"
            "try: main(['--help'])\nexcept SystemExit: pass\n"
            "heavy = [m for m in ('torch', 'vllm', 'megatron', 'transformers') if m in sys.modules]\n"
            "print('HEAVY', heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout
    for verb in VERBS:
        assert verb in out
    assert "HEAVY []" in out


def test_typo_suggests_the_nearest_verb():
    result = subprocess.run([sys.executable, "-m", "rstar_hpc", "doctr"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "Did you mean 'doctor'?" in result.stderr


def test_bad_config_exits_3_naming_the_key():
    result = subprocess.run([sys.executable, "-m", "rstar_hpc", "config", "validate", "tiny-cpu", "rollout.agent.x=1"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 3
    assert "rollout.agent.x: unknown key" in result.stderr
