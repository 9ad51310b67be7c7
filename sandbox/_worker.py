"""The in-sandbox half: pid 1 of one bwrap sandbox, a warm fork server.

Runs as pid 1 inside bwrap (`--as-pid-1`), imported compiled by `python -I -u -B -c` (pool.py), so it must
stay stdlib-only apart from the libraries it pre-imports for user code. It speaks length-prefixed JSON on fds it
dups away from 0/1 (the service's pipes), never runs user code itself, and has no handler for any signal user
code could send, so inside its pid namespace it cannot be killed (pid_namespaces(7)). Each call runs in a fresh
forked child (stateless) or in a fork of the session's holder (stateful), as `python3 main.py` would run it
(run_cell, finish_script); limits are hard rlimits set in the child, the wall timer lives here, and after every
call everything but pid 1, the fork server, its pre-forked spare cell and live session holders is killed and
the call's scratch directory removed.

A cell holds no descriptor of ours: its stdin, stdout and stderr only. Its result is its exit status, which
its parent takes from the kernel (wait4) and reports; nothing the cell writes reaches a channel of ours.

Stateless cells are forked by a fork server, a child of pid 1 forked once from the warm interpreter, not
by pid 1 itself: a fork write-protects the forking process's whole heap, and pid 1's per-call work
(framing, supervision, sweeping) then paid ~200 copy-on-write faults per call. The fork server only
forks and reaps on request, and a cell that kills or stops it (it is the cell's parent) costs a
replacement at most.

Sessions: holder H keeps the state and a channel to pid 1. For a cell it forks C, which closes that channel
and runs the cell; H reports C's exit status. A cell that ran to its end (even with an exception) forks D,
its continuation with the state it left, and exits; D reaches pid 1 through the sandbox's holder rendezvous
(an abstract Unix socket; pid 1 knows D from the kernel's peer credentials) and is the holder from then on.
A cell that died (timeout, signal, os._exit, memory kill) forked no D: H still holds the state from before
the cell, which is rolled back, and the result says so.
"""
import _signal
import _socket
import ast
import atexit
import builtins
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

SCRIPT = "main.py"   # a cell runs as `python3 main.py` in its working directory
INTERRUPTED = -2     # run_cell's status for an uncaught KeyboardInterrupt (CPython then dies by SIGINT)
_AST_ONLY = ast.PyCF_ONLY_AST
_WORKER_FILE = sys._getframe().f_code.co_filename   # this module's frames, cut from tracebacks
_SourceFileLoader = sys.modules["_frozen_importlib_external"].SourceFileLoader   # what a script's __loader__ is
_HDR = struct.Struct(">I")
_REQ = struct.Struct(">II")     # a stateless cell's request: code bytes, stdin bytes
_ZREQ = struct.Struct("=i")     # pid 1 -> fork server: 0 = fork a spare (its fds attached), > 0 = reap this cell
_ZFORK = struct.Struct("=i")    # fork server -> pid 1: the new spare's pid (<= 0: the fork failed)
_ZEXIT = struct.Struct("=iid")  # fork server -> pid 1: a reaped cell's pid, wait status (-1: not ours), CPU s
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
_LIM = None          # pid 1's limits (the for_worker() dict), set before the first fork
_BASE_VM = 0         # the warm interpreter's address space, which RLIMIT_AS adds to
_HOLDER_ADDRESS = None   # the abstract socket a session's next holder reaches pid 1 on (Server.listen_holders)


# ---------------------------------------------------------------- every process's entry
class Become(BaseException):
    """Raised by a freshly forked child to leave the stack it inherited: boot() catches it and calls the
    target from the top. The fork server and each session holder start this way, so whatever depth they were
    forked at, they run at boot -> loop, and the cells they fork (called directly: unwinding costs a forked
    cell ~60 copy-on-write faults) always start at the same depth: 5 frames below a script's module frame,
    so a cell recurses 5 levels less deep than `python3 main.py` before RecursionError. Without it, a
    session's holders would nest one generation deeper with every cell."""

    def __init__(self, target, args):
        self.target, self.args = target, args


def become(target, *args):
    raise Become(target, args)


def boot():
    """pid 1's entry (pool.py runs it): main(), and in a forked child, the target it became."""
    try:
        return main()
    except Become as b:
        target, args = b.target, b.args
    while True:
        try:
            target(*args)
        except Become as b:   # a child forked by the target (the fork server's cells, a cell's next holder)
            target, args = b.target, b.args
            continue
        except BaseException:
            pass
        _exit(0)


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


def send_session_request(sock, obj, fds):
    """A session cell's request to its holder: a length-prefixed JSON frame, the cell's descriptors attached
    to its first bytes (the channel is a stream socket, so a large frame arrives in pieces)."""
    body = json.dumps(obj).encode()
    data = _HDR.pack(len(body)) + body
    sock.settimeout(None)
    sent = sock.sendmsg([data], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS,
                                  b"".join(fd.to_bytes(4, sys.byteorder, signed=True) for fd in fds))])
    if sent < len(data):
        sock.sendall(data[sent:])


def recv_session_request(sock):
    """(request, fds) as send_session_request sent them; (None, fds) if the channel closed."""
    data, fds = recv_fds(sock, 65536, 8)
    while 0 < len(data) < _HDR.size:
        more = sock.recv(65536)
        if not more:
            return None, fds
        data += more
    if not data:
        return None, fds
    n = _HDR.unpack(data[:_HDR.size])[0]
    body = bytearray(data[_HDR.size:])
    while len(body) < n:
        more = sock.recv(min(1 << 20, n - len(body)))
        if not more:
            return None, fds
        body += more
    return json.loads(body), fds


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


def enter_cell(stdin_fd, out_w, err_w, lim, base_vm, cwd, keep=(), close_all=True):
    """Turn a freshly forked child into a sandboxed cell: own fds, signals, hard limits, RNGs, cwd.
    `close_all`: close every descriptor but 0, 1, 2 and `keep` (a stateless cell: it inherited only ours);
    a session's cell closes only the ones it was handed, and keeps the files earlier cells opened."""
    os.dup2(stdin_fd, 0)
    os.dup2(out_w, 1)
    os.dup2(err_w, 2)
    if close_all:
        lo = 0
        for fd in sorted({0, 1, 2, *keep}) + [65536]:
            if fd > lo:
                os.closerange(lo, fd)
            lo = fd + 1
    else:
        for fd in {stdin_fd, out_w, err_w} - {0, 1, 2}:
            os.close(fd)
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


# ---------------------------------------------------------------- running a cell the way `python3 main.py` would
def new_main(path):
    """A fresh `__main__` module, registered as sys.modules["__main__"], with what CPython gives a script run
    as `python3 main.py`: pickle and multiprocessing find cell-defined functions and classes through it."""
    mod = type(sys)("__main__")
    mod.__dict__.update(__file__=path, __builtins__=builtins, __cached__=None,
                        __loader__=_SourceFileLoader("__main__", path))
    sys.modules["__main__"] = mod
    return mod.__dict__


def enter_script(g, cwd, code, filename):
    """Point __main__, sys.argv, sys.path[0] and linecache at this cell's script `<cwd>/main.py`, written to
    disk as `python3 main.py` would find it (open(__file__), inspect, multiprocessing's spawn)."""
    path = os.path.join(cwd, SCRIPT)
    g["__file__"] = path
    sys.argv[:] = [SCRIPT]
    if not sys.path or sys.path[0] != cwd:
        sys.path.insert(0, cwd)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            write_all(fd, code.encode("utf-8", "surrogatepass"))
        finally:
            os.close(fd)
    except OSError:
        pass   # a file-size limit below the code's size: the cell still runs, from memory
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)


def _exit_status_of(exc):
    """The exit status CPython gives an uncaught SystemExit (Python/pythonrun.c, _Py_HandleSystemExit): None
    is 0, an int is its low byte as exit() keeps it (out of a C long's range it is -1), anything else is
    printed to stderr and the status is 1."""
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return (code if -2**63 <= code < 2**63 else -1) & 0xFF
    try:
        sys.stderr.write(str(code) + "\n")
    except Exception:
        pass
    return 1


def _print_uncaught(exc):
    """sys.excepthook, as CPython calls it for an uncaught exception, on a traceback without this module's
    frames (the cell's first frame is its module)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == _WORKER_FILE:
        tb = tb.tb_next
    exc.__traceback__ = tb
    try:
        sys.excepthook(type(exc), exc, tb)
    except BaseException as hook_error:   # CPython's words when the hook itself fails
        try:
            sys.stderr.write("Error in sys.excepthook:\n")
            traceback.print_exception(hook_error)
            sys.stderr.write("\nOriginal exception was:\n")
            traceback.print_exception(exc)
        except Exception:
            pass


def run_cell(code, g, filename, display):
    """Run one cell in module globals `g`; the exit status CPython would give a script that ends here
    (INTERRUPTED: an uncaught KeyboardInterrupt, which CPython turns into death by SIGINT). With `display`,
    a bare last expression's value is printed as repr(), as rStar2's tool and IPython do."""
    try:
        tree = compile(code, filename, "exec", _AST_ONLY)
        last = tree.body.pop() if display and tree.body and isinstance(tree.body[-1], ast.Expr) else None
        exec(compile(tree, filename, "exec"), g)
        if last is not None:
            value = eval(compile(ast.Expression(last.value), filename, "eval"), g)
            if value is not None:
                g["_"] = value
                sys.stdout.write(repr(value) + "\n")
        status = 0
    except SystemExit as e:
        status = _exit_status_of(e)
    except BaseException as e:   # noqa: B036 - what the interpreter does with any uncaught exception
        _print_uncaught(e)
        status = INTERRUPTED if isinstance(e, KeyboardInterrupt) else 1
    return status


def flush_std():
    """Flush stdout and stderr; 120 if stdout cannot be flushed (CPython's status for that), else 0."""
    bad = 0
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except Exception:
            bad = bad or (120 if stream is sys.stdout else 0)
    return bad


def finish_script(status):
    """What CPython does after the main module of a script, then exit: wait for non-daemon threads, run
    atexit callbacks, flush the standard streams, re-raise SIGINT for an uncaught KeyboardInterrupt."""
    try:
        threading = sys.modules.get("threading")
        if threading is not None:
            try:
                threading._shutdown()
            except BaseException:
                pass
        try:
            atexit._run_exitfuncs()
        except BaseException:
            pass
        status = flush_std() or status
        if status == INTERRUPTED:
            die_by_sigint()
    finally:
        _exit(130 if status == INTERRUPTED else status)


def die_by_sigint():
    _signal.signal(_signal.SIGINT, _signal.SIG_DFL)
    os.kill(os.getpid(), _signal.SIGINT)


# ---------------------------------------------------------------- session holders (each runs in a session's process)
def holder_loop(sock, g):
    """Serve the cells of one session. Runs in the process that holds the session's state, forked from pid 1
    for the first cell and, after that, from the cell before (see continue_session). Each cell runs in a
    child that keeps no descriptor of ours: its status is its exit status, which this process reports."""
    while True:
        try:
            req, fds = recv_session_request(sock)
        except (OSError, ValueError):
            _exit(0)
        if req is None or len(fds) != 3:
            _exit(0)
        stdin_fd, out_w, err_w = fds
        child = os.fork()
        if child == 0:
            sock.close()   # the session's channel: the one descriptor of ours this process holds
            session_cell(stdin_fd, out_w, err_w, req, g)   # never returns
        for fd in fds:
            os.close(fd)
        try:
            sock.sendall(b'{"forked": %d}\n' % child)
            _, status, ru = os.wait4(child, 0)
            sock.sendall(json.dumps({"ended": child, "status": status,
                                     "cpu_s": ru.ru_utime + ru.ru_stime}).encode() + b"\n")
        except OSError:
            _exit(0)


def session_cell(stdin_fd, out_w, err_w, req, g):
    """One cell of a session, in a child of its holder: the holder's state, the cell's descriptors only."""
    try:
        enter_cell(stdin_fd, out_w, err_w, _LIM, _BASE_VM, req["cwd"], close_all=False)
        enter_script(g, req["cwd"], req["code"], req["filename"])
    except BaseException as e:
        os.write(2, f"sandbox: cell setup failed: {e!r}\n".encode())
        _exit(1)
    continue_session(run_cell(req["code"], g, req["filename"], _LIM.get("display", True)), g)


def continue_session(status, g):
    """End a session cell that ran to its end: fork the session's next holder (it carries the state the cell
    left), let it reach pid 1 through the sandbox's holder rendezvous, then exit with the cell's status.
    The cell's process never held a channel to pid 1; its child gets one only after the cell's code is done
    (its threads are not carried over: fork copies the calling thread only)."""
    flush_std()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            null = os.open("/dev/null", os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            os.close(null)
            sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
            sock.settimeout(5.0)
            sock.connect(_HOLDER_ADDRESS)
            sock.settimeout(None)
            os.write(w, b"1")
            os.close(w)
        except BaseException:
            _exit(0)
        become(holder_loop, sock, g)
    os.close(w)
    try:
        os.read(r, 1)   # the next holder is registered (or gave up): only now may this cell end
    except OSError:
        pass
    if status == INTERRUPTED:
        die_by_sigint()
    _exit(130 if status == INTERRUPTED else status)


# ---------------------------------------------------------------- the fork server (a child of pid 1)
def spare_cell(null, out_w, err_w, go_r, lim, base_vm):
    """A freshly forked stateless cell: set up, wait for its one request, run it as `python3 main.py` would,
    exit with the status CPython would. It holds no descriptor of ours once the request is read."""
    path = os.path.join(SPARE_CWD, SCRIPT)
    try:
        enter_cell(null, out_w, err_w, lim, base_vm, SPARE_CWD, keep=(go_r,))
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
        g = new_main(path)
        enter_script(g, SPARE_CWD, code, path)
    except BaseException as e:
        os.write(2, f"sandbox: cell setup failed: {e!r}\n".encode())
        _exit(1)
    finish_script(run_cell(code, g, path, lim.get("display", True)))


def warm_cell_path(rounds=64):
    """Run a cell's own code path (compile, exec, display, tracebacks, exit status and request framing) here
    before the first fork, with output to /dev/null. CPython quickens and specializes bytecode in place
    and fills its type-attribute cache on first use: done once here, every forked cell finds it done
    instead of writing, and copy-on-write faulting, those pages again."""
    saved = os.dup(1), os.dup(2)
    null = os.open("/dev/null", os.O_WRONLY)
    r, w = os.pipe()
    os.dup2(null, 1)
    os.dup2(null, 2)
    main, argv, path0 = sys.modules.get("__main__"), list(sys.argv), list(sys.path)
    path = "/nonexistent/" + SCRIPT
    try:
        for _ in range(rounds):
            for code in ("_ = None", "print(1 + 1)", "x = [i * i for i in range(3)]\nx[-1]", "1 / 0",
                         "import sys\nsys.exit(2)"):
                linecache.cache[path] = (len(code), None, code.splitlines(True), path)
                run_cell(code, new_main(path), path, True)
                flush_std()
                write_all(w, pack_request(code, ""))
                read_request(r)
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, null, r, w):
            os.close(fd)
        linecache.cache.pop(path, None)
        sys.modules["__main__"], sys.argv[:], sys.path[:] = main, argv, path0


def zygote_loop(sock, null, lim, base_vm):
    """The fork server: forks stateless cells and reaps them (their wait status is the call's result), on
    pid 1's request. It does nothing else, so between two forks it writes (copy-on-write faults) only a
    handful of pages, and every cell forks from the same warm, untouched state. User code never runs here;
    its cells are its only children (the seccomp filter denies CLONE_PARENT)."""
    fork, wait4, close = os.fork, os.wait4, os.close
    while True:
        try:
            msg, fds = recv_fds(sock, 64, 4)
        except OSError:
            _exit(0)
        if len(msg) != _ZREQ.size:
            _exit(0)   # pid 1 closed its end (or spoke nonsense): nothing to serve
        (reap,) = _ZREQ.unpack(msg)
        if reap > 0:
            try:
                _, status, ru = wait4(reap, 0)
                reply = _ZEXIT.pack(reap, status, ru.ru_utime + ru.ru_stime)
            except ChildProcessError:
                reply = _ZEXIT.pack(reap, -1, 0.0)
        elif len(fds) == 3:
            try:
                pid = fork()
            except OSError:
                pid = -1
            if pid == 0:
                sock.close()
                spare_cell(null, *fds, lim, base_vm)   # never returns (called, not become(): see Become)
            reply = _ZFORK.pack(pid)
        else:
            reply = _ZFORK.pack(-1)
        for fd in fds:
            close(fd)
        try:
            sock.send(reply)
        except OSError:
            _exit(0)


# ---------------------------------------------------------------- reading what the interpreter printed (pid 1)
_TB_HEAD = "Traceback (most recent call last):"
_SYNTAX = ("SyntaxError", "IndentationError", "TabError")


def uncaught(stderr, interrupted=False):
    """exc_type, traceback and lineno of the uncaught exception the cell's interpreter printed last, for the
    result's display fields; {} when stderr ends with none (sys.exit("message"), a cell that printed and
    exited). Only display: the status comes from the exit status, never from this text."""
    text = stderr.rstrip("\n")
    last = text.rpartition("\n")[2]
    name = last.partition(":")[0]
    if not name or not name.replace(".", "").replace("_", "").isalnum():
        return {}
    start = text.rfind(_TB_HEAD)
    if start < 0 and name.rpartition(".")[2] in _SYNTAX:
        start = text.rfind('  File "')   # a script that does not compile: printed without the header
    if start < 0:
        return {}
    tb = text[start:]
    lineno = None
    for line in tb.split("\n"):
        if line.startswith('  File "'):
            path, _, rest = line[8:].partition('", line ')
            if path.endswith("/" + SCRIPT) or path.startswith("<cell"):
                digits = rest.partition(",")[0]
                lineno = int(digits) if digits.isdigit() else lineno
    return {"exc_type": name.rpartition(".")[2][:200], "traceback": tb[-20000:], "lineno": lineno}


def limit_hit(exc_type, stderr, lim):
    """A clear reason when a cell failed on one of the sandbox's limits rather than on its own logic (where
    the sandbox must differ from a plain `python3`, it says so)."""
    last = stderr.rstrip("\n").rpartition("\n")[2]
    for marker, why in (
            ("[Errno 11]", f"process limit: at most {lim['nproc']} processes and threads in the sandbox"),
            ("can't start new thread", f"process limit: at most {lim['nproc']} processes and threads in the sandbox"),
            ("[Errno 24]", f"open files limit: at most {lim['open_files']} descriptors"),
            ("[Errno 27]", f"file size limit: files of at most {lim['file_size_mb']} MiB"),
            ("[Errno 28]", f"scratch space limit: {lim.get('scratch_mb', '?')} MiB for the work dir, /tmp and /dev/shm"),
            ("[Errno 30]", "only the work dir, /tmp and /dev/shm are writable in the sandbox"),
            ("[Errno 101]", "no network in the sandbox"), ("[Errno -3]", "no network in the sandbox"),
            ("[Errno -2]", "no network in the sandbox"), ("[Errno 111]", "no network in the sandbox")):
        if marker in last:
            return f"{exc_type}: sandbox limit ({why})"
    return None


# ---------------------------------------------------------------- pid 1
class Server:
    def __init__(self, ctl_in, ctl_out, init):
        self.ctl_in, self.ctl_out = ctl_in, ctl_out
        self.lim = init["limits"]
        self.holders = {}   # session -> {"pid", "sock", "cwd", "buf", "cells"}
        self.lost = {}      # session -> why its holder vanished outside a call
        self.calls = 0
        self.base_vm = 0
        self.base_anon = 0
        self.spare = None          # the pre-forked next stateless cell
        self.cleanup_later = False  # the last stateless call's leftovers are swept after its reply
        self.dirty = None          # why this sandbox must not run another call
        self.null = None           # /dev/null, the stdin of pre-forked cells
        self.zygote = None         # (pid, socket) of the fork server
        self.listener = None       # the holder rendezvous (listen_holders), made with the first session
        # the sweep kills every process it can see and the wipe empties /tmp and /dev/shm: only where they are
        # the sandbox's own (pid 1 of its pid namespace, bwrap's hostname, /tmp a private mount). Pid 1 alone is
        # not enough: run as pid 1 of a bare `unshare -fp --mount-proc`, the worker wiped the host's /tmp
        self.in_sandbox = os.getpid() == 1 and os.uname().nodename == "sandbox" and os.path.ismount("/tmp")
        # what bwrap put into the scratch before any call (the directories leading to an interpreter bound
        # under /tmp, and the bind itself): never removed, and the wipe never descends into another mount
        self.skeleton = self.scan_skeleton() if self.in_sandbox else {}

    # -- bookkeeping
    def vm_size(self):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
        return 0

    @staticmethod
    def scan_skeleton():
        """{path: is a directory of the scratch tmpfs} for everything under /tmp and /dev/shm at start-up; a
        path on another device (an interpreter's read-only bind) maps to False and is never entered."""
        found = {}
        for root in ("/tmp", "/dev/shm"):
            dev = os.lstat(root).st_dev
            todo = [root]
            while todo:
                d = todo.pop()
                for entry in os.scandir(d):
                    st = entry.stat(follow_symlinks=False)
                    inside = st.st_dev == dev and entry.is_dir(follow_symlinks=False)
                    found[entry.path] = inside
                    if inside:
                        todo.append(entry.path)
        return found

    def sweep(self):
        """Kill every process but pid 1, the fork server, its spare cell and the session holders, then reap
        and wipe. A fork bomb keeps forking while we kill, so repeat until the table is clean."""
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
                self.drain_holders()
                return True
            time.sleep(0.001)
        return False

    def wipe(self, root=None):
        """Remove whatever the call left in the writable places, except live sessions' directories and the
        skeleton (scan_skeleton): nothing outside the scratch tmpfs is ever walked or deleted. Only the sweep
        calls it, after its in-sandbox check."""
        keep = {h["cwd"] for h in self.holders.values()}
        if self.spare is not None:
            keep.add(self.spare["cwd"])
        for top in (("/tmp", "/dev/shm") if root is None else (root,)):
            try:
                names = os.listdir(top)
            except OSError:
                continue
            for name in names:
                path = os.path.join(top, name)
                if path in keep:
                    continue
                if path in self.skeleton:
                    if self.skeleton[path]:
                        self.wipe(path)   # a directory leading to a bind: clean what a cell added in it
                    continue
                if os.path.isdir(path) and not os.path.islink(path):
                    try:
                        os.unlink(path + "/" + SCRIPT)   # the usual case: the call left only its script
                    except OSError:
                        pass
                    try:
                        os.rmdir(path)
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
        for r in (out_r, err_r):
            os.set_blocking(r, False)
        return fd, (out_r, out_w), (err_r, err_w)

    def supervise(self, done_fds, out_r, err_r, timeout, start=None, exited=None):
        """Collect output until the cell's process has exited (one of `done_fds` readable and `exited(fd)`
        true; by default they are the cell's pidfd), the wall deadline passes, or output floods. Whatever is
        already in the pipes when it ends is read too (its children may hold them open)."""
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
                    ended = True if exited is None else exited(fd)
                    if ended:
                        break
                    continue
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
            ours.close()
            for fd in (self.ctl_in, self.ctl_out):
                os.close(fd)
            for h in self.holders.values():
                h["sock"].close()
            if self.listener is not None:
                self.listener.close()
            become(zygote_loop, theirs, self.null, self.lim, self.base_vm)
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
        """One request to the fork server: reap cell `reap` (> 0; it is dead or being killed) or fork a spare
        on `fds`. The reply's fields ((pid, wait status, CPU s) or (new pid,)); None if the fork server
        failed (it is then replaced; a cell it had is now our child)."""
        if self.zygote is None:
            self.start_zygote()
        pid, sock = self.zygote
        try:
            os.kill(pid, signal.SIGCONT)   # a cell may have stopped it (it may signal its parent)
            msg = _ZREQ.pack(reap)
            if fds is None:
                sock.send(msg)
            else:
                send_fds(sock, msg, fds)
            if _readable(sock, 10.0):
                data = sock.recv(64)
                if len(data) == (_ZEXIT.size if reap else _ZFORK.size):
                    return (_ZEXIT if reap else _ZFORK).unpack(data)
        except OSError:
            pass
        self.stop_zygote()
        return None

    def reap_cell(self, pid):
        """(wait status, CPU seconds) of a stateless cell that has ended or is being killed; (None, 0.0) if
        its status was lost."""
        rep = self.zygote_call(reap=pid)
        if rep is not None and rep[1] >= 0:
            return rep[1], rep[2]
        try:   # the fork server died: the cell is our child now
            _, status, ru = os.wait4(pid, 0)
            return status, ru.ru_utime + ru.ru_stime
        except ChildProcessError:
            return None, 0.0

    def prefork(self):
        """Have the fork server fork and prepare the next stateless cell ahead of its request (limits, fds,
        RNGs, cwd), so a call's latency is exec + exit, not fork + setup. The child blocks reading its
        request."""
        if self.spare is not None:
            return
        cwd = self.scratch("call")
        pipes = [os.pipe() for _ in range(3)]   # stdout, stderr; the request
        (out_r, out_w), (err_r, err_w), (go_r, go_w) = pipes
        child_ends = [out_w, err_w, go_r]
        pid = 0
        for _ in range(2):   # a fork server that died (a cell may kill its parent) is replaced once
            rep = self.zygote_call(0, child_ends)
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

    def run_stateless(self, req):
        self.prefork()
        if self.spare is None:
            return {"status": "internal_error", "reason": self.dirty or "no cell could be forked"}
        sp, self.spare = self.spare, None
        pid = sp["pid"]
        if _readable(sp["pidfd"], 0):
            # the spare died before its request (nothing ran): an infrastructure fault, never a result
            for fd in (sp["out_r"], sp["err_r"], sp["go_w"], sp["pidfd"]):
                os.close(fd)
            self.reap_cell(pid)
            self.dirty = "the pre-forked cell died before its call"
            return {"status": "internal_error", "reason": self.dirty}
        cpu0 = self.cpu_of(pid)   # its set-up is not the call's CPU time
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

    # -- sessions
    def listen_holders(self):
        """The rendezvous a session's next holder connects to (continue_session): an abstract Unix socket,
        private to the sandbox's network namespace. Who connected is known from the kernel (SO_PEERCRED),
        and a connection counts only from the child a session cell forked as its last act (accept_holder)."""
        global _HOLDER_ADDRESS
        if self.listener is None:
            self.listener = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
            _HOLDER_ADDRESS = b"\0rstar-sandbox-holder-" + os.urandom(8).hex().encode()
            self.listener.bind(_HOLDER_ADDRESS)
            self.listener.listen(64)
            self.listener.setblocking(False)

    def pending_holders(self):
        """Every connection waiting on the rendezvous, as (socket, peer pid)."""
        conns = []
        while self.listener is not None:
            try:
                fd, _ = self.listener._accept()
            except (BlockingIOError, OSError):
                break
            conn = _socket.socket(fileno=fd)
            pid = struct.unpack("3i", conn.getsockopt(_socket.SOL_SOCKET, _socket.SO_PEERCRED, 12))[0]
            conns.append((conn, pid))
        return conns

    def drain_holders(self):
        """Close what waits on the rendezvous between calls: a cell that connected (say, to fill the backlog
        or to pose as a later cell's holder) gets nothing, and its connection is gone before the next call."""
        for conn, _ in self.pending_holders():
            conn.close()

    def accept_holder(self, cell):
        """The next holder of a session whose cell `cell` ran to its end: the last connection whose peer is a
        child of that cell, now ours (its parent exited), and no process we already know. Others are closed.
        (A child the cell's own code forked could pose as it: code of a session can always shape the later
        cells of that session, as in any notebook; never another session's or a stateless call's.)"""
        known = {h["pid"] for h in self.holders.values()} | {cell}
        if self.zygote is not None:
            known.add(self.zygote[0])
        chosen = None
        for conn, pid in self.pending_holders():   # the last one: the cell's own code had finished by then
            if pid not in known and self.ppid(pid) == 1:
                if chosen is not None:
                    chosen[0].close()
                chosen = (conn, pid)
            else:
                conn.close()
        return chosen

    def new_holder(self, sid):
        """Fork the first holder of a session from this (warm) process: it keeps the session's channel and
        nothing else of ours."""
        self.listen_holders()
        parent, child = socketpair()
        cwd = self.scratch("s-" + str(abs(hash(sid)) % 10**12))
        pid = os.fork()
        if pid == 0:
            null = os.open("/dev/null", os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            lo = 3
            for fd in (child.fileno(), 65536):
                os.closerange(lo, fd)
                lo = fd + 1
            for sig in _IGNORED:
                signal.signal(sig, signal.SIG_DFL)
            os.setsid()
            become(holder_loop, child, new_main(os.path.join(cwd, SCRIPT)))
        child.close()
        self.holders[sid] = h = {"pid": pid, "sock": parent, "cwd": cwd, "buf": b"", "cells": 0}
        return h

    def holder_msg(self, h, timeout):
        """One newline-delimited JSON message from a holder (its loop writes them; code of earlier cells of
        the same session runs in that process too, so callers check what they get)."""
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
        """One cell of a session: the holder forks it and reports its exit status; a cell that ran to its end
        forked the next holder (the state it left), a cell that died did not, and the state from before it
        stays (the cell is rolled back)."""
        note = None
        h = self.holders.get(sid)
        created = h is None
        if created:
            note = self.lost.pop(sid, None)
            h = self.new_holder(sid)
        h["cells"] += 1
        stdin_fd, (out_r, out_w), (err_r, err_w) = self.pipes(req.get("stdin", ""))
        msg = {"code": req["code"], "cwd": h["cwd"], "filename": f"<cell {h['cells']}>"}
        start = time.monotonic()
        try:
            send_session_request(h["sock"], msg, [stdin_fd, out_w, err_w])
        except OSError:
            pass   # a holder that died between calls: it sends no "forked" below
        finally:
            for fd in (stdin_fd, out_w, err_w):
                os.close(fd)
        forked = self.holder_msg(h, 5.0)
        cell = forked.get("forked") if forked else None
        pidfd = None
        if isinstance(cell, int) and cell > 1 and self.ppid(cell) == h["pid"]:
            try:
                pidfd = os.pidfd_open(cell)
            except ProcessLookupError:
                pidfd = os.eventfd(1)   # it already ended (and was reaped by the holder): "exited" at once
        if pidfd is None:
            for fd in (out_r, err_r):
                os.close(fd)
            self.forget(sid, "session process stopped answering")
            self.lost.pop(sid, None)
            self.sweep()
            return {"status": "internal_error", "reason": "session process did not start the cell",
                    "stdout": "", "stderr": "", "wall_s": 0.0, "cpu_s": 0.0, "session_alive": False}
        out, err, wall, why = self.supervise((pidfd,), out_r, err_r, req["timeout_s"], start)
        os.close(pidfd)
        if why is not None:
            try:
                os.kill(cell, signal.SIGKILL)
            except ProcessLookupError:
                pass
        ended = None
        for _ in range(4):   # the holder is the cell's parent: it reports the exit status
            ended = self.holder_msg(h, 2.0)
            if ended is None or ended.get("ended") == cell:
                break
        status, cpu = None, self.cpu_of(cell)
        if ended is None or ended.get("ended") != cell:
            self.forget(sid, "session process stopped answering after a cell")
        else:
            status, cpu = ended.get("status"), float(ended.get("cpu_s", cpu))
        nxt = self.accept_holder(cell) if why is None and sid in self.holders else None
        if nxt is not None:
            # the cell's child carries the state the cell left: it is the holder now, the old one goes
            conn, pid = nxt
            try:
                os.kill(h["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
            h["sock"].close()
            h.update(pid=pid, sock=conn, buf=b"")
        if not self.sweep():
            self.dirty = "processes survived the sweep after a session cell"
        result = self.classify(out, err, wall, why, status if isinstance(status, int) else None, cpu)
        alive = sid in self.holders
        result["session_alive"] = alive
        result["session_created"] = created
        result["session_rolled_back"] = nxt is None and alive
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

    def classify(self, out, err, wall, why, status, cpu):
        """The result of a cell from what its process did: the wait status (`status`, None if it was lost),
        why we stopped it (`why`), and its output. The exception fields are read from the traceback the
        interpreter printed, for display only: no text of the cell's decides its status."""
        lim = self.lim
        stderr = err.text()
        r = {"stdout": out.text(), "stderr": stderr, "stdout_bytes": out.total, "stderr_bytes": err.total,
             "wall_s": round(wall, 6), "cpu_s": round(cpu, 6), "exc_type": None, "traceback": None,
             "reason": None, "exit_code": None, "signal": None}
        if status is not None and os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
            r["signal"] = signal.Signals(sig).name if sig in signal.valid_signals() else str(sig)
        elif status is not None and os.WIFEXITED(status):
            r["exit_code"] = os.WEXITSTATUS(status)
        if (r["exit_code"] or r["signal"] == "SIGINT") and why is None:
            r.update(uncaught(stderr, r["signal"] == "SIGINT"))
        limit = limit_hit(r["exc_type"], stderr, lim) if r["exc_type"] else None
        if why == "timeout":
            r["status"], r["reason"] = "timeout", f"wall time limit ({round(wall, 2)} s) exceeded; killed"
        elif why == "output":
            r["status"] = "output_truncated"
            r["reason"] = f"output exceeded {lim['output_kill_bytes']} bytes; killed"
        elif status is None:
            r["status"], r["reason"] = "internal_error", "the cell's exit status was lost"
        elif r["signal"] == "SIGXCPU" or (r["signal"] == "SIGKILL" and cpu >= lim["cpu_time_s"] - 0.05):
            r["status"], r["reason"] = "timeout", f"CPU time limit ({lim['cpu_time_s']} s) exceeded; killed"
        elif r["signal"] == "SIGINT":
            r["status"], r["reason"] = "error", "KeyboardInterrupt: the process ended by SIGINT, as CPython's does"
        elif r["signal"]:
            r["status"], r["reason"] = "killed", f"killed by {r['signal']}"
        elif (r["exc_type"] or "").endswith("MemoryError"):   # numpy raises _ArrayMemoryError, a subclass
            r["status"], r["reason"] = "memory", f"memory limit ({lim['memory_mb']} MiB) exceeded"
        elif r["exit_code"]:
            r["status"] = "error"
            r["reason"] = limit or f"exited with code {r['exit_code']}"
        elif out.truncated or err.truncated:
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
    global _LIM, _LIMIT_PLAN, _BASE_VM
    _LIM = init["limits"]
    srv = Server(ctl_in, ctl_out, init)
    warm_cell_path()
    atexit._clear()   # the preloaded libraries' exit hooks are not the cell's: a cell runs only its own
    reseed()   # numpy's first seed() builds lazily-initialised state (seconds); pay it once, here
    gc.collect()
    gc.freeze()   # children then never touch the pre-imported objects' GC headers: fewer copy-on-write pages
    srv.base_vm = srv.vm_size()
    srv.base_anon = srv.anon_bytes(os.getpid())
    _BASE_VM = srv.base_vm
    _LIMIT_PLAN = limit_plan(srv.lim, srv.base_vm)
    modules = sorted({m.partition(".")[0] for m in sys.modules})   # what cells find loaded: the fork server's
    srv.start_zygote()
    srv.prefork()
    write_frame(ctl_out, {"op": "ready", "pid": os.getpid(), "uid": os.getuid(), "vm_size": srv.base_vm,
                          "preloaded": [m for m in init.get("preload", []) if m in sys.modules],
                          "modules": modules})
    srv.serve()


if __name__ == "__main__":
    boot()
