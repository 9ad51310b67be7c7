"""The fork server, a child of pid 1 forked once from the warm interpreter, and the stateless cells it forks:
each is prepared ahead of its request (a spare), runs it as `python3 main.py` would, and exits with the status
CPython would give; the fork server reaps it for pid 1."""
import linecache
import os
import sys

from . import settings
from .cell import enter_cell
from .framing import pack_request, read_request, recv_fds, write_all
from .script import enter_script, finish_script, flush_std, new_main, run_cell


def spare_cell(null, out_w, err_w, go_r):
    """A freshly forked stateless cell: set up, wait for its one request, run it as `python3 main.py` would,
    exit with the status CPython would. It holds no descriptor of ours once the request is read."""
    path = os.path.join(settings.SPARE_CWD, settings.SCRIPT)
    try:
        enter_cell(null, out_w, err_w, settings.SPARE_CWD, keep=(go_r,))
        req = read_request(go_r)
        os.close(go_r)
        if req is None:
            settings.exit_now(0)
        code, stdin = req
        if stdin:
            fd = os.memfd_create("stdin", 0)   # a file, not a pipe: any size, no writer needed
            write_all(fd, stdin)
            os.lseek(fd, 0, 0)
            os.dup2(fd, 0)
            os.close(fd)
        g = new_main(path)
        enter_script(g, settings.SPARE_CWD, code, path)
    except BaseException as e:
        os.write(2, f"sandbox: cell setup failed: {e!r}\n".encode())
        settings.exit_now(1)
    finish_script(run_cell(code, g, path, settings.LIM.get("display", True)))


def warm_cell_path(rounds=64):
    """Run a cell's own code path (compile, exec, display, tracebacks, exit status and request framing) in pid 1
    before the first fork, with output to /dev/null. CPython quickens and specializes bytecode in place and
    fills its type-attribute cache on first use: done once here, every forked cell finds it done instead of
    writing, and copy-on-write faulting, those pages again."""
    saved = os.dup(1), os.dup(2)
    null = os.open("/dev/null", os.O_WRONLY)
    r, w = os.pipe()
    os.dup2(null, 1)
    os.dup2(null, 2)
    main, argv, path0 = sys.modules.get("__main__"), list(sys.argv), list(sys.path)
    path = "/nonexistent/" + settings.SCRIPT
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


def fork_server_loop(sock, null):
    """The fork server: forks stateless cells and reaps them (their wait status is the call's result), on
    pid 1's request. It does nothing else, so between two forks it writes (copy-on-write faults) only a
    handful of pages, and every cell forks from the same warm, untouched state. User code never runs here;
    its cells are its only children (the seccomp filter denies CLONE_PARENT)."""
    fork, wait4, close = os.fork, os.wait4, os.close
    request, reaped, forked = settings.FORK_SERVER_REQUEST, settings.REAPED, settings.FORKED
    while True:
        try:
            msg, fds = recv_fds(sock, 64, 4)
        except OSError:
            settings.exit_now(0)
        if len(msg) != request.size:
            settings.exit_now(0)   # pid 1 closed its end (or spoke nonsense): nothing to serve
        (reap,) = request.unpack(msg)
        if reap > 0:
            try:
                _, status, ru = wait4(reap, 0)
                reply = reaped.pack(reap, status, ru.ru_utime + ru.ru_stime)
            except ChildProcessError:
                reply = reaped.pack(reap, -1, 0.0)
        elif len(fds) == 3:
            try:
                pid = fork()
            except OSError:
                pid = -1
            if pid == 0:
                sock.close()
                spare_cell(null, *fds)   # never returns (called, not become(): see boot.Become)
            reply = forked.pack(pid)
        else:
            reply = forked.pack(-1)
        for fd in fds:
            close(fd)
        try:
            sock.send(reply)
        except OSError:
            settings.exit_now(0)
