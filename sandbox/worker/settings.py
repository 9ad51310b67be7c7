"""What every process of a sandbox shares: names, message formats, and the settings pid 1 fixes before its
first fork (a forked child reads them from here; nothing changes them after)."""
import os
import signal
import struct

SCRIPT = "main.py"          # a cell runs as `python3 main.py` in its working directory
SPARE_CWD = "/tmp/call"     # a stateless cell's working directory
INTERRUPTED = -2            # run_cell's status for an uncaught KeyboardInterrupt (CPython then dies by SIGINT)

HDR = struct.Struct(">I")                   # a frame's length
REQ = struct.Struct(">II")                  # a stateless cell's request: code bytes, stdin bytes
FORK_SERVER_REQUEST = struct.Struct("=i")   # pid 1 -> fork server: 0 = fork a spare (fds attached), > 0 = reap this pid
FORKED = struct.Struct("=i")                # fork server -> pid 1: the new spare's pid (<= 0: the fork failed)
REAPED = struct.Struct("=iid")              # fork server -> pid 1: a cell's pid, wait status (-1: not ours), CPU s

# signals pid 1 ignores (and the fork server and holders inherit); cells get what plain python has
IGNORED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
           signal.SIGPIPE, signal.SIGALRM, signal.SIGXCPU, signal.SIGXFSZ, signal.SIGTSTP, signal.SIGTTIN,
           signal.SIGTTOU)
# a cell's dispositions, as plain ints for _signal: signal.signal's enum round trips touch dozens of
# copy-on-write pages in every forked cell. What plain python does: KeyboardInterrupt on SIGINT, EPIPE/EFBIG
# errors instead of SIGPIPE/SIGXFSZ deaths, default for the rest
CELL_SIGNALS = tuple((int(s), {signal.SIGINT: signal.default_int_handler, signal.SIGPIPE: 1,
                               signal.SIGXFSZ: 1}.get(s, 0)) for s in IGNORED)
TICK = os.sysconf("SC_CLK_TCK")
exit_now = os._exit   # bound before any cell runs: a cell that replaces os._exit cannot keep a spare going

# set by pid 1 before its first fork
LIM = {}                # the limits (Limits.for_worker())
BASE_VM = 0             # the warm interpreter's address space, which RLIMIT_AS adds to
LIMIT_PLAN = ()         # a cell's hard limits, (resource, (soft, hard)) pairs (cell.limit_plan)
HOLDER_ADDRESS = None   # the abstract socket a session's next holder reaches pid 1 on (sessions.py)
