"""The in-sandbox half: pid 1 of one bwrap sandbox, a warm fork server.

Runs as pid 1 inside bwrap (`--as-pid-1`), imported compiled by `python -I -u -B -c` (pool.py), so it must
stay stdlib-only apart from the libraries it pre-imports for user code. It speaks length-prefixed JSON on fds it
dups away from 0/1 (the service's pipes), never runs user code itself, and has no handler for any signal user code could
send, so inside its pid namespace it cannot be killed (pid_namespaces(7)). Each call runs in a fresh
forked child (stateless) or in a fork of the session's holder (stateful); limits are hard rlimits set in
the child, the wall timer lives here, and after every call everything but pid 1, the fork server, its
pre-forked spare cell and live session holders is killed and the call's scratch directory removed.

Stateless cells are forked by a fork server, a child of pid 1 forked once from the warm interpreter, not
by pid 1 itself: a fork write-protects the forking process's whole heap, and pid 1's per-call work
(framing, supervision, sweeping) then paid ~200 copy-on-write faults per call. The fork server only
forks and reaps on request, and a cell that kills or stops it (it is the cell's parent) costs a
replacement at most.

Session holders form a fork chain: holder H forks C for a cell; if C finishes the cell, C becomes the
holder (its state includes the cell) and H is killed; if C dies (timeout, signal, os._exit, memory kill),
H is still there with the state from before the cell: the cell is rolled back, and the result says so.
"""
import _signal
import _socket
import ast
import ctypes
import gc
import json
import linecache
import os
import resource
import signal
import struct
import sys
import time
import traceback

CELL = "<cell>"
_HDR = struct.Struct(">I")
_REQ = struct.Struct(">II")     # a stateless cell's request: code bytes, stdin bytes
_ZREQ = struct.Struct("=i?")    # to the fork server: dead cell to reap (0: none), fork a spare (fds attached)
_ZREP = struct.Struct("=idi")   # from it: the reaped cell's wait status (-1: none, -2: not ours), CPU s, new pid
SPARE_CWD = "/tmp/call"
_IGNORED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
            signal.SIGPIPE, signal.SIGALRM, signal.SIGXCPU, signal.SIGXFSZ, signal.SIGTSTP, signal.SIGTTIN,
            signal.SIGTTOU)
# a cell's dispositions, as plain ints for _signal: signal.signal's enum round trips touch dozens of
# copy-on-write pages in every forked cell. What plain python does: KeyboardInterrupt on SIGINT, EPIPE/EFBIG
# errors instead of SIGPIPE/SIGXFSZ deaths, default for the rest
_CELL_SIGNALS = tuple((int(s), {signal.SIGINT: signal.default_int_handler, signal.SIGPIPE: 1,
                                signal.SIGXFSZ: 1}.get(s, 0)) for s in _IGNORED)
_LIMIT_PLAN = None   # set_limits' (resource, (soft, hard)) pairs, computed once in pid 1
_TICK = os.sysconf("SC_CLK_TCK")
_exit = os._exit   # bound before any cell runs: a cell that replaces os._exit cannot keep a spare going
# the usual report, sent as fixed bytes: json.dumps in every cell cost it ~35 page faults for nothing
OK_REPORT = {"exc_type": None}
_OK_BYTES = json.dumps(OK_REPORT).encode()


# ---------------------------------------------------------------- framing
def read_exact(fd, n):
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def read_frame(fd):
    hdr = read_exact(fd, 4)
    if hdr is None:
        return None
    body = read_exact(fd, _HDR.unpack(hdr)[0])
    return None if body is None else json.loads(body)


def write_all(fd, data):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def write_frame(fd, obj):
    body = json.dumps(obj).encode()
    write_all(fd, _HDR.pack(len(body)) + body)


def pack_request(code, stdin):
    """A stateless cell's request, as pid 1 sends it on the cell's own pipe: the lengths of code and stdin,
    then both. Raw bytes, not JSON: decoding a JSON frame cost each forked cell ~15 copy-on-write page faults
    (~50 with encoding its report, which is now fixed bytes when the cell succeeds). surrogatepass keeps code
    that JSON carried with lone surrogates as it was (compile reports it). Length-prefixed, not read to EOF: a
    fork server started later inherits pid 1's end of the pipe."""
    code = code.encode("utf-8", "surrogatepass")
    stdin = stdin.encode("utf-8", "replace")
    return _REQ.pack(len(code), len(stdin)) + code + stdin


def read_request(fd):
    """(code, stdin bytes) from pid 1; None if it never fully arrived."""
    hdr = read_exact(fd, _REQ.size)
    if hdr is None:
        return None
    n, m = _REQ.unpack(hdr)
    body = read_exact(fd, n + m)
    if body is None:
        return None
    return body[:n].decode("utf-8", "surrogatepass"), body[n:]


# Modules only pid 1 needs are imported where pid 1 uses them, after it has forked the fork server: every
# module the fork server holds is in every cell's fork and exit. Sockets use _socket directly (socket.py
# brings selectors, select, array and its enums).
def send_fds(sock, msg, fds):
    sock.sendmsg([msg], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS,
                          b"".join(fd.to_bytes(4, sys.byteorder, signed=True) for fd in fds))])


def recv_fds(sock, bufsize, maxfds):
    """(message, fds) from one recvmsg; fds beyond maxfds are closed by the kernel (MSG_CTRUNC)."""
    msg, anc, _, _ = sock.recvmsg(bufsize, _socket.CMSG_SPACE(maxfds * 4))
    fds = []
    for level, kind, data in anc:
        if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
            fds += [int.from_bytes(data[i:i + 4], sys.byteorder, signed=True) for i in range(0, len(data) - 3, 4)]
    return msg, fds


def socketpair(kind=_socket.SOCK_STREAM):
    return _socket.socketpair(_socket.AF_UNIX, kind)


def _readable(fd, timeout):
    # pid 1 only (see above)
    import select
    return bool(select.select([fd], (), (), timeout)[0])


def _rmtree(path):
    # imported here, in pid 1 only, not at start: shutil maps zlib, bz2 and lzma (~30 memory areas) into the
    # interpreter every cell is forked from, and each fork and exit would copy and tear down their page tables
    import shutil
    shutil.rmtree(path, ignore_errors=True)


def _read_proc(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.read(fd, 4096)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- output capture
class Capture:
    """Keeps the first and last `keep // 2` bytes of a stream and counts the rest."""

    def __init__(self, keep):
        self.half = max(keep // 2, 1)
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def add(self, data):
        self.total += len(data)
        room = self.half - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.tail += data
            if len(self.tail) > self.half:
                del self.tail[:len(self.tail) - self.half]

    def text(self):
        cut = self.total - len(self.head) - len(self.tail)
        if cut <= 0:
            return (bytes(self.head) + bytes(self.tail)).decode("utf-8", "replace")
        return (bytes(self.head).decode("utf-8", "replace") + f"\n...[{cut} bytes truncated]...\n"
                + bytes(self.tail).decode("utf-8", "replace"))

    @property
    def truncated(self):
        return self.total > len(self.head) + len(self.tail)


# ---------------------------------------------------------------- the child side (runs user code)
def _libc():
    return ctypes.CDLL(None, use_errno=True)


def set_dumpable(flag):
    # non-dumpable: /proc/<pid>/{mem,environ,fd} and ptrace are closed to same-uid processes
    _libc().prctl(4, int(flag), 0, 0, 0)   # PR_SET_DUMPABLE


def limit_plan(lim, base_vm):
    cpu = max(1, int(lim["cpu_time_s"] + 0.999))
    plan = [(resource.RLIMIT_CPU, (cpu, cpu + 1))]   # SIGXCPU at soft, SIGKILL at hard even if SIGXCPU is caught
    for res, value in ((resource.RLIMIT_AS, base_vm + lim["memory_mb"] * 2**20),
                       (resource.RLIMIT_NPROC, lim["nproc"]), (resource.RLIMIT_NOFILE, lim["open_files"]),
                       (resource.RLIMIT_FSIZE, lim["file_size_mb"] * 2**20), (resource.RLIMIT_CORE, 0),
                       (resource.RLIMIT_MEMLOCK, 0), (resource.RLIMIT_MSGQUEUE, 0)):
        plan.append((res, (value, value)))
    return tuple(plan)


def set_limits(lim, base_vm):
    setrlimit = resource.setrlimit
    for res, values in _LIMIT_PLAN or limit_plan(lim, base_vm):
        setrlimit(res, values)


def enter_cell(stdin_fd, out_w, err_w, keep_fds, lim, base_vm, cwd):
    """Turn a freshly forked child into a sandboxed cell: own fds, signals, hard limits, RNGs, cwd."""
    os.dup2(stdin_fd, 0)
    os.dup2(out_w, 1)
    os.dup2(err_w, 2)
    keep = sorted({0, 1, 2, *keep_fds})
    lo = 0
    for fd in keep + [65536]:
        if fd > lo:
            os.closerange(lo, fd)
        lo = fd + 1
    sig_set = _signal.signal
    for sig, handler in _CELL_SIGNALS:
        sig_set(sig, handler)
    set_limits(lim, base_vm)
    try:
        fd = os.open("/proc/self/oom_score_adj", os.O_WRONLY)
        try:
            os.write(fd, b"1000")   # the cell, not the server, is the OOM killer's first choice
        finally:
            os.close(fd)
    except OSError:
        pass
    reseed()
    os.chdir(cwd)


def reseed():
    # a fork copies the parent's RNG state: without this every call would draw the same "random" numbers.
    # Modules not loaded yet seed themselves when a cell imports them (light sandboxes do not load random:
    # its own at-fork reseed alone costs every forked cell ~40 page faults)
    rnd = sys.modules.get("random")
    if rnd is not None:
        rnd.seed()
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed()


def _strip(te):
    """Drop the server's own frames (everything before the first frame of the cell) from a traceback."""
    frames = list(te.stack)
    first = next((i for i, fr in enumerate(frames) if fr.filename == CELL), len(frames))
    te.stack = traceback.StackSummary.from_list(frames[first:])
    for nxt in (te.__cause__, te.__context__):
        if nxt is not None:
            _strip(nxt)
    return te


def describe(exc):
    te = _strip(traceback.TracebackException.from_exception(exc))
    text = "".join(te.format())
    lineno = getattr(exc, "lineno", None) if isinstance(exc, SyntaxError) else None
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == CELL:
            lineno = tb.tb_lineno
        tb = tb.tb_next
    return {"exc_type": type(exc).__name__, "exc_message": str(exc)[:2000], "traceback": text[-20000:],
            "lineno": lineno, "memory": isinstance(exc, MemoryError),
            "clean_exit": isinstance(exc, SystemExit) and exc.code in (None, 0)}


def exec_cell(code, g):
    """Run one cell in globals `g`; the value of a bare last expression is printed as repr(), like IPython."""
    lines = code.splitlines(True)
    linecache.cache[CELL] = (len(code), None, lines, CELL)
    try:
        tree = ast.parse(code, CELL, "exec")
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        exec(compile(tree, CELL, "exec"), g)
        if last is not None:
            value = eval(compile(ast.Expression(last.value), CELL, "eval"), g)
            if value is not None:
                g["_"] = value
                sys.stdout.write(repr(value) + "\n")
        report = OK_REPORT
    except BaseException as e:   # noqa: B036 - SystemExit/KeyboardInterrupt are results here too
        report = describe(e)
        if not report["clean_exit"]:
            try:
                os.write(2, report["traceback"].encode("utf-8", "replace"))
            except OSError:
                pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    return report


def send_report(res_w, report):
    try:
        write_all(res_w, _OK_BYTES if report is OK_REPORT else json.dumps(report).encode())
    except (OSError, TypeError, ValueError):
        pass
    try:
        os.close(res_w)
    except OSError:
        pass


# ---------------------------------------------------------------- session holder loop (runs in the holder)
def holder_loop(sock, g, lim, base_vm):
    """Serve cells of one session. Runs in the session's holder process (which user code also ran in)."""
    while True:
        try:
            msg, fds = recv_fds(sock, 1 << 20, 8)
        except OSError:
            os._exit(0)
        if not msg:
            os._exit(0)
        req = json.loads(msg)
        stdin_fd, out_w, err_w, res_w = fds
        child = os.fork()
        if child == 0:
            enter_cell(stdin_fd, out_w, err_w, (res_w, sock.fileno()), lim, base_vm, req["cwd"])
            report = dict(exec_cell(req["code"], g))
            report["pid"] = os.getpid()
            send_report(res_w, report)
            # this process is the holder now; later writes by its threads must not reach the next cell
            null = os.open("/dev/null", os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            os.close(null)
            continue
        for fd in fds:
            os.close(fd)
        try:
            sock.sendall(json.dumps({"forked": child}).encode() + b"\n")
            _, status, ru = os.wait4(child, 0)
        except OSError:
            os._exit(0)
        # the cell died: this process still holds the state from before it
        sock.sendall(json.dumps({"died": child, "status": status,
                                 "cpu_s": ru.ru_utime + ru.ru_stime}).encode() + b"\n")


# ---------------------------------------------------------------- the fork server (a child of pid 1)
def spare_cell(null, out_w, err_w, res_w, go_r, lim, base_vm):
    """A freshly forked stateless cell: set up, then wait for its one request and run it."""
    try:
        enter_cell(null, out_w, err_w, (res_w, go_r), lim, base_vm, SPARE_CWD)
        req = read_request(go_r)
        os.close(go_r)
        if req is None:
            _exit(0)
        code, stdin = req
        if stdin:
            fd = os.memfd_create("stdin", 0)   # a file, not a pipe: any size, no writer needed
            write_all(fd, stdin)
            os.lseek(fd, 0, 0)
            os.dup2(fd, 0)
            os.close(fd)
    except BaseException as e:
        send_report(res_w, {"internal": f"cell setup failed: {e!r}"})
        _exit(70)
    try:
        send_report(res_w, exec_cell(code, {"__name__": "__main__", "__builtins__": __builtins__}))
    finally:
        _exit(0)


def warm_cell_path(rounds=64):
    """Run a cell's own code path (compile, exec, display, tracebacks, report and request framing) here
    before the first fork, with output to /dev/null. CPython quickens and specializes bytecode in place
    and fills its type-attribute cache on first use: done once here, every forked cell finds it done
    instead of writing, and copy-on-write faulting, those pages again."""
    saved = os.dup(1), os.dup(2)
    null = os.open("/dev/null", os.O_WRONLY)
    r, w = os.pipe()
    os.dup2(null, 1)
    os.dup2(null, 2)
    try:
        for _ in range(rounds):
            for code in ("_ = None", "print(1 + 1)", "x = [i * i for i in range(3)]\nx[-1]", "1 / 0"):
                report = exec_cell(code, {"__name__": "__main__", "__builtins__": __builtins__})
                json.loads(json.dumps(dict(report, pid=2)))
                write_all(w, pack_request(code, ""))
                read_request(r)
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, null, r, w):
            os.close(fd)
        linecache.cache.pop(CELL, None)


def zygote_loop(sock, null, lim, base_vm):
    """The fork server: forks stateless cells and reaps them, on pid 1's request. It does nothing else, so
    between two forks it writes (copy-on-write faults) only a handful of pages, and every cell forks
    from the same warm, untouched state. User code never runs here; its cells are its only children
    (the seccomp filter denies CLONE_PARENT), so pid 1 learns their exit status from it."""
    fork, wait4, close = os.fork, os.wait4, os.close
    while True:
        try:
            msg, fds = recv_fds(sock, 64, 4)
        except OSError:
            _exit(0)
        if len(msg) != _ZREQ.size:
            _exit(0)   # pid 1 closed its end (or spoke nonsense): nothing to serve
        reap, want = _ZREQ.unpack(msg)
        status, cpu, pid = -1, 0.0, 0
        if reap > 0:
            try:
                _, status, ru = wait4(reap, 0)
                cpu = ru.ru_utime + ru.ru_stime
            except ChildProcessError:
                status = -2
        if want and len(fds) == 4:
            try:
                pid = fork()
            except OSError:
                pid = -1
            if pid == 0:
                sock.close()
                spare_cell(null, *fds, lim, base_vm)   # never returns
        for fd in fds:
            close(fd)
        try:
            sock.send(_ZREP.pack(status, cpu, pid))
        except OSError:
            _exit(0)


# ---------------------------------------------------------------- pid 1
class Server:
    def __init__(self, ctl_in, ctl_out, init):
        self.ctl_in, self.ctl_out = ctl_in, ctl_out
        self.lim = init["limits"]
        self.holders = {}   # session -> {"pid", "sock", "cwd"}
        self.lost = {}      # session -> why its holder vanished outside a call
        self.calls = 0
        self.base_vm = 0
        self.base_anon = 0
        self.spare = None          # the pre-forked next stateless cell
        self.cleanup_later = None  # (pid, pidfd) of the last stateless cell, ended after its reply
        self.dirty = None          # why this sandbox must not run another call
        self.null = None           # /dev/null, the stdin of pre-forked cells
        self.zygote = None         # (pid, socket) of the fork server
        # the sweep kills every process it can see and the wipe empties /tmp and /dev/shm: only where they are
        # the sandbox's own (pid 1 of its pid namespace, bwrap's hostname, /tmp a private mount). Pid 1 alone is
        # not enough: run as pid 1 of a bare `unshare -fp --mount-proc`, the worker wiped the host's /tmp
        self.in_sandbox = os.getpid() == 1 and os.uname().nodename == "sandbox" and os.path.ismount("/tmp")

    # -- bookkeeping
    def vm_size(self):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
        return 0

    def sweep(self, dead_cell=0):
        """Kill every process but pid 1, the fork server, its spare cell and the session holders, then reap.
        A fork bomb keeps forking while we kill, so repeat until the table is clean. `dead_cell`: the last
        cell, already dead, which its parent (the fork server) reaps later."""
        if not self.in_sandbox:
            # anywhere but in its sandbox /proc and /tmp are the host's: the loop below would SIGKILL every
            # process the caller may signal (a harness calling Server.run/cleanup outside bwrap did exactly
            # that) and the wipe would empty the host's /tmp. Refusing marks the sandbox unclean.
            return False
        keep = {h["pid"] for h in self.holders.values()}
        if self.spare is not None:
            keep.add(self.spare["pid"])
        if self.zygote is not None:
            keep.add(self.zygote[0])
        if dead_cell:
            keep.add(dead_cell)
        for _ in range(200):
            alive = [int(p) for p in os.listdir("/proc") if p.isdigit() and p != "1" and int(p) not in keep]
            for pid in alive:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.reap()
            if not alive:
                self.wipe()
                return True
            time.sleep(0.001)
        return False

    def wipe(self):
        """Remove whatever the call left in the writable places, except live sessions' directories. Only the
        sweep calls it, after its in-sandbox check."""
        keep = {h["cwd"] for h in self.holders.values()}
        if self.spare is not None:
            keep.add(self.spare["cwd"])
        for root in ("/tmp", "/dev/shm"):
            try:
                names = os.listdir(root)
            except OSError:
                continue
            for name in names:
                path = os.path.join(root, name)
                if path in keep:
                    continue
                if os.path.isdir(path) and not os.path.islink(path):
                    try:
                        os.rmdir(path)   # the usual case: the call left its directory empty
                    except OSError:
                        _rmtree(path)
                else:
                    try:
                        os.unlink(path)
                    except OSError:
                        pass

    def reap(self):
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if self.zygote is not None and pid == self.zygote[0]:
                self.zygote[1].close()
                self.zygote = None
                continue
            for sid, h in list(self.holders.items()):
                if h["pid"] == pid:
                    self.forget(sid, "session process died between calls")

    def forget(self, sid, why):
        h = self.holders.pop(sid, None)
        if h is None:
            return
        self.lost[sid] = why
        try:
            os.kill(h["pid"], signal.SIGKILL)
        except ProcessLookupError:
            pass
        h["sock"].close()
        _rmtree(h["cwd"])

    def anon_bytes(self, pid):
        """Anonymous memory of a process beyond what the warm interpreter had: a session's own growth.
        (smaps_rollup's PSS would be better, but it is closed to us: sandbox processes are non-dumpable.)"""
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("RssAnon:"):
                        return max(0, int(line.split()[1]) * 1024 - self.base_anon)
        except OSError:
            pass
        return 0

    # -- one call
    def pipes(self, stdin):
        fd = os.memfd_create("stdin", 0)   # a file, not a pipe: any stdin size without a writer loop
        write_all(fd, stdin.encode("utf-8", "replace"))
        os.lseek(fd, 0, 0)
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        res_r, res_w = os.pipe()
        for r in (out_r, err_r, res_r):
            os.set_blocking(r, False)
        return fd, (out_r, out_w), (err_r, err_w), (res_r, res_w)

    def supervise(self, pidfd, out_r, err_r, res_r, timeout, start=None):
        """Collect output and the report until the cell is done (it exited, or closed its report channel
        after a well-formed report), the wall deadline passes, or output floods."""
        lim = self.lim
        out, err = Capture(lim["max_output_bytes"]), Capture(lim["max_output_bytes"])
        res = bytearray()
        import select
        poll = select.poll()
        names = {out_r: out, err_r: err, res_r: res}
        for fd in (out_r, err_r, res_r, pidfd):
            poll.register(fd, select.POLLIN)
        start = time.monotonic() if start is None else start
        deadline = start + timeout
        why = None
        exited = res_eof = False
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                why = "timeout"
                break
            for fd, _ in poll.poll(max(1, int(left * 1000))):
                if fd == pidfd:
                    exited = True
                    poll.unregister(pidfd)
                    continue
                try:
                    data = os.read(fd, 1 << 16)
                except BlockingIOError:
                    continue
                if not data:
                    poll.unregister(fd)
                    if fd == res_r:
                        res_eof = True
                    continue
                if fd == res_r:
                    res += data[: 1 << 20]
                else:
                    names[fd].add(data)
            if out.total + err.total > lim["output_kill_bytes"]:
                why = "output"
                break
            if exited:
                break
            if res_eof:
                try:
                    if isinstance(json.loads(res), dict):
                        break
                except ValueError:
                    pass
                res_eof = False   # garbled or missing report: wait for the exit or the deadline
                res.clear()
        wall = time.monotonic() - start
        for fd in (out_r, err_r, res_r):   # what is already in the pipes, without waiting for EOF
            while True:
                try:
                    data = os.read(fd, 1 << 16)
                except (BlockingIOError, OSError):
                    break
                if not data:
                    break
                if fd == res_r:
                    res += data[: 1 << 20]
                elif names[fd].total < lim["output_kill_bytes"]:
                    names[fd].add(data)
                else:
                    break
            os.close(fd)
        try:
            report = json.loads(res) if res else None
            if not isinstance(report, dict):
                report = None
        except ValueError:
            report = None
        return out, err, report, wall, why, exited

    def run(self, req):
        self.calls += 1
        sid = req.get("session")
        if sid is None:
            return self.run_stateless(req)
        return self.run_session(sid, req)

    def scratch(self, name):
        path = f"/tmp/{name}"
        try:
            os.mkdir(path, 0o700)   # usually gone already: the sweep's wipe removed it
        except FileExistsError:
            _rmtree(path)
            os.mkdir(path, 0o700)
        return path

    # -- the fork server
    def start_zygote(self):
        """Fork the fork server from this (warm) process. It forks every stateless cell, so this process,
        which does the per-call work (framing, supervision, sweeping), never forks per call: a fork
        write-protects the forking process's whole heap, and each page it writes afterwards costs a
        copy-on-write fault (this pid 1 took ~200 per call when it forked the cells itself)."""
        ours, theirs = socketpair(_socket.SOCK_SEQPACKET)
        if self.null is None:
            self.null = os.open("/dev/null", os.O_RDONLY)
        pid = os.fork()
        if pid == 0:
            try:
                ours.close()
                for fd in (self.ctl_in, self.ctl_out):
                    os.close(fd)
                for h in self.holders.values():
                    h["sock"].close()
                zygote_loop(theirs, self.null, self.lim, self.base_vm)
            finally:
                _exit(0)
        theirs.close()
        self.zygote = (pid, ours)

    def stop_zygote(self):
        if self.zygote is None:
            return
        pid, sock = self.zygote
        self.zygote = None
        sock.close()
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass

    def zygote_call(self, reap=0, fds=None):
        """Ask the fork server to reap the (dead) cell `reap` and/or fork a new spare cell on `fds`.
        (status of the reaped cell or -1 / -2 (not its child), its CPU seconds, the new cell's pid or <= 0);
        None if the fork server failed (it is then replaced; a cell it had is now our child)."""
        if self.zygote is None:
            self.start_zygote()
        pid, sock = self.zygote
        try:
            os.kill(pid, signal.SIGCONT)   # a cell may have stopped it (it may signal its parent)
            msg = _ZREQ.pack(reap, fds is not None)
            if fds is None:
                sock.send(msg)
            else:
                send_fds(sock, msg, fds)
            if _readable(sock, 10.0):
                data = sock.recv(64)
                if len(data) == _ZREP.size:
                    return _ZREP.unpack(data)
        except OSError:
            pass
        self.stop_zygote()
        return None

    def reap_cell(self, pid):
        """(wait status, CPU seconds) of a cell that is dead or being killed, reaped by its parent."""
        rep = self.zygote_call(reap=pid)
        if rep is not None and rep[0] >= 0:
            return rep[0], rep[1]
        try:   # the fork server died: the cell is our child now
            _, status, ru = os.wait4(pid, 0)
            return status, ru.ru_utime + ru.ru_stime
        except ChildProcessError:
            return 0, self.cpu_of(pid)

    def prefork(self, reap=0):
        """Have the fork server fork and prepare the next stateless cell ahead of its request (limits, fds,
        RNGs, cwd), so a call's latency is exec + report, not fork + setup. The child blocks reading its
        request. `reap`: a dead cell the fork server reaps first (one round trip for both)."""
        if self.spare is not None:
            if reap:
                self.reap_cell(reap)
            return
        cwd = self.scratch("call")
        pipes = [os.pipe() for _ in range(4)]   # stdout, stderr, report; the request
        (out_r, out_w), (err_r, err_w), (res_r, res_w), (go_r, go_w) = pipes
        child_ends = [out_w, err_w, res_w, go_r]
        pid = 0
        for _ in range(2):   # a fork server that died (a cell may kill its parent) is replaced once
            rep = self.zygote_call(reap, child_ends)
            if rep is not None:
                pid = rep[2]
                break
            if reap:
                try:
                    os.waitpid(reap, 0)   # the old fork server's cell is our child now
                except ChildProcessError:
                    pass
                reap = 0
        for fd in child_ends:
            os.close(fd)
        if pid <= 0:
            for fd in (out_r, err_r, res_r, go_w):
                os.close(fd)
            self.dirty = "the fork server could not fork a cell"
            return
        for fd in (out_r, err_r, res_r):
            os.set_blocking(fd, False)
        self.spare = {"pid": pid, "pidfd": os.pidfd_open(pid), "out_r": out_r, "err_r": err_r, "res_r": res_r,
                      "go_w": go_w, "cwd": cwd}

    def run_stateless(self, req):
        self.prefork()
        if self.spare is None:
            return {"status": "internal_error", "reason": self.dirty or "no cell could be forked"}
        sp, self.spare = self.spare, None
        pid = sp["pid"]
        cpu0 = self.cpu_of(pid)   # its set-up is not the call's CPU time
        try:
            write_all(sp["go_w"], pack_request(req["code"], req.get("stdin", "")))
        except OSError:
            pass   # the spare died before its call (its report or exit status says how)
        os.close(sp["go_w"])
        out, err, report, wall, why, exited = self.supervise(sp["pidfd"], sp["out_r"], sp["err_r"], sp["res_r"],
                                                           req["timeout_s"])
        status, cpu = 0, max(0.0, self.cpu_of(pid) - cpu0)
        if why is not None or report is None:
            if why is not None:
                os.kill(pid, signal.SIGKILL)
            status, cpu = self.reap_cell(pid)
            self.cleanup_later = (None, sp["pidfd"])
        else:
            self.cleanup_later = (pid, sp["pidfd"])   # reply first; kill, reap and sweep after
        return self.classify(out, err, report, wall, why, status, cpu)

    def cleanup(self):
        """After a stateless reply went out: end the cell, sweep, and prepare the next one."""
        reap = 0
        if self.cleanup_later is not None:
            pid, pidfd = self.cleanup_later
            self.cleanup_later = None
            if pid is not None:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                # dead (a zombie of the fork server, which reaps it with the next fork), so nothing of it
                # runs during the sweep; its children are ours now and the sweep ends them
                _readable(pidfd, 10.0)
                reap = pid
            os.close(pidfd)
            if not self.sweep(reap):
                self.dirty = "processes survived the sweep after a call"
        if self.dirty is None:
            self.prefork(reap)
        elif reap:
            self.reap_cell(reap)

    def new_holder(self, sid):
        parent, child = socketpair()
        cwd = self.scratch("s-" + str(abs(hash(sid)) % 10**12))
        pid = os.fork()
        if pid == 0:
            parent.close()
            os.close(self.ctl_in)
            os.close(self.ctl_out)
            for h in self.holders.values():
                h["sock"].close()
            if self.zygote is not None:
                self.zygote[1].close()
            for sig in _IGNORED:
                signal.signal(sig, signal.SIG_DFL)
            os.setsid()
            try:
                holder_loop(child, {"__name__": "__main__", "__builtins__": __builtins__}, self.lim, self.base_vm)
            finally:
                os._exit(0)
        child.close()
        parent.settimeout(None)
        self.holders[sid] = h = {"pid": pid, "sock": parent, "cwd": cwd, "buf": b""}
        return h

    def holder_msg(self, h, timeout):
        """One newline-delimited JSON message from a holder (the holder side, not user code, writes these;
        user code in the current cell could write too, so callers check what they get)."""
        deadline = time.monotonic() + timeout
        while b"\n" not in h["buf"]:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            h["sock"].settimeout(left)
            try:
                data = h["sock"].recv(65536)
            except (TimeoutError, OSError):
                return None
            if not data:
                return None
            h["buf"] += data
        line, h["buf"] = h["buf"].split(b"\n", 1)
        try:
            msg = json.loads(line)
        except ValueError:
            return None
        return msg if isinstance(msg, dict) else None

    def run_session(self, sid, req):
        note = None
        h = self.holders.get(sid)
        if h is None:
            note = self.lost.pop(sid, None)
            h = self.new_holder(sid)
            created = True
        else:
            created = False
        stdin_fd, (out_r, out_w), (err_r, err_w), (res_r, res_w) = self.pipes(req.get("stdin", ""))
        msg = json.dumps({"code": req["code"], "cwd": h["cwd"]}).encode()
        start = time.monotonic()
        try:
            send_fds(h["sock"], msg, [stdin_fd, out_w, err_w, res_w])
        finally:
            for fd in (stdin_fd, out_w, err_w, res_w):
                os.close(fd)
        forked = self.holder_msg(h, 5.0)
        cell = forked.get("forked") if forked else None
        pidfd = None
        if isinstance(cell, int) and cell > 1:
            try:
                pidfd = os.pidfd_open(cell)
            except ProcessLookupError:
                pidfd = os.eventfd(1)   # it already ended (and was reaped by the holder): "exited" at once
            else:
                if self.ppid(cell) not in (h["pid"], None):
                    os.close(pidfd)
                    pidfd = None   # not the holder's child: a garbled or forged message
        if pidfd is None:
            for fd in (out_r, err_r, res_r):
                os.close(fd)
            self.forget(sid, "session process stopped answering")
            self.lost.pop(sid, None)
            self.sweep()
            return {"status": "internal_error", "reason": "session process did not start the cell",
                    "stdout": "", "stderr": "", "wall_s": 0.0, "cpu_s": 0.0, "session_alive": False}
        out, err, report, wall, why, exited = self.supervise(pidfd, out_r, err_r, res_r, req["timeout_s"], start)
        os.close(pidfd)
        ok = why is None and not exited and report is not None and report.get("pid") == cell
        status, cpu = 0, self.cpu_of(cell)
        if ok:
            # the cell's process carries the new state: it becomes the holder, the old one goes
            os.kill(h["pid"], signal.SIGKILL)
            h["pid"] = cell
            h["buf"] = b""
        else:
            try:
                os.kill(cell, signal.SIGKILL)
            except ProcessLookupError:
                pass
            died = None
            for _ in range(4):   # the holder reports how the cell ended (it is the cell's parent)
                died = self.holder_msg(h, 2.0)
                if died is None or died.get("died") == cell:
                    break
            if died is None or died.get("died") != cell:
                self.forget(sid, "session process stopped answering after a failed cell")
            else:
                status = died.get("status", 0)
                cpu = float(died.get("cpu_s", cpu))
        if not self.sweep():
            self.dirty = "processes survived the sweep after a session cell"
        result = self.classify(out, err, report if ok or exited else None, wall, why, status, cpu)
        alive = sid in self.holders
        result["session_alive"] = alive
        result["session_created"] = created
        result["session_rolled_back"] = not ok and alive
        if note:
            result["session_note"] = note
        if alive:
            result["session_pss"] = self.anon_bytes(h["pid"])
        return result

    @staticmethod
    def ppid(pid):
        try:
            with open(f"/proc/{pid}/stat") as f:
                return int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return None

    @staticmethod
    def cpu_of(pid):
        """CPU seconds of a live (or zombie) process and its reaped children. Precise (schedstat, ns) for
        the live threads; a cell that already began to exit has lost its other threads from /proc/<pid>/task,
        so the process-wide utime + stime (ticks, dead threads included) is the floor."""
        try:
            fields = _read_proc(f"/proc/{pid}/stat").rsplit(b")", 1)[1].split()
            children = (int(fields[13]) + int(fields[14])) / _TICK
            ticks = (int(fields[11]) + int(fields[12])) / _TICK
            if int(fields[17]) == 1:   # one thread (the usual cell): its schedstat is the process's
                live = int(_read_proc(f"/proc/{pid}/schedstat").split()[0]) / 1e9
            else:
                live = 0.0
                for tid in os.listdir(f"/proc/{pid}/task"):
                    try:
                        live += int(_read_proc(f"/proc/{pid}/task/{tid}/schedstat").split()[0]) / 1e9
                    except OSError:
                        pass   # that thread just ended: the ticks floor below still counts it
            return children + max(live, ticks)
        except (OSError, ValueError, IndexError):
            return 0.0

    def classify(self, out, err, report, wall, why, status, cpu):
        lim = self.lim
        r = {"stdout": out.text(), "stderr": err.text(), "stdout_bytes": out.total, "stderr_bytes": err.total,
             "wall_s": round(wall, 6), "cpu_s": round(cpu, 6), "exc_type": None, "traceback": None,
             "reason": None, "exit_code": None, "signal": None}
        truncated = out.truncated or err.truncated
        if report and report.get("exc_type"):
            r["exc_type"] = str(report["exc_type"])[:200]
            r["traceback"] = str(report.get("traceback") or "")[-20000:]
            r["lineno"] = report.get("lineno")
        if report and report.get("internal"):
            r["status"], r["reason"] = "internal_error", str(report["internal"])[:500]
            return r
        if os.WIFSIGNALED(status):
            r["signal"] = signal.Signals(os.WTERMSIG(status)).name if os.WTERMSIG(status) in signal.valid_signals() \
                else str(os.WTERMSIG(status))
        elif os.WIFEXITED(status):
            r["exit_code"] = os.WEXITSTATUS(status)
        if why == "timeout":
            r["status"], r["reason"] = "timeout", f"wall time limit ({round(wall, 2)} s) exceeded; killed"
        elif why == "output":
            r["status"] = "output_truncated"
            r["reason"] = f"output exceeded {lim['output_kill_bytes']} bytes; killed"
        elif r["signal"] in ("SIGXCPU",) or (r["signal"] == "SIGKILL" and cpu >= lim["cpu_time_s"] - 0.05):
            r["status"], r["reason"] = "timeout", f"CPU time limit ({lim['cpu_time_s']} s) exceeded; killed"
        elif r["signal"]:
            r["status"], r["reason"] = "killed", f"killed by {r['signal']}"
        elif report is None and r["exit_code"] not in (0, None):
            r["status"], r["reason"] = "error", f"exited with code {r['exit_code']}"
        elif report is None and r["exit_code"] is None:
            r["status"], r["reason"] = "killed", "the cell ended without a result"
        elif report and report.get("memory"):
            r["status"], r["reason"] = "memory", f"memory limit ({lim['memory_mb']} MiB) exceeded"
        elif report and report.get("exc_type") and not report.get("clean_exit"):
            r["status"] = "error"
        elif truncated:
            r["status"] = "output_truncated"
            r["reason"] = f"output longer than {lim['max_output_bytes']} bytes; head and tail kept"
        else:
            r["status"] = "ok"
        return r

    # -- main loop
    def serve(self):
        while True:
            req = read_frame(self.ctl_in)
            if req is None:
                return
            op = req.get("op")
            if op == "exec" and self.dirty:
                reply = {"refused": self.dirty}   # nothing ran: the service replaces us and resends
            elif op == "exec":
                reply = self.run(req)
            elif op == "drop":
                self.forget(req["session"], "evicted")
                self.lost.pop(req["session"], None)
                self.sweep()
                reply = {"ok": True}
            elif op == "ping":
                self.reap()
                reply = {"ok": True, "sessions": len(self.holders)}
            else:
                reply = {"status": "internal_error", "reason": f"unknown op {op!r}"}
            reply["lost_sessions"], self.lost = self.lost, {}
            write_frame(self.ctl_out, reply)
            self.cleanup()


def main():
    # the service's pipes move to private fds; 0/1 become /dev/null so nothing can write into the protocol
    ctl_in, ctl_out = os.dup(0), os.dup(1)
    null = os.open("/dev/null", os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    for sig in _IGNORED:
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
    srv = Server(ctl_in, ctl_out, init)
    warm_cell_path()
    reseed()   # numpy's first seed() builds lazily-initialised state (seconds); pay it once, here
    gc.collect()
    gc.freeze()   # children then never touch the pre-imported objects' GC headers: fewer copy-on-write pages
    srv.base_vm = srv.vm_size()
    srv.base_anon = srv.anon_bytes(os.getpid())
    global _LIMIT_PLAN
    _LIMIT_PLAN = limit_plan(srv.lim, srv.base_vm)
    modules = sorted({m.partition(".")[0] for m in sys.modules})   # what cells find loaded: the fork server's
    srv.start_zygote()
    srv.prefork()
    write_frame(ctl_out, {"op": "ready", "pid": os.getpid(), "uid": os.getuid(), "vm_size": srv.base_vm,
                          "preloaded": [m for m in init.get("preload", []) if m in sys.modules],
                          "modules": modules})
    srv.serve()


if __name__ == "__main__":
    main()
