"""The cluster of hosts (`rstar-hpc cluster up --hosts`, rstar_hpc/cluster/hosts.py): each node a network, a hostname,
a /tmp and a /dev/shm of its own, shared storage the same on every node; a sandbox on one node answers a client on
another by the name it announced; `down` leaves no namespace, link or mount of its own, also after the daemons
crashed. The shared all-stage run (tests/integration/conftest.py sbatch_run) runs on it with its rollout on two
hosts (test_launch.py checks that the engines joined across the bridge)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from tests.helpers.procfs import running

pytestmark = [pytest.mark.slurm]
NODE_VIEW = 'echo "$(hostname) $(readlink /proc/self/ns/net) $(ip -4 -o addr show eth0 | tr -s " " | cut -d" " -f4)"'


def _srun(cluster, *argv: str, timeout: float = 120) -> str:
    proc = subprocess.run(["srun", *argv], env=cluster.env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_every_node_is_a_host_of_its_own(hosts_cluster, tmp_path):
    c = hosts_cluster
    rows = [line.split() for line in _srun(c, "-N3", "-p", "gpu", "sh", "-c", NODE_VIEW).splitlines()]
    assert sorted(r[0] for r in rows) == ["gpu1", "gpu2", "gpu3"], rows
    assert len({r[1] for r in rows}) == 3 and os.readlink("/proc/self/ns/net") not in {r[1] for r in rows}, rows
    assert len({r[2] for r in rows}) == 3 and all(r[2].startswith("198.1") for r in rows), rows
    # /tmp and /dev/shm are the node's own; shared storage (here pytest's folders) is everyone's
    name = f"rstar-hosts-{os.getpid()}"
    _srun(c, "-w", "gpu1", "sh", "-c", f"echo mine > /tmp/{name}; echo mine > /dev/shm/{name}; "
                                        f"echo ours > {tmp_path}/{name}")
    seen = _srun(c, "-w", "gpu2", "sh", "-c", f"ls /tmp/{name} /dev/shm/{name} 2>&1; cat {tmp_path}/{name}")
    assert seen.count("No such file") == 2 and "ours" in seen, seen
    assert not Path(f"/tmp/{name}").exists() and (tmp_path / name).read_text() == "ours\n"
    # nothing routes out: the bridge's subnet and the host's own addresses only
    routes = _srun(c, "-w", "gpu3", "ip", "-4", "route").splitlines()
    assert routes and not [r for r in routes if r.startswith("default")], routes
    names = _srun(c, "-w", "gpu1", "getent", "hosts", "gpu2", "cpu1").split()
    assert "gpu2" in names and "cpu1" in names, names


def test_a_sandbox_answers_across_the_bridge_by_the_name_it_announced(hosts_cluster, tmp_path):
    c, run = hosts_cluster, tmp_path / "run"
    run.mkdir()
    service = subprocess.Popen(["srun", "-p", "cpu", "-w", "cpu1", sys.executable, "-m", "rstar_hpc", "sandbox",
                                "serve", "--run-dir", str(run), "--workers", "1"], env=c.env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (found := list(run.glob("rendezvous/sandbox/*.json"))):
            assert service.poll() is None and time.monotonic() < deadline, service.stdout.read()[-2000:]
            time.sleep(0.5)
        [announced] = [json.loads(p.read_text()) for p in found]
        assert announced["host"] == "cpu1", announced
        code = ("import asyncio, sandbox.client as c\n"
                "async def go():\n"
                f"    async with c.SandboxClient(run_dir={str(run)!r}) as cl:\n"
                "        print((await cl.run('print(6 * 7)'))['stdout'], end='')\n"
                "asyncio.run(go())")
        assert _srun(c, "-p", "gpu", "-w", "gpu1", sys.executable, "-c", code).strip() == "42"
    finally:
        service.send_signal(signal.SIGTERM)
        try:
            service.wait(30)
        except subprocess.TimeoutExpired:
            service.kill()


def _leftovers(tag: str, state: Path, host_tmp: Path) -> list[str]:
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    mounts = Path("/proc/mounts").read_text()
    return ([f"netns {line}" for line in netns.splitlines() if tag[2:] in line]
            + [f"link {line}" for line in links.splitlines() if tag in line]
            + [f"mount {line}" for line in mounts.splitlines() if str(state) in line or str(host_tmp) in line]
            + ([str(host_tmp)] if host_tmp.exists() else []))


@pytest.mark.timeout(300)
def test_down_leaves_nothing_of_its_own_even_after_the_daemons_crashed():
    from rstar_hpc.cluster import ClusterSpec, LocalCluster

    if os.geteuid() != 0:
        pytest.skip("a cluster of hosts needs root (network namespaces)")
    state = Path(tempfile.mkdtemp(prefix="rstar-hd-", dir="/tmp"))
    cluster = LocalCluster(state, ClusterSpec(num_gpu_nodes=1, num_cpu_nodes=1, hosts=True)).up()
    hosts = cluster.hosts
    try:
        assert len(_leftovers(hosts.tag, state, hosts.host_tmp)) >= 3   # two namespaces, their links, the bridge
        for pid in cluster._recorded().values():   # the daemons crash: what they made stays behind
            os.kill(pid, signal.SIGKILL)
        again = LocalCluster(state)   # its shape from cluster.json; `up` removes the leftovers and starts clean
        assert again.spec.hosts and not again.is_up()
        again.up()
        assert again.is_up()
    finally:
        stopped = LocalCluster(state).down()
    assert any(s.startswith("netns ") for s in stopped), stopped
    assert not _leftovers(hosts.tag, state, hosts.host_tmp), _leftovers(hosts.tag, state, hosts.host_tmp)
    shutil.rmtree(state)   # its state dir, the one thing down keeps (logs for a post-mortem)


def test_hosts_without_root_is_refused_and_says_how(tmp_path, monkeypatch):
    from rstar_hpc.cluster.hosts import HostsError, NodeHosts

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(HostsError, match=r"needs root.*plain cluster"):
        NodeHosts(tmp_path, ["gpu1"]).up()


def test_the_rollout_talks_over_the_interface_of_the_nodes_slurm_address(hosts_cluster, monkeypatch):
    """launch.mpi.interfaces empty: on a node the interface holding its NodeAddr (Open MPI's btl and oob are told);
    set: what it says; a loopback NodeAddr (the plain cluster: every node one host): Open MPI's own choice."""
    from rstar_hpc.rollout import links

    code = ("from rstar_hpc.rollout.links import mpi_env, node_interfaces, Session; from pathlib import Path; "
            "i = node_interfaces([]); e = mpi_env(Session(Path('/x'), 0, 2), i); "
            "print(i, e['OMPI_MCA_btl_tcp_if_include'], e['OMPI_MCA_oob_tcp_if_include'], node_interfaces(['ib0']))")
    assert _srun(hosts_cluster, "-w", "gpu2", sys.executable, "-c", code).split() == ["['eth0']", "eth0", "eth0",
                                                                                       "['ib0']"]
    monkeypatch.setattr(links, "_slurm_node_addr", lambda node: "127.0.0.1")
    assert links.node_interfaces([], {"SLURMD_NODENAME": "gpu1"}) == []
    assert "OMPI_MCA_btl_tcp_if_include" not in links.mpi_env(links.Session(Path("/x"), 0, 2), [])


def test_a_lost_node_takes_every_process_on_it_and_comes_back_with_a_fresh_tmp(hosts_cluster):
    """lose_node on a cluster of hosts: slurmd and everything in the node's namespace die, also a process that left
    its step's tree (setsid, reparented); the other nodes' processes run on; start_node brings the node back in
    service, its /tmp empty as after a reboot."""
    c, mark = hosts_cluster, f"rstar-lost-{os.getpid()}"
    detach = f"echo x > /tmp/{mark}; setsid bash -c 'exec -a {mark} sleep 600' </dev/null >/dev/null 2>&1 &"
    _srun(c, "-w", "gpu3", "sh", "-c", detach)
    _srun(c, "-w", "gpu2", "sh", "-c", detach)

    def sleepers() -> dict[str, int]:   # node -> pid of the marked sleep there
        marked = set()
        for proc in Path("/proc").iterdir():
            try:
                if proc.name.isdigit() and (proc / "cmdline").read_bytes().split(b"\0")[0] == mark.encode():
                    marked.add(int(proc.name))
            except OSError:
                continue
        return {node: pid for node in ("gpu2", "gpu3") for pid in marked & set(c.hosts.pids(node))}

    deadline = time.monotonic() + 30
    while len(sleepers()) < 2:
        assert time.monotonic() < deadline, sleepers()
        time.sleep(0.2)
    survivor, lost = sleepers()["gpu2"], sleepers()["gpu3"]
    slurmd = c._recorded()["slurmd:gpu3"]
    try:
        killed = c.lose_node("gpu3")
        assert killed[0] == slurmd and lost in killed, killed
        left, survived = c.hosts.pids("gpu3"), running(survivor)
    finally:   # the node back whatever happened: the session's other tests live on this cluster
        c.start_node("gpu3")
        os.kill(survivor, signal.SIGKILL)
    assert not left, left
    assert survived, "a process of another node died with the lost one"
    seen = _srun(c, "-w", "gpu3", "sh", "-c", f"hostname; ls /tmp/{mark} 2>&1 || true")
    assert seen.startswith("gpu3\n") and "No such file" in seen, seen
    assert not running(lost), "a process of the lost node lived on"


def _rl_config(tmp_path, model_dir, rl_steps: int) -> str:
    """tiny-cpu cut to a short sft and one rl stage, its rollout on two hosts (rank 0 and engine 1 on one, engine 2
    on the other), engines found silent after 20 s."""
    import yaml
    from tests.helpers.launching import ci_config

    path = ci_config(tmp_path, "cut", model_dir)
    cfg = yaml.safe_load(path.read_text())
    cfg["stages"] = [{"name": "sft", "kind": "sft", "num_steps": 2, "prompts_per_step": 8, "lr": 2.0e-3,
                      "data": "demo"},
                     {"name": "rl", "kind": "rl", "num_steps": rl_steps, "prompts_per_step": 4,
                      "max_response_length": 128, "data": "demo"}]
    cfg["rollout"]["scheduler"].update(heartbeat_s=0.5, engine_timeout_s=20, journal_every_s=0.3)
    cfg["launch"]["rollout"].update(num_nodes=2, tasks_per_node=1)
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_a_rollout_node_cut_off_past_slurms_node_timeout_costs_a_requeue_not_the_run(hosts_cluster, tiny_model_dir,
                                                                                     tmp_path):
    """A network partition: engine 2's host loses its link mid-step until Slurm, no longer hearing its slurmd, takes
    the node for failed (SlurmdTimeout, counted from its last answer) and ends the job; meanwhile rank 0 finds the
    engine silent and requeues its work, and every process on the cut host runs on. Then the link comes back: the
    node's slurmd answers, its stale steps are killed, Slurm requeues the job onto the same three hosts, and the run
    resumes and ends with every rl step holding exactly its prompts, none twice, and no process left."""
    from tests.helpers.launching import _tail, assert_steps_hold_their_prompts, rstar, run_processes, status, wait_rl_step

    from rstar_hpc.exchange.events import read_events
    from rstar_hpc.exchange.rundir import RunPaths

    steps = 4
    env = {**hosts_cluster.env, "OMP_NUM_THREADS": "1"}
    job = json.loads(rstar("launch", _rl_config(tmp_path, tiny_model_dir, steps), "--json",
                           env=env).stdout.splitlines()[-1])["jobs"]["run"]
    run = tmp_path / "runs" / "cut"
    paths = RunPaths(run)
    wait_rl_step(run, "generating, 0/", range(steps - 1), "generating")   # its work has just reached both engines
    node = json.loads((run / "placement" / "rollout-2.json").read_text())["node"]

    def requeues() -> int:
        out = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True, env=env,
                             timeout=30).stdout
        return max((int(t.split("=")[1]) for t in out.split() if t.startswith("Restarts=")), default=0)

    hosts_cluster.cut_node(node)
    cut_at = time.time()
    try:
        while requeues() < 1:   # Slurm's node timeout is 60 s on this cluster
            assert time.time() - cut_at < 180, "Slurm did not take the cut-off node for failed\n" + _tail(run)
            time.sleep(1)
    finally:
        hosts_cluster.cut_node(node, cut=False)
    deadline = time.monotonic() + 600
    while not status(run, env)["done"]:
        assert time.monotonic() < deadline, "the run did not finish\n" + _tail(run)
        time.sleep(2)
    lost = [e for e in read_events(paths) if e["kind"] == "engine_lost"]
    assert lost and lost[0]["rank"] == 2 and "silent for" in lost[0]["reason"], lost   # before Slurm's verdict
    assert_steps_hold_their_prompts(run, "rl", steps)
    deadline = time.monotonic() + 60
    while run_processes(run) and time.monotonic() < deadline:
        time.sleep(1)
    assert not run_processes(run), run_processes(run)   # the cut host's stale steps too
