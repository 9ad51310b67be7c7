"""pid 1 of a sandbox: start-up (main), the request loop, the stateless path through the fork server,
supervision of a running cell, and the sweep after every call."""
import atexit
import gc
import os
import signal
import sys
import time

from . import settings
from .boot import become
from .cell import limit_plan, reseed, set_dumpable
from .forkserver import fork_server_loop, warm_cell_path
from .framing import pack_request, read_frame, readable, send_fds, socketpair, write_all, write_frame
from .procfs import cpu_of, status_kb
from .report import Capture, classify
from .scratch import make_workdir, scan_skeleton, wipe
from .sessions import Sessions


class Server:
    def __init__(self, ctl_in, ctl_out, lim):
        self.ctl_in, self.ctl_out = ctl_in, ctl_out
        self.lim = lim
        self.sessions = Sessions(self)
        self.calls = 0
        self.spare = None           # the pre-forked next stateless cell
        self.cleanup_later = False  # the last stateless call's leftovers are swept after its reply
        self.dirty = None           # why this sandbox must not run another call
        self.null = None            # /dev/null, the stdin of pre-forked cells
        self.fork_server = None     # (pid, socket) of the fork server
        # the sweep kills every process it can see and the wipe empties /tmp and /dev/shm: only where they are
        # the sandbox's own (pid 1 of its pid namespace, bwrap's hostname, /tmp a private mount). Pid 1 alone is
        # not enough: run as pid 1 of a bare `unshare -fp --mount-proc`, the worker wiped the host's /tmp
        self.in_sandbox = os.getpid() == 1 and os.uname().nodename == "sandbox" and os.path.ismount("/tmp")
        self.skeleton = scan_skeleton() if self.in_sandbox else {}

    # -- the request loop
    def serve(self):
        while True:
            req = read_frame(self.ctl_in)
            if req is None:
                return
            op = req.get("op")
            if op == "exec" and self.dirty:
                reply = {"refused": self.dirty}   # nothing ran: the service replaces us and resends
            elif op == "exec":
                self.calls += 1
                sid = req.get("session")
                reply = self.run_stateless(req) if sid is None else self.sessions.run(sid, req)
            elif op == "drop":
                self.sessions.drop(req["session"])
                self.sweep()
                reply = {"ok": True}
            elif op == "ping":
                self.reap()
                reply = {"ok": True, "sessions": len(self.sessions.holders)}
            else:
                reply = {"status": "internal_error", "reason": f"unknown op {op!r}"}
            reply["lost_sessions"] = self.sessions.take_lost()
            write_frame(self.ctl_out, reply)
            self.cleanup()

    def classify(self, out, err, wall, why, status, cpu):
        return classify(self.lim, out, err, wall, why, status, cpu)

    # -- a running cell
    def supervise(self, done_fds, out_r, err_r, timeout, start=None):
        """Collect output until the cell's process has exited (one of `done_fds`, its pidfd, readable), the wall
        deadline passes, or output floods. Whatever is already in the pipes when it ends is read too (its
        children may hold them open)."""
        lim = self.lim
        out, err = Capture(lim["max_output_bytes"]), Capture(lim["max_output_bytes"])
        import select
        poll = select.poll()
        names = {out_r: out, err_r: err}
        for fd in (out_r, err_r, *done_fds):
            poll.register(fd, select.POLLIN)
        start = time.monotonic() if start is None else start
        deadline = start + timeout
        why = None
        ended = False
        while not ended:
            left = deadline - time.monotonic()
            if left <= 0:
                why = "timeout"
                break
            for fd, _ in poll.poll(max(1, int(left * 1000))):
                if fd in done_fds:
                    ended = True
                    break
                try:
                    data = os.read(fd, 1 << 16)
                except BlockingIOError:
                    continue
                if not data:
                    poll.unregister(fd)
                    continue
                names[fd].add(data)
            if out.total + err.total > lim["output_kill_bytes"]:
                why = "output"
                break
        wall = time.monotonic() - start
        for fd in (out_r, err_r):
            while names[fd].total < lim["output_kill_bytes"]:
                try:
                    data = os.read(fd, 1 << 16)
                except (BlockingIOError, OSError):
                    break
                if not data:
                    break
                names[fd].add(data)
            os.close(fd)
        return out, err, wall, why

    # -- the stateless path
    def run_stateless(self, req):
        self.prefork()
        if self.spare is None:
            return {"status": "internal_error", "reason": self.dirty or "no cell could be forked"}
        sp, self.spare = self.spare, None
        pid = sp["pid"]
        if readable(sp["pidfd"], 0):
            # the spare died before its request (nothing ran): an infrastructure fault, never a result
            for fd in (sp["out_r"], sp["err_r"], sp["go_w"], sp["pidfd"]):
                os.close(fd)
            self.reap_cell(pid)
            self.dirty = "the pre-forked cell died before its call"
            return {"status": "internal_error", "reason": self.dirty}
        cpu0 = cpu_of(pid)   # its set-up is not the call's CPU time
        try:
            write_all(sp["go_w"], pack_request(req["code"], req.get("stdin", "")))
        except OSError:
            pass   # it died meanwhile: its exit status says how
        os.close(sp["go_w"])
        out, err, wall, why = self.supervise((sp["pidfd"],), sp["out_r"], sp["err_r"], req["timeout_s"])
        os.close(sp["pidfd"])
        if why is not None:
            os.kill(pid, signal.SIGKILL)
        status, cpu = self.reap_cell(pid)
        self.cleanup_later = True
        return self.classify(out, err, wall, why, status, max(0.0, cpu - cpu0))

    def cleanup(self):
        """After a reply went out: end what the stateless cell left, sweep, and prepare the next one."""
        if self.cleanup_later:
            self.cleanup_later = False
            if not self.sweep():
                self.dirty = "processes survived the sweep after a call"
        if self.dirty is None:
            self.prefork()

    def prefork(self):
        """Have the fork server fork and prepare the next stateless cell ahead of its request (limits, fds,
        RNGs, cwd), so a call's latency is exec + exit, not fork + setup. The child blocks reading its
        request."""
        if self.spare is not None:
            return
        cwd = make_workdir("call")
        pipes = [os.pipe() for _ in range(3)]   # stdout, stderr; the request
        (out_r, out_w), (err_r, err_w), (go_r, go_w) = pipes
        child_ends = [out_w, err_w, go_r]
        pid = 0
        for _ in range(2):   # a fork server that died (a cell may kill its parent) is replaced once
            rep = self.ask_fork_server(0, child_ends)
            if rep is not None:
                pid = rep[0]
                break
        for fd in child_ends:
            os.close(fd)
        if pid <= 0:
            for fd in (out_r, err_r, go_w):
                os.close(fd)
            self.dirty = "the fork server could not fork a cell"
            return
        for fd in (out_r, err_r):
            os.set_blocking(fd, False)
        self.spare = {"pid": pid, "pidfd": os.pidfd_open(pid), "out_r": out_r, "err_r": err_r, "go_w": go_w,
                      "cwd": cwd}

    # -- the fork server
    def start_fork_server(self):
        """Fork the fork server from this (warm) process. It forks every stateless cell, so this process,
        which does the per-call work (framing, supervision, sweeping), never forks per call: a fork
        write-protects the forking process's whole heap, and each page it writes afterwards costs a
        copy-on-write fault (this pid 1 took ~200 per call when it forked the cells itself)."""
        import _socket
        ours, theirs = socketpair(_socket.SOCK_SEQPACKET)
        if self.null is None:
            self.null = os.open("/dev/null", os.O_RDONLY)
        pid = os.fork()
        if pid == 0:
            ours.close()
            for fd in (self.ctl_in, self.ctl_out):
                os.close(fd)
            self.sessions.close_in_child()
            become(fork_server_loop, theirs, self.null)
        theirs.close()
        self.fork_server = (pid, ours)

    def stop_fork_server(self):
        if self.fork_server is None:
            return
        pid, sock = self.fork_server
        self.fork_server = None
        sock.close()
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass

    def ask_fork_server(self, reap=0, fds=None):
        """One request to the fork server: reap cell `reap` (> 0; it is dead or being killed) or fork a spare
        on `fds`. The reply's fields ((pid, wait status, CPU s) or (new pid,)); None if the fork server
        failed (it is then replaced; a cell it had is now our child)."""
        if self.fork_server is None:
            self.start_fork_server()
        pid, sock = self.fork_server
        reply = settings.REAPED if reap else settings.FORKED
        try:
            os.kill(pid, signal.SIGCONT)   # a cell may have stopped it (it may signal its parent)
            msg = settings.FORK_SERVER_REQUEST.pack(reap)
            if fds is None:
                sock.send(msg)
            else:
                send_fds(sock, msg, fds)
            if readable(sock, 10.0):
                data = sock.recv(64)
                if len(data) == reply.size:
                    return reply.unpack(data)
        except OSError:
            pass
        self.stop_fork_server()
        return None

    def reap_cell(self, pid):
        """(wait status, CPU seconds) of a stateless cell that has ended or is being killed; (None, 0.0) if its
        status was lost."""
        rep = self.ask_fork_server(reap=pid)
        if rep is not None and rep[1] >= 0:
            return rep[1], rep[2]
        try:   # the fork server died: the cell is our child now
            _, status, ru = os.wait4(pid, 0)
            return status, ru.ru_utime + ru.ru_stime
        except ChildProcessError:
            return None, 0.0

    # -- sweeping
    def own_pids(self):
        """The processes a sweep keeps besides pid 1: the fork server, its spare, the session holders."""
        keep = self.sessions.pids()
        if self.spare is not None:
            keep.add(self.spare["pid"])
        if self.fork_server is not None:
            keep.add(self.fork_server[0])
        return keep

    def sweep(self):
        """Kill every process but our own (own_pids), then reap and wipe. A fork bomb keeps forking while we
        kill, so repeat until the table is clean."""
        if not self.in_sandbox:
            # anywhere but in its sandbox /proc and /tmp are the host's: the loop below would SIGKILL every
            # process the caller may signal (a harness calling Server.run/cleanup outside bwrap did exactly
            # that) and the wipe would empty the host's /tmp. Refusing marks the sandbox unclean.
            return False
        keep = self.own_pids()
        for _ in range(200):
            alive = [int(p) for p in os.listdir("/proc") if p.isdigit() and p != "1" and int(p) not in keep]
            for pid in alive:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.reap()
            if not alive:
                dirs = self.sessions.dirs() | ({self.spare["cwd"]} if self.spare is not None else set())
                wipe(self.skeleton, dirs)
                self.sessions.drain()
                return True
            time.sleep(0.001)
        return False

    def reap(self):
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if self.fork_server is not None and pid == self.fork_server[0]:
                self.fork_server[1].close()
                self.fork_server = None
                continue
            self.sessions.died(pid)


def main():
    # the service's pipes move to private fds; 0/1 become /dev/null so nothing can write into the protocol
    ctl_in, ctl_out = os.dup(0), os.dup(1)
    null = os.open("/dev/null", os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    for sig in settings.IGNORED:
        signal.signal(sig, signal.SIG_IGN)
    init = read_frame(ctl_in)
    uid = init.get("uid")
    if uid is not None:   # started as root: run everything, this server included, as an unprivileged uid
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    set_dumpable(False)
    if init.get("cpu") is not None:   # before any fork: the fork server, cells and session holders inherit it
        try:
            os.sched_setaffinity(0, {init["cpu"]})
        except OSError as e:
            sys.stderr.write(f"sandbox worker: cannot pin to CPU {init['cpu']}: {e!r}\n")
    if sys.flags.no_site:   # a light interpreter: what site would have given cells, without its .pth hooks
        import site  # under -S importing site runs nothing
        site.setquit()
        site.setcopyright()
        site.sethelper()
        sys.path.extend(p for p in init.get("path", []) if p not in sys.path)
    for name in init.get("preload", []):
        try:
            __import__(name)
        except Exception as e:   # a missing library must not take the pool down
            sys.stderr.write(f"sandbox worker: preload {name} failed: {e!r}\n")
    if init.get("warmup"):
        try:   # fill the libraries' caches once, so forked cells start warm
            exec(compile(init["warmup"], "<warmup>", "exec"), {"__name__": "__warmup__"})
        except Exception as e:
            sys.stderr.write(f"sandbox worker: warm-up failed: {e!r}\n")
    settings.LIM = init["limits"]
    srv = Server(ctl_in, ctl_out, settings.LIM)
    warm_cell_path()
    atexit._clear()   # the preloaded libraries' exit hooks are not the cell's: a cell runs only its own
    reseed()   # numpy's first seed() builds lazily-initialised state (seconds); pay it once, here
    gc.collect()
    gc.freeze()   # children then never touch the pre-imported objects' GC headers: fewer copy-on-write pages
    settings.BASE_VM = status_kb(os.getpid(), "VmSize")
    srv.sessions.base_anon = status_kb(os.getpid(), "RssAnon")
    settings.LIMIT_PLAN = limit_plan(settings.LIM, settings.BASE_VM)
    modules = sorted({m.partition(".")[0] for m in sys.modules})   # what cells find loaded: the fork server's
    srv.start_fork_server()
    srv.prefork()
    write_frame(ctl_out, {"op": "ready", "pid": os.getpid(), "uid": os.getuid(), "vm_size": settings.BASE_VM,
                          "preloaded": [m for m in init.get("preload", []) if m in sys.modules],
                          "modules": modules})
    srv.serve()
