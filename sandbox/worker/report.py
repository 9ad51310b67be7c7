"""A cell's result from what its process did (pid 1): its wait status, the limit pid 1 enforced, its output.
The exception fields are read from the traceback the interpreter printed, for display only: no text a cell
writes decides its status."""
import os
import signal

from . import settings

_TB_HEAD = "Traceback (most recent call last):"
_SYNTAX = ("SyntaxError", "IndentationError", "TabError")


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


def uncaught(stderr):
    """exc_type, traceback and lineno of the uncaught exception the cell's interpreter printed last, for the
    result's display fields; {} when stderr ends with none (sys.exit("message"), a cell that printed and
    exited)."""
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
            if path.endswith("/" + settings.SCRIPT) or path.startswith("<cell"):
                digits = rest.partition(",")[0]
                lineno = int(digits) if digits.isdigit() else lineno
    return {"exc_type": name.rpartition(".")[2][:200], "traceback": tb[-20000:], "lineno": lineno}


def limit_hit(exc_type, stderr, lim):
    """A clear reason when a cell failed on one of the sandbox's limits rather than on its own logic (where
    the sandbox must differ from a plain `python3`, it says so)."""
    last = stderr.rstrip("\n").rpartition("\n")[2]
    processes = f"process limit: at most {lim['nproc']} processes and threads in the sandbox"
    for marker, why in (
            ("[Errno 11]", processes), ("can't start new thread", processes),
            ("[Errno 24]", f"open files limit: at most {lim['open_files']} descriptors"),
            ("[Errno 27]", f"file size limit: files of at most {lim['file_size_mb']} MiB"),
            ("[Errno 28]", f"scratch space limit: {lim.get('scratch_mb', '?')} MiB for the work dir, /tmp and "
                           "/dev/shm"),
            ("[Errno 30]", "only the work dir, /tmp and /dev/shm are writable in the sandbox"),
            ("[Errno 101]", "no network in the sandbox"), ("[Errno -3]", "no network in the sandbox"),
            ("[Errno -2]", "no network in the sandbox"), ("[Errno 111]", "no network in the sandbox")):
        if marker in last:
            return f"{exc_type}: sandbox limit ({why})"
    return None


def classify(lim, out, err, wall, why, status, cpu):
    """The result of a cell from what its process did: the wait status (`status`, None if it was lost), why
    pid 1 stopped it (`why`: timeout, output), and its output captures."""
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
        r.update(uncaught(stderr))
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
