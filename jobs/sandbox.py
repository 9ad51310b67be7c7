"""Job entry: the sandbox service on one CPU node (see sbatch/sandbox.sbatch). Parse, build, run."""
import argparse
import logging
import os
import socket
import sys

# run as `python jobs/sandbox.py`, this file's directory heads sys.path and its name would shadow the
# `sandbox` package
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("config", nargs="?", default=None, help="run config (name in configs/ or YAML path)")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. sandbox.timeout_s=8")
    ap.add_argument("--run-dir", default=os.environ.get("RSTAR_RUN_DIR"), help="announce + stats here")
    ap.add_argument("--workers", type=int, default=None, help="sandboxes (default: config, else one per core)")
    ap.add_argument("--port", type=int, default=int(os.environ.get("RSTAR_SANDBOX_PORT", 0)))
    args = ap.parse_args()

    from sandbox.limits import Limits
    from sandbox.server import Service, run_loop

    stats_interval = 30.0
    if args.config or args.overrides:
        from rstar_hpc.config import load_config
        cfg = load_config(args.config or "tiny-cpu", args.overrides).sandbox
        limits, stats_interval = cfg.to_limits(), cfg.stats_interval_s
    else:
        limits = Limits()
    if args.workers:
        limits.num_workers = args.workers
    node = os.environ.get("SLURMD_NODENAME") or os.uname().nodename
    name = f"{node}-{os.environ.get('SLURM_JOB_ID', 'local')}-{os.environ.get('SLURM_PROCID', '0')}"
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {node} %(levelname)s %(name)s: %(message)s")
    # clients connect to the host name this node resolves as (SLURMD_NODENAME need not resolve)
    host = os.environ.get("RSTAR_SANDBOX_HOST") or socket.gethostname()
    service = Service(limits, port=args.port, run_dir=args.run_dir, name=name, announce_host=host,
                      stats_interval_s=stats_interval)
    run_loop(service.serve_forever())


if __name__ == "__main__":
    main()
