"""Synthetic SFT data for the CPU demo: "Compute A * B." solved with one Python tool call.

Each sample is one chat (JSONL line `{"messages": [...]}`) in the rStar2 format of `rstar_hpc.models.chat_format`:
system (with the tool schema) -> user problem -> assistant reasons and calls `print(A * B)` -> tool result ->
assistant `<answer>\\boxed{A*B}</answer>`. Every assistant turn starts with the `<reason>` the generation prompt
prefills. The numbers have 4 digits, too many for a tiny model to multiply in its head, so it must learn to use
the tool (and RL has room to improve it).

    python -m rstar_hpc.synthetic.sft_chats out.jsonl --num-samples 6000 --seed 0
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import click

from rstar_hpc.models import chat_format as fmt

OPENERS = ("We need to compute the product {a} * {b}.", "Multiply {a} by {b}.",
           "The task is {a} times {b}; use the tool to be exact.", "Let me compute {a} * {b} with Python.")


def tool_result(stdout: str) -> str:
    """The tool message a rollout shows for a program that printed `stdout` (one line): the sandbox's own
    rendering, so SFT traces and rollouts agree token for token."""
    from sandbox.results import render_rstar2

    return render_rstar2({"status": "ok", "stdout": f"{stdout}\n", "wall_s": 0.0})


def make_sample(rng: random.Random, *, digits: int = 4, system: str | None = None) -> dict:
    lo, hi = 10 ** (digits - 1), 10 ** digits - 1
    a, b = rng.randint(lo, hi), rng.randint(lo, hi)
    product = a * b
    return {
        "messages": [
            {"role": "system", "content": fmt.system_prompt() if system is None else system},
            {"role": "user", "content": f"{fmt.USER_PREFIX}Compute {a} * {b}."},
            {"role": "assistant",
             "content": f"<reason>{rng.choice(OPENERS).format(a=a, b=b)} {fmt.render_tool_call(f'print({a} * {b})')}"},
            {"role": "tool", "content": tool_result(str(product))},
            {"role": "assistant",
             "content": f"<reason>The tool printed {product}. </reason>\n<answer>\\boxed{{{product}}}</answer>"},
        ],
        "answer": str(product),
    }


def make_samples(num_samples: int, seed: int = 0, **kwargs) -> list[dict]:
    rng = random.Random(seed)
    return [make_sample(rng, **kwargs) for _ in range(num_samples)]


def write_jsonl(samples: list[dict], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        f.writelines(json.dumps(s) + "\n" for s in samples)
    return path


@click.command(help=__doc__.splitlines()[0])
@click.argument("out", type=click.Path(dir_okay=False))
@click.option("--num-samples", default=6000, show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option("--digits", default=4, show_default=True)
def main(out: str, num_samples: int, seed: int, digits: int) -> None:
    write_jsonl(make_samples(num_samples, seed, digits=digits), out)


if __name__ == "__main__":
    main()
