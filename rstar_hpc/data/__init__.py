"""Reading users' data files as they are: prompt files (rl, hard_subset, eval) and chat files (sft).

    files    JSONL / Parquet rows, and DatasetError (what every reader raises; the CLI maps it to exit 3)
    answers  the ground truth of an answer cell: as given, GSM8K's `#### n`, the last \\boxed{} of a solution, or a
             refusal when the cell is a rationale with no final answer in it
    prompts  prompt files: the layout detected from the columns (verl, question/answer, GSM8K, MATH solutions),
             exact repeats dropped and counted
    chats    OpenAI-style chat files: tool_calls rendered in the rStar2 format, content parts joined

rstar_hpc.datasets is the entry point the roles and `rstar-hpc data|config validate` call (stage data, the demo
sets); it reads files through this package. Nothing here imports torch.
"""
