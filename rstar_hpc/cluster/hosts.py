"""Nodes that are hosts (`rstar-hpc cluster up --hosts`): each emulated node in a network, UTS and mount namespace
of its own, so what a real cluster adds (TCP between nodes, a hostname per node, a /tmp per node) is exercised here.

    bridge rs<h>b    198.18.<x>.1/24      the host: slurmctld, munged, the user's shell and its srun
      veth rs<h>v<i>  <->  eth0 in netns rstar-<h>-<node>    198.18.<x>.<10 + i>/24

<h> comes from the state directory, so two clusters (two test workers) never share a name, and <x> is the first
/24 of 198.18.0.0/15 (RFC 2544's benchmarking range, never a real network's) from one <h> picks that no address or
route of the host touches. A node's slurmd starts inside its namespaces; every process Slurm starts there inherits them:
  - the node's name as hostname (slurm.conf NodeHostname), and /etc/hosts naming every node and the host;
  - one interface on the bridge, and routes to the bridge's subnet and the host's own addresses only: nothing out;
  - a tmpfs on /tmp and on /dev/shm: a file one node writes there, no other node sees. Paths under /tmp that stand
    for shared storage (the state directory, this Python environment, and `shared`: a run root or a checkout under
    /tmp) are bound back in, as Lustre is mounted on every node. Everything outside /tmp and /dev/shm is the host's, as on nodes of one image.
`down` removes every namespace, link and directory `up` made; `up` first removes what a crashed cluster left.
Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN), which the plain cluster does not.
"""
from __future__ import annotations

import hashlib
import ipaddress
import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path

RANGE = ipaddress.ip_network("198.18.0.0/15")
FIRST_NODE = 10   # .1 is the host's end of the bridge


class HostsError(RuntimeError):
    """The node namespaces could not be made; the message says what to do."""


def _ip(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *argv], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise HostsError(f"ip {' '.join(argv)}: {proc.stderr.strip()}")
    return proc


def host_addresses() -> list[ipaddress.IPv4Interface]:
    """The host's IPv4 addresses (with their prefix), loopback included."""
    out = _ip("-4", "-o", "addr", "show").stdout
    return [ipaddress.ip_interface(line.split()[3]) for line in out.splitlines() if len(line.split()) > 3]


def _taken() -> list[ipaddress.IPv4Network]:
    nets = [a.network for a in host_addresses()]
    for line in _ip("-4", "route", "show", "table", "all", check=False).stdout.splitlines():
        word = line.split()[0] if line.split() else ""
        if word in ("local", "broadcast", "unreachable", "blackhole", "prohibit"):
            word = line.split()[1]
        if word and word != "default":
            try:
                nets.append(ipaddress.ip_network(word, strict=False))
            except ValueError:
                continue
    return nets


class NodeHosts:
    """The namespaces, bridge and veths of one emulated cluster's nodes (`nodes`, in slurm.conf order)."""

    def __init__(self, state_dir: Path, nodes: list[str], shared: tuple[str, ...] = ()):
        self.state = Path(state_dir)
        self.nodes = list(nodes)
        h = hashlib.sha1(str(self.state).encode()).hexdigest()[:5]
        self.tag = f"rs{h}"
        self.bridge = f"{self.tag}b"
        self.host_tmp = Path("/run") / f"rstar-hosts-{h}"   # the host's /tmp, seen from a node's own /tmp
        # shared storage under /tmp, bound back into each node's /tmp (longest last: a path inside another); the
        # Python environment this runs in too, as a site's software is on every node
        self.shared = sorted({str(self.state), sys.prefix, *(str(Path(p).absolute()) for p in shared)}, key=len)

    # ---- names ------------------------------------------------------------------------------------
    def netns(self, node: str) -> str:
        return f"rstar-{self.tag[2:]}-{node}"

    def veth(self, node: str) -> str:
        return f"{self.tag}v{self.nodes.index(node)}"

    def subnet(self) -> ipaddress.IPv4Network:
        """The bridge's /24: saved at `up` (the hosts file holds it), else the first free one."""
        saved = self.state / "hosts"
        if saved.is_file():
            for line in saved.read_text().splitlines():
                if line.endswith(" rstar-bridge"):
                    return ipaddress.ip_network(line.split()[0] + "/24", strict=False)
        taken = _taken()
        nets = list(RANGE.subnets(new_prefix=24))
        first = int(self.tag[2:], 16) % len(nets)   # clusters started at once (test workers) start apart
        for net in nets[first:] + nets[:first]:
            if not any(net.overlaps(t) for t in taken):
                return net
        raise HostsError(f"every /24 of {RANGE} is in use on this host: free one (ip addr, ip route)")

    def address(self, node: str, net: ipaddress.IPv4Network | None = None) -> str:
        net = net or self.subnet()
        return str(net.network_address + FIRST_NODE + self.nodes.index(node))

    def gateway(self, net: ipaddress.IPv4Network | None = None) -> str:
        return str((net or self.subnet()).network_address + 1)

    # ---- lifecycle --------------------------------------------------------------------------------
    def up(self) -> dict[str, str]:
        """Make the bridge, each node's namespace, veth, address and routes, and the hosts file; node -> address."""
        if os.geteuid() != 0:
            raise HostsError("--hosts gives each node a network namespace of its own, which needs root; run it as "
                             "root, or use the plain cluster (no --hosts: every node on localhost)")
        self.down()   # what a crashed cluster of this state directory left
        net = self.subnet()
        gw = self.gateway(net)
        own = [a for a in host_addresses() if not a.ip.is_loopback and a.ip not in net]
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{gw}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for node in self.nodes:
            ns, veth, addr = self.netns(node), self.veth(node), self.address(node, net)
            _ip("netns", "add", ns)
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", veth, "master", self.bridge, "up")
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            for a in own:   # srun on the host calls back from its own address: routed to the host, no further
                _ip("-n", ns, "route", "add", f"{a.ip}/32", "via", gw)
        lines = ["127.0.0.1 localhost", f"{gw} {socket.gethostname()} rstar-bridge",
                 *(f"{self.address(n, net)} {n}" for n in self.nodes)]
        (self.state / "hosts").write_text("\n".join(lines) + "\n")
        self.host_tmp.mkdir(parents=True, exist_ok=True)
        return {n: self.address(n, net) for n in self.nodes}

    def down(self) -> list[str]:
        """Remove every namespace and link of this cluster (the processes still in a namespace first); what it
        removed."""
        removed = []
        listed = _ip("netns", "list", check=False).stdout.split()
        for node in self.nodes:
            ns = self.netns(node)
            if ns in listed:
                for pid in self.pids(node):
                    try:
                        os.kill(pid, 9)
                    except ProcessLookupError:
                        pass
                _ip("netns", "del", ns, check=False)   # its eth0 goes with it, and so the host's veth end
                removed.append(f"netns {ns}")
            if _ip("link", "show", self.veth(node), check=False).returncode == 0:
                _ip("link", "del", self.veth(node), check=False)
                removed.append(f"link {self.veth(node)}")
        if _ip("link", "show", self.bridge, check=False).returncode == 0:
            _ip("link", "del", self.bridge, check=False)
            removed.append(f"bridge {self.bridge}")
        if self.host_tmp.is_dir():
            try:
                self.host_tmp.rmdir()
            except OSError:   # still a mount point of a node that lives on: its namespace goes with its processes
                pass
        (self.state / "hosts").unlink(missing_ok=True)
        return removed

    # ---- running on a node ------------------------------------------------------------------------
    def on_node(self, node: str, cmd: list[str]) -> list[str]:
        """`cmd` run on `node`: in its network namespace, with its hostname, /etc/hosts, /tmp and /dev/shm."""
        binds = "".join(f'mkdir -p {shlex.quote(p)}; mount --bind {shlex.quote(str(self.host_tmp) + p[4:])} '
                        f'{shlex.quote(p)}; ' for p in self.shared if p.startswith("/tmp/"))
        script = (f"set -e; hostname {shlex.quote(node)}; mount --bind {shlex.quote(str(self.state / 'hosts'))} "
                  f"/etc/hosts; mount --bind /tmp {shlex.quote(str(self.host_tmp))}; "
                  f"mount -t tmpfs -o mode=1777 tmpfs /tmp; {binds}"
                  f"mount -t tmpfs -o mode=1777 tmpfs /dev/shm; exec \"$@\"")
        # nsenter, not `ip netns exec`: that one mounts a fresh /sys, which hides /sys/fs/cgroup from slurmd
        return ["nsenter", f"--net=/run/netns/{self.netns(node)}", "unshare", "--uts", "--mount", "--propagation",
                "private", "--", "sh", "-c", script, "rstar-node", *cmd]

    def pids(self, node: str) -> list[int]:
        """Every process on `node`: those in its network namespace (what a lost node takes with it)."""
        out = _ip("netns", "pids", self.netns(node), check=False).stdout
        return sorted(int(p) for p in out.split() if p.isdigit())

    def set_link(self, node: str, up: bool) -> None:
        """Cut `node` off the network (its veth down) or mend it: a partition, its processes running on."""
        _ip("link", "set", self.veth(node), "up" if up else "down")
