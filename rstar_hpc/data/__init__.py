"""Reading users' data files as they are: prompt files (rl, hard_subset, eval) and chat files (sft).

    files    JSONL / Parquet rows, and DatasetError (what every reader raises; the CLI maps it to exit 3)
    answers  the ground truth of an answer cell: as given, GSM8K's `#### n`, the last \\boxed{} of a solution, or a
             refusal when the cell is a rationale with no final answer in it
    prompts  prompt files: the layout detected from the columns (verl, question/answer, GSM8K, MATH solutions),
             exact repeats dropped and counted
    chats    OpenAI-style chat files: tool_calls rendered in the rStar2 format, content parts joined
    sets     what a stage trains or evaluates on (`stages[].data`: a file, a demo set by name, "@<stage>"): the entry
             point the roles and `rstar-hpc data|config validate` call
    demo_task  the CPU demo's task family (arithmetic in four levels) and its built-in sets

Nothing here imports torch.
"""
