"""A session's processes: the holder, which keeps the session's state; the cell it forks for each request, which
holds no channel of ours; and the next holder, forked by a cell that ran to its end."""
import _socket
import json
import os

from . import settings
from .boot import become
from .cell import enter_cell
from .framing import recv_session_request
from .script import die_by_sigint, enter_script, flush_std, run_cell


def holder_loop(sock, g):
    """Serve the cells of one session. Runs in the process that holds the session's state, forked from pid 1
    for the first cell and, after that, from the cell before (see continue_session). Each cell runs in a
    child that keeps no descriptor of ours: its status is its exit status, which this process reports."""
    while True:
        try:
            req, fds = recv_session_request(sock)
        except (OSError, ValueError):
            settings.exit_now(0)
        if req is None or len(fds) != 3:
            settings.exit_now(0)
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
            settings.exit_now(0)


def session_cell(stdin_fd, out_w, err_w, req, g):
    """One cell of a session, in a child of its holder: the holder's state, the cell's descriptors only."""
    try:
        enter_cell(stdin_fd, out_w, err_w, req["cwd"], close_all=False)
        enter_script(g, req["cwd"], req["code"], req["filename"])
    except BaseException as e:
        os.write(2, f"sandbox: cell setup failed: {e!r}\n".encode())
        settings.exit_now(1)
    continue_session(run_cell(req["code"], g, req["filename"], settings.LIM.get("display", True)), g)


def continue_session(status, g):
    """End a session cell that ran to its end: fork the session's next holder (it carries the state the cell
    left), let it reach pid 1 through the sandbox's holder rendezvous, then exit with the cell's status.
    The cell's process never held a channel to pid 1; its child gets one only after the cell's code is done
    (its threads are not carried over: fork copies the calling thread only)."""
    flush_std()
    r, w = os.pipe()
    try:
        pid = os.fork()
    except OSError:   # no process left for a next holder (the sandbox's process limit): pid 1 rolls the session
        pid = -1      # back to the state before this cell, and the cell's own status still stands
    if pid == 0:
        try:
            os.close(r)
            null = os.open("/dev/null", os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            os.close(null)
            sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
            sock.settimeout(5.0)
            sock.connect(settings.HOLDER_ADDRESS)
            sock.settimeout(None)
            os.write(w, b"1")
            os.close(w)
        except BaseException:
            settings.exit_now(0)
        become(holder_loop, sock, g)
    os.close(w)
    try:
        os.read(r, 1)   # the next holder is registered (or gave up): only now may this cell end
    except OSError:
        pass
    if status == settings.INTERRUPTED:
        die_by_sigint()
    settings.exit_now(130 if status == settings.INTERRUPTED else status)
