"""Synthetic data made on the fly, for the tests, the benches and scripts/gpu_check.py (no model, no download):

    sft_chats     "Compute A * B." chats solved with one tool call (the trainer's tests and bench; a demo-size SFT
                  file: `python -m rstar_hpc.synthetic.sft_chats FILE`)
    trajectories  paper-shaped RL trajectory steps, every tool status included (the exchange's tests and bench)

Outside the contract (rstar_hpc/exchange/), which every role imports: no role needs these to run. The CPU demo's
own task family is stage data: rstar_hpc/data/demo_task.py.
"""
