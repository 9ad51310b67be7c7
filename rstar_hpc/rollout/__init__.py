"""The rollout role: an MPI job whose rank 0 schedules and ranks 1..N each own one vLLM engine.

    job.py          the role's job: run(cfg, stage, steps) on every rank, called by `rstar-hpc rollout`
    scheduler.py    rank 0 of a step as named stages: admit, dispatch, collect, commit, publish metrics
    engine_rank.py  ranks 1..N of a step: agent loops on the engine, heartbeats, results
    mpi.py          the messages between them, in the order of a step: one tag each, listed in one table
    messages.py     TrajectoryResult: the one typed trajectory message, engine rank -> rank 0's Scorer
    step.py         what a step is: work items, stage limits, the policy it waits for, seeds, scoring
    admission.py    admission: where a trajectory runs (KV-aware, sibling-aware, static), shared with
                    bench/rollout_balance.py
    levers.py       rank 0's long-tail levers: turn-boundary migration, partial rollouts (docs/rollout-long-tail.md)
    carry.py        partial rollouts' carry: what a closed step hands to the next, persisted before the commit
    agent.py        the multi-turn agent loop in the rStar2 format (generate, tool calls, tool responses)
    engine.py       VLLMEngine: token ids in, ids and logprobs out, policies loaded in place
    engine_args.py  vLLM engine arguments from the rollout.engine section
    generate.py     single-turn sampling (`rstar-hpc generate`, the demo's job)
"""
