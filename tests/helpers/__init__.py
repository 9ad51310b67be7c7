"""What the tests share, reached one way: `from tests.helpers.<module> import ...` (pyproject's pytest `pythonpath`
puts the repository on sys.path; a worker script run in a subprocess gets it through PYTHONPATH).

    launching      a CI-sized tiny config, the CLI, what a finished run's directory says, the roles started by hand
    installing     the wheel of this tree installed into a fresh venv, its commands run outside any checkout
    rollout_run    the rollout's end-to-end set-ups: a model taught the tool format, published policies, a sandbox
    scripted       a scripted engine and fake tools for the agent loop
    sandbox_pools  sandbox pools with the tests' limits
    trainer        a tiny policy, its optimizer, configs and trainer runs, synthetic RL steps
    datafiles      users' data files in their layouts (verl rows, OpenAI chats; JSONL and Parquet)
    storage_fault  a small file system that fills up
    wandb_offline  the reader of W&B offline run files
    procfs         a process's environment from /proc
    interrupts     how a test session stops on SIGINT/SIGTERM/SIGHUP: fixtures torn down, leftover daemons swept
    *_worker.py, sync_engine.py, pause_engine.py   scripts the tests start as processes (trainer ranks, engines)
"""
