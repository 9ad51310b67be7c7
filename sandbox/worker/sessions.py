"""pid 1's table of sessions: each session's holder (the process with its state) and its channel, the cell
protocol with it, and the rendezvous a holder's successor reaches pid 1 through (holders.py is the other side)."""
import _socket
import json
import os
import signal
import struct
import time

from . import settings
from .boot import become
from .framing import send_session_request, socketpair, write_all
from .holders import holder_loop
from .procfs import ppid, status_kb
from .scratch import make_workdir, rmtree
from .script import new_main


class Sessions:
    def __init__(self, server):
        self.server = server   # supervision, sweeping and the result come from pid 1's server
        self.holders = {}      # session -> {"pid", "sock", "cwd", "buf", "cells"}
        self.lost = {}         # session -> why its holder vanished outside a call
        self.listener = None   # the rendezvous (listen), made with the first session
        self.base_anon = 0     # the warm interpreter's anonymous memory: a session's growth is beyond it

    # -- bookkeeping
    def pids(self):
        return {h["pid"] for h in self.holders.values()}

    def dirs(self):
        return {h["cwd"] for h in self.holders.values()}

    def close_in_child(self):
        """In a child forked from pid 1 (the fork server): none of the sessions' channels stay open there."""
        for h in self.holders.values():
            h["sock"].close()
        if self.listener is not None:
            self.listener.close()

    def died(self, pid):
        """pid 1 reaped `pid`: if it was a holder, its session is lost."""
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
        rmtree(h["cwd"])

    def drop(self, sid):
        self.forget(sid, "evicted")
        self.lost.pop(sid, None)

    def take_lost(self):
        lost, self.lost = self.lost, {}
        return lost

    def memory(self, pid):
        """Anonymous memory of a holder beyond what the warm interpreter had: a session's own growth.
        (smaps_rollup's PSS would be better, but it is closed to us: sandbox processes are non-dumpable.)"""
        return max(0, status_kb(pid, "RssAnon") - self.base_anon)

    # -- the rendezvous
    def listen(self):
        """The rendezvous a session's next holder connects to (holders.continue_session): an abstract Unix
        socket, private to the sandbox's network namespace. Who connected is known from the kernel
        (SO_PEERCRED), and a connection counts only from the child a session cell forked as its last act."""
        if self.listener is None:
            self.listener = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
            settings.HOLDER_ADDRESS = b"\0rstar-sandbox-holder-" + os.urandom(8).hex().encode()
            self.listener.bind(settings.HOLDER_ADDRESS)
            self.listener.listen(64)
            self.listener.setblocking(False)

    def pending(self):
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

    def drain(self):
        """Close what waits on the rendezvous between calls: a cell that connected (say, to fill the backlog
        or to pose as a later cell's holder) gets nothing, and its connection is gone before the next call."""
        for conn, _ in self.pending():
            conn.close()

    def successor(self, cell, known):
        """The next holder of a session whose cell `cell` ran to its end: the last connection whose peer is a
        child of that cell, now ours (its parent exited), and no process we already know. Others are closed.
        (A child the cell's own code forked could pose as it: code of a session can always shape the later
        cells of that session, as in any notebook; never another session's or a stateless call's.)"""
        known = known | self.pids() | {cell}
        chosen = None
        for conn, pid in self.pending():   # the last one: the cell's own code had finished by then
            if pid not in known and ppid(pid) == 1:
                if chosen is not None:
                    chosen[0].close()
                chosen = (conn, pid)
            else:
                conn.close()
        return chosen

    # -- holders
    def new_holder(self, sid):
        """Fork the first holder of a session from this (warm) process: it keeps the session's channel and
        nothing else of ours."""
        self.listen()
        parent, child = socketpair()
        cwd = make_workdir("s-" + str(abs(hash(sid)) % 10**12))
        pid = os.fork()
        if pid == 0:
            null = os.open("/dev/null", os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            lo = 3
            for fd in (child.fileno(), 65536):
                os.closerange(lo, fd)
                lo = fd + 1
            for sig in settings.IGNORED:
                signal.signal(sig, signal.SIG_DFL)
            os.setsid()
            become(holder_loop, child, new_main(os.path.join(cwd, settings.SCRIPT)))
        child.close()
        self.holders[sid] = h = {"pid": pid, "sock": parent, "cwd": cwd, "buf": b"", "cells": 0}
        return h

    @staticmethod
    def message(h, timeout):
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

    # -- one cell
    def run(self, sid, req):
        """One cell of a session: the holder forks it and reports its exit status; a cell that ran to its end
        forked the next holder (the state it left), a cell that died did not, and the state from before it
        stays (the cell is rolled back)."""
        srv = self.server
        note = None
        h = self.holders.get(sid)
        created = h is None
        if created:
            note = self.lost.pop(sid, None)
            h = self.new_holder(sid)
        h["cells"] += 1
        stdin_fd, (out_r, out_w), (err_r, err_w) = cell_pipes(req.get("stdin", ""))
        msg = {"code": req["code"], "cwd": h["cwd"], "filename": f"<cell {h['cells']}>"}
        start = time.monotonic()
        try:
            send_session_request(h["sock"], msg, [stdin_fd, out_w, err_w])
        except OSError:
            pass   # a holder that died between calls: it sends no "forked" below
        finally:
            for fd in (stdin_fd, out_w, err_w):
                os.close(fd)
        # the holder answers at once unless the node is starved of CPU: wait for it up to the call's deadline
        # (a dead holder closes its channel, which ends the wait at once)
        def left():
            return max(2.0, start + req["timeout_s"] - time.monotonic())

        cell, pidfd = self.forked(h, left())
        if pidfd is None:
            for fd in (out_r, err_r):
                os.close(fd)
            self.forget(sid, "session process stopped answering")
            self.lost.pop(sid, None)
            srv.sweep()
            return {"status": "internal_error", "reason": "session process did not start the cell",
                    "stdout": "", "stderr": "", "wall_s": 0.0, "cpu_s": 0.0, "session_alive": False}
        out, err, wall, why = srv.supervise((pidfd,), out_r, err_r, req["timeout_s"], start)
        os.close(pidfd)
        if why is not None:
            try:
                os.kill(cell, signal.SIGKILL)
            except ProcessLookupError:
                pass
        status, cpu = self.ended(sid, h, cell, left())
        nxt = self.successor(cell, srv.own_pids()) if why is None and sid in self.holders else None
        if nxt is not None:
            # the cell's child carries the state the cell left: it is the holder now, the old one goes
            conn, pid = nxt
            try:
                os.kill(h["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
            h["sock"].close()
            h.update(pid=pid, sock=conn, buf=b"")
        if not srv.sweep():
            srv.dirty = "processes survived the sweep after a session cell"
        result = srv.classify(out, err, wall, why, status, cpu)
        alive = sid in self.holders
        result.update(session_alive=alive, session_created=created, session_rolled_back=nxt is None and alive)
        if note:
            result["session_note"] = note
        if alive:
            result["session_pss"] = self.memory(h["pid"])
        return result

    def forked(self, h, wait):
        """(pid, pidfd) of the cell the holder says it forked; (None, None) if it said nothing usable."""
        msg = self.message(h, wait)
        cell = msg.get("forked") if msg else None
        if not (isinstance(cell, int) and cell > 1):
            return None, None
        # a quick cell can run to its end and be reaped by the holder before this line on a busy node: a pid
        # already gone is that cell, "exited" at once (its output waits in the pipes; its status comes next).
        # A live one must be the holder's child: the pidfd, taken first, keeps the check about that process
        try:
            pidfd = os.pidfd_open(cell)
        except ProcessLookupError:
            return cell, os.eventfd(1)
        parent = ppid(cell)
        if parent is None:   # reaped between the two reads
            return cell, pidfd
        if parent != h["pid"]:
            os.close(pidfd)
            return None, None
        return cell, pidfd

    def ended(self, sid, h, cell, wait):
        """(wait status, CPU s) the holder reports for its cell; (None, CPU s) if it did not (it is dropped)."""
        from .procfs import cpu_of
        msg = None
        deadline = time.monotonic() + wait
        for _ in range(4):   # the holder is the cell's parent: it reports the exit status
            msg = self.message(h, max(0.1, deadline - time.monotonic()))
            if msg is None or msg.get("ended") == cell:
                break
        if msg is None or msg.get("ended") != cell or not isinstance(msg.get("status"), int):
            self.forget(sid, "session process stopped answering after a cell")
            return None, cpu_of(cell)
        return msg["status"], float(msg.get("cpu_s") or 0.0)


def cell_pipes(stdin):
    """A session cell's stdin (a file, not a pipe: any size without a writer loop), stdout and stderr."""
    fd = os.memfd_create("stdin", 0)
    write_all(fd, stdin.encode("utf-8", "replace"))
    os.lseek(fd, 0, 0)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    for r in (out_r, err_r):
        os.set_blocking(r, False)
    return fd, (out_r, out_w), (err_r, err_w)
