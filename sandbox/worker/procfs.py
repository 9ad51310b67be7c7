"""What pid 1 reads in /proc about the sandbox's processes: a process's parent, CPU time, memory."""
import os

from .framing import read_proc
from .settings import TICK


def ppid(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def cpu_of(pid):
    """CPU seconds of a live (or zombie) process and its reaped children. Precise (schedstat, ns) for the live
    threads; a cell that already began to exit has lost its other threads from /proc/<pid>/task, so the
    process-wide utime + stime (ticks, dead threads included) is the floor."""
    try:
        fields = read_proc(f"/proc/{pid}/stat").rsplit(b")", 1)[1].split()
        children = (int(fields[13]) + int(fields[14])) / TICK
        ticks = (int(fields[11]) + int(fields[12])) / TICK
        if int(fields[17]) == 1:   # one thread (the usual cell): its schedstat is the process's
            live = int(read_proc(f"/proc/{pid}/schedstat").split()[0]) / 1e9
        else:
            live = 0.0
            for tid in os.listdir(f"/proc/{pid}/task"):
                try:
                    live += int(read_proc(f"/proc/{pid}/task/{tid}/schedstat").split()[0]) / 1e9
                except OSError:
                    pass   # that thread just ended: the ticks floor below still counts it
        return children + max(live, ticks)
    except (OSError, ValueError, IndexError):
        return 0.0


def status_kb(pid, key):
    """A /proc/<pid>/status field in bytes ("VmSize", "RssAnon", ...); 0 if unreadable."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
