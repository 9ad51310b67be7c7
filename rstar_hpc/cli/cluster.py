"""`rstar-hpc cluster up|status|down`: an emulated multi-node Slurm cluster on this machine."""
from __future__ import annotations

import json
import sys

import click

from rstar_hpc.cli.exit_codes import EXIT_FAILED

_state_dir = click.option("--state-dir", type=click.Path(file_okay=False), default=None,
                          help="Where all of the cluster's state lives [$RSTAR_HPC_CLUSTER_DIR or ~/.rstar-hpc/cluster].")


@click.group("cluster")
def command() -> None:
    """An emulated multi-node Slurm cluster on this machine (real munged, slurmctld, one slurmd per node).

    Nodes gpu[1-N] (partition gpu: trainer, rollout) and cpu[1-M] (partition cpu: sandbox), all on
    localhost, or (--hosts) each its own host. Point Slurm clients at it with `source <state-dir>/env.sh` (sets SLURM_CONF).
    On a real cluster this command is not needed.
    """


@command.command("up")
@_state_dir
@click.option("--gpu-nodes", default=2, show_default=True, help="Nodes in partition gpu.")
@click.option("--cpu-nodes", default=2, show_default=True, help="Nodes in partition cpu.")
@click.option("--cpus-per-node", default=4, show_default=True, help="CPUs each node claims (may exceed the host's).")
@click.option("--gpus-per-node", default=0, show_default=True,
              help="Fake GPUs (GRES) of each gpu node; also binds tasks to cores (task/affinity). Needs root.")
@click.option("--hosts", is_flag=True,
              help="Each node its own host: a network namespace on a private bridge, its own hostname, /tmp and "
                   "/dev/shm (rstar_hpc/cluster/hosts.py). Needs root.")
@click.option("--shared", multiple=True, type=click.Path(file_okay=False),
              help="With --hosts: a directory under /tmp that stands for shared storage (a run root), the same on "
                   "every node. Repeatable; the state directory always is.")
def up(state_dir, gpu_nodes: int, cpu_nodes: int, cpus_per_node: int, gpus_per_node: int, hosts: bool,
       shared: tuple[str, ...]) -> None:
    """Start the cluster (a no-op if it is already up) and wait until every node is idle."""
    from rstar_hpc.cluster import ClusterError, ClusterSpec, LocalCluster

    if shared and not hosts:
        click.echo("--shared is for --hosts (without it every node sees the one /tmp)", err=True)
        sys.exit(EXIT_FAILED)
    cluster = LocalCluster(state_dir, ClusterSpec(num_gpu_nodes=gpu_nodes, num_cpu_nodes=cpu_nodes,
                                                  cpus_per_node=cpus_per_node, gpus_per_node=gpus_per_node,
                                                  hosts=hosts, shared=shared))
    try:
        cluster.up()
    except ClusterError as e:
        click.echo(f"cluster up failed: {e}", err=True)
        sys.exit(EXIT_FAILED)
    click.echo(f"cluster up: {', '.join(cluster.node_names)}\n  export SLURM_CONF={cluster.conf}")


@command.command("status")
@_state_dir
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def status(state_dir, as_json: bool) -> None:
    """Show the daemons this state directory started and the nodes Slurm reports; exit 1 if not up."""
    from rich.console import Console
    from rich.table import Table

    from rstar_hpc.cluster import LocalCluster

    cluster = LocalCluster(state_dir)
    info = cluster.status()
    healthy = cluster.is_up()
    if as_json:
        click.echo(json.dumps({**info, "up": healthy}, indent=2))
    else:
        console = Console()
        console.print(f"state dir {info['state_dir']}  ({'up' if healthy else 'DOWN'})")
        t = Table("daemon", "pid", "alive")
        for k, d in info["daemons"].items():
            t.add_row(k, str(d["pid"]), "yes" if d["alive"] else "[red]no[/red]")
        console.print(t)
        if info["nodes"]:
            t = Table("node", "partition", "state", "features", "cpus")
            for n, d in info["nodes"].items():
                t.add_row(n, d["partition"], d["state"], d["features"], str(d["cpus"]))
            console.print(t)
    sys.exit(0 if healthy else EXIT_FAILED)


@command.command("down")
@_state_dir
def down(state_dir) -> None:
    """Cancel the cluster's jobs and stop the daemons it started (by their recorded pids, nothing else)."""
    from rstar_hpc.cluster import LocalCluster

    stopped = LocalCluster(state_dir).down()
    click.echo(f"stopped {', '.join(stopped)}" if stopped else "nothing to stop")
