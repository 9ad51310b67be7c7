"""The hostile-input catalogue: what sandboxed code may try against its host and its neighbours, one property per
test.

Every test uses the `healthy` fixture: after the hostile call, both sandboxes are alive, an ordinary call is
correct and fast, and no process the hostile code started survives on the host.
"""
from __future__ import annotations

import errno
import os
import shutil
import socket

import pytest

from tests.helpers.sandbox_pools import SECRET, TEST_LIMITS


def run(sb, code, kind=None, **kw):
    """kind "math": the code mentions numpy, so it runs in a math sandbox (light and math sandboxes are the
    same bwrap recipe and pid 1; the interpreter's preloads differ, so the core catalogue runs in both)."""
    if kind == "math":
        code += "\n# numpy"
    r = sb.run(code, **kw)
    if kind is not None:
        assert r["sandbox"] == kind, r
    return r


BOTH = pytest.mark.parametrize("kind", ["light", "math"])


# ---------------------------------------------------------------- processes (1, 2, 23, 24, 42)
@BOTH
def test_fork_bomb_is_capped_by_nproc_and_killed_at_the_wall(healthy, kind):
    r = run(healthy, kind=kind, code="""
import os
n = 0
try:
    while True:
        if os.fork() == 0:
            import time; time.sleep(60)
        n += 1
except OSError as e:
    print("capped", n, e.errno)
""", timeout_s=1.5)
    assert r["status"] == "ok", r
    capped = int(r["stdout"].split()[1])
    assert 0 < capped <= TEST_LIMITS["max_processes"] + TEST_LIMITS["max_sessions_per_worker"] + 4


def test_silent_fork_bomb_ends_at_the_wall_timeout(healthy):
    r = run(healthy, "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
            timeout_s=1.0)
    assert r["status"] == "timeout", r
    assert r["wall_s"] < 1.5


def test_thread_bomb_is_capped(healthy):
    r = run(healthy, """
import threading, time
n = 0
try:
    while True:
        threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
        n += 1
except RuntimeError:
    print(n)
""", timeout_s=2)
    assert r["status"] == "ok", r
    assert 0 < int(r["stdout"]) <= TEST_LIMITS["max_processes"] + TEST_LIMITS["max_sessions_per_worker"] + 4


@BOTH
def test_setsid_daemon_does_not_outlive_the_call(healthy, kind):
    r = run(healthy, kind=kind, code="""
import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        time.sleep(600)
    os._exit(0)
time.sleep(0.1)
print("parent done")
""")
    assert r["status"] == "ok" and r["stdout"] == "parent done\n", r
    # the healthy fixture counts the sandbox uid's processes on the host: the daemon must be gone


def test_zombies_are_reaped(healthy):
    r = run(healthy, "import os\nfor _ in range(10):\n    if os.fork() == 0:\n        os._exit(0)\nprint('ok')")
    assert r["status"] == "ok", r


def test_subprocess_inside_a_cell_works_and_is_bounded(healthy):
    r = run(healthy, "import subprocess, sys\nprint(subprocess.run([sys.executable, '-c', 'print(5)'],"
                     " capture_output=True, text=True).stdout)")
    assert r["status"] == "ok" and r["stdout"].strip() == "5", r


# ---------------------------------------------------------------- memory (3, 4, 38)
@BOTH
def test_single_huge_allocation_is_a_memory_error(healthy, kind):
    r = run(healthy, kind=kind, code="x = bytearray(10**10)")
    assert r["status"] == "memory" and r["exc_type"] == "MemoryError", r


def test_gradual_growth_is_stopped(healthy):
    r = run(healthy, "chunks = []\nwhile True:\n    chunks.append(bytearray(10 * 2**20))", timeout_s=3)
    assert r["status"] == "memory", r


def test_numpy_huge_array_is_a_memory_error(healthy):
    r = run(healthy, "import numpy as np\nnp.ones((10**5, 10**5))")
    assert r["status"] == "memory", r


def test_tmpfs_is_not_a_memory_sink(healthy):
    r = run(healthy, """
import os
total = 0
try:
    for i in range(100):
        with open(f"/dev/shm/f{i}", "wb") as f:
            for _ in range(8):
                f.write(b"x" * 2**20)
                total += 2**20
except OSError as e:
    print(total // 2**20, e.errno)
""")
    assert r["status"] == "ok", r
    assert int(r["stdout"].split()[0]) <= TEST_LIMITS["scratch_mb"]


# ---------------------------------------------------------------- output (5, 6, 7)
@BOTH
def test_output_flood_is_capped_and_killed_fast(healthy, kind):
    r = run(healthy, kind=kind, code="while True:\n    print('x' * 1000)", timeout_s=2)
    assert r["status"] == "output_truncated" and "killed" in r["reason"], r
    assert r["wall_s"] < 1.5
    assert len(r["stdout"]) < TEST_LIMITS["max_output_bytes"] + 100
    assert "bytes truncated" in r["stdout"]


def test_long_output_keeps_head_and_tail(healthy):
    r = run(healthy, "for i in range(5000):\n    print(i)")
    assert r["status"] == "output_truncated", r
    assert r["stdout"].startswith("0\n1\n") and r["stdout"].endswith("4998\n4999\n")


def test_output_before_a_hang_is_kept(healthy):
    r = run(healthy, "print('before hang')\nimport time\ntime.sleep(100)", timeout_s=0.5)
    assert r["status"] == "timeout" and r["stdout"] == "before hang\n", r


def test_invalid_utf8_output_is_replaced_not_fatal(healthy):
    r = run(healthy, "import sys\n_ = sys.stdout.buffer.write(b'\\xff\\xfeok\\n')")
    assert r["status"] == "ok" and r["stdout"].endswith("ok\n") and "\ufffd" in r["stdout"], r


# ---------------------------------------------------------------- file system (8, 9, 10, 11, 36)
def test_system_and_runtime_files_are_read_only(healthy):
    import sys
    target = os.path.join(sys.prefix, "rstar_sandbox_pwned")
    r = run(healthy, f"open({target!r}, 'w').write('x')")
    assert r["status"] == "error" and r["exc_type"] in ("OSError", "PermissionError"), r
    r = run(healthy, "open('/usr/lib/pwned', 'w')")
    assert r["status"] == "error", r
    assert not os.path.exists(target)


def test_host_home_etc_and_project_are_absent(healthy):
    r = run(healthy, """
import os
print(sorted(os.listdir('/')))
for p in ('/etc/shadow', '/etc/passwd', '/home', '/root/.ssh', '/work/main/setup.py'):
    print(p, os.path.exists(p))
""")
    assert r["status"] == "ok", r
    assert "home" not in r["stdout"].splitlines()[0]
    assert " True" not in r["stdout"], r["stdout"]


def test_big_file_is_stopped_by_the_file_size_limit(healthy):
    r = run(healthy, "with open('big', 'wb') as f:\n    f.write(b'x' * (64 * 2**20))")
    assert r["status"] == "error" and r["exc_type"] == "OSError" and "File too large" in r["traceback"], r


@BOTH
def test_files_do_not_persist_across_calls(healthy, kind):
    for _ in range(2):   # land on both sandboxes of the kind
        run(healthy, kind=kind, code="open('/tmp/leak', 'w').write('x'); open('/dev/shm/leak', 'w').write('x'); "
                                     "open('here', 'w').write('x')")
    check = "import os\nprint(os.path.exists('/tmp/leak'), os.path.exists('/dev/shm/leak'), os.listdir('.'))"
    rs = [run(healthy, kind=kind, code=check) for _ in range(4)]
    assert {r["stdout"] for r in rs} == {"False False ['main.py']\n"}, rs   # the call's own script only


def test_a_module_written_by_one_call_cannot_be_imported_by_the_next(healthy):
    # within a call the work dir is the script's directory, so its own modules import, as with `python3 main.py`;
    # the directory is wiped after the call, so nothing planted there reaches a later call
    r = run(healthy, "open('json_evil.py', 'w').write('print(\\'planted\\')')\nimport json_evil")
    assert r["status"] == "ok" and r["stdout"] == "planted\n", r
    for _ in range(4):
        r = run(healthy, "import json_evil")
        assert r["status"] == "error" and r["exc_type"] == "ModuleNotFoundError", r


# ---------------------------------------------------------------- secrets (11, 26, 35)
@BOTH
def test_launcher_environment_is_invisible(healthy, kind):
    assert os.environ.get("RSTAR_SANDBOX_TEST_SECRET") == SECRET
    r = run(healthy, kind=kind, code="""
import os
print(sorted(os.environ))
for p in os.listdir('/proc'):
    if p.isdigit():
        for f in ('environ', 'cmdline'):
            try:
                print(open(f'/proc/{p}/{f}', 'rb').read())
            except OSError as e:
                print(p, f, type(e).__name__)
""")
    assert r["status"] == "ok", r
    assert SECRET not in r["stdout"] and "RSTAR_SANDBOX_TEST_SECRET" not in r["stdout"]
    assert "SLURM" not in r["stdout"]


def test_proc_shows_only_the_sandbox(healthy):
    r = run(healthy, "import os\nprint(len([p for p in os.listdir('/proc') if p.isdigit()]))")
    assert r["status"] == "ok" and int(r["stdout"]) <= 2 + TEST_LIMITS["max_sessions_per_worker"], r
    r = run(healthy, f"import os\nprint(os.path.exists('/proc/{os.getpid()}/environ'))")
    # the service's pid means nothing inside; it must not be this process
    assert "True" not in r["stdout"] or os.getpid() <= 3


def test_pid1_memory_is_unreadable(healthy):
    r = run(healthy, "open('/proc/1/mem', 'rb').read(1)")
    assert r["status"] == "error" and r["exc_type"] in ("PermissionError", "OSError"), r


# ---------------------------------------------------------------- network (12, 13)
@BOTH
def test_no_network_egress(healthy, kind):
    # __import__, not an import statement: light interpreters do not preload socket, and the router sends
    # code that imports a module they lack to a math sandbox
    r = run(healthy, kind=kind, code="socket = __import__('socket')\n"
                                     "socket.create_connection(('1.1.1.1', 53), timeout=1)")
    assert r["status"] == "error" and r["exc_type"] in ("OSError", "TimeoutError"), r


def test_host_loopback_services_are_unreachable(healthy):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    port = srv.getsockname()[1]
    try:
        r = run(healthy, f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)")
        assert r["status"] == "error" and r["exc_type"] == "ConnectionRefusedError", r
    finally:
        srv.close()


def test_only_loopback_interface(healthy):
    r = run(healthy, "import socket\nprint([n for _, n in socket.if_nameindex()])")
    assert r["stdout"] == "['lo']\n", r


# ---------------------------------------------------------------- killing the service (14, 15, 16, 27, 41)
def test_kill_minus_one_is_denied(healthy):
    r = run(healthy, "import os, signal\nos.kill(-1, signal.SIGKILL)")
    assert r["status"] == "error" and r["exc_type"] == "PermissionError", r


@BOTH
def test_sigkill_to_pid1_has_no_effect(healthy, kind):
    r = run(healthy, kind=kind,
            code="import os, signal, time\nos.kill(1, signal.SIGKILL)\ntime.sleep(0.2)\nprint('still here')")
    assert r["status"] == "ok" and r["stdout"] == "still here\n", r


def test_sigint_and_sigterm_to_the_parent_have_no_effect(healthy):
    r = run(healthy, "import os, signal\nfor s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):\n"
                     "    os.kill(os.getppid(), s)\nprint(os.getppid())")
    assert r["status"] == "ok", r


@BOTH
@pytest.mark.parametrize("sig", ["SIGKILL", "SIGSTOP"])
def test_killing_or_stopping_the_fork_server_costs_nothing(healthy, kind, sig):
    # a stateless cell's parent is the sandbox's fork server (not pid 1): a signal it cannot ignore ends or
    # stops it; pid 1 replaces (or continues) it, and the next calls are correct and fast (healthy checks)
    code = f"import os, signal\nppid = os.getppid()\nos.kill(ppid, signal.{sig})\nprint(ppid > 1)"
    for _ in range(4):   # both sandboxes of the kind, twice
        r = run(healthy, code, kind=kind)
        assert r["status"] == "ok" and r["stdout"] == "True\n", r
        r = run(healthy, "print(6 * 7)", kind=kind)
        assert r["status"] == "ok" and r["stdout"] == "42\n" and r["wall_s"] < 2.0, r   # (bound: see `healthy`)


def test_clone_parent_is_denied(healthy):
    # a child made a sibling of its cell (clone(CLONE_PARENT)) would be the fork server's child, not an orphan
    # that pid 1 adopts and sweeps
    r = run(healthy, "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                     "print(libc.syscall(56, 0x8000 | 17, 0, 0, 0, 0), ctypes.get_errno())")   # clone, x86_64
    if os.uname().machine == "x86_64":
        assert r["status"] == "ok" and r["stdout"] == "-1 1\n", r   # EPERM


def test_ptrace_is_denied(healthy):
    r = run(healthy, "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                     "print(libc.ptrace(16, 1, 0, 0), ctypes.get_errno())")   # PTRACE_ATTACH
    assert r["status"] == "ok" and r["stdout"] == "-1 1\n", r   # EPERM


def test_nested_user_namespace_is_denied(healthy):
    r = run(healthy, "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                     "print(libc.unshare(0x10000000), ctypes.get_errno())")   # CLONE_NEWUSER
    assert r["status"] == "ok" and r["stdout"].startswith("-1 "), r


def test_no_privileges(healthy):
    r = run(healthy, "print([l.split()[1] for l in open('/proc/self/status') if l.startswith(('NoNewPrivs', 'CapEff'))])")
    assert r["stdout"] == "['0000000000000000', '1']\n", r


def test_stopping_itself_ends_at_the_wall(healthy):
    r = run(healthy, "import os, signal\nos.kill(os.getpid(), signal.SIGSTOP)", timeout_s=0.5)
    assert r["status"] == "timeout", r


# ---------------------------------------------------------------- time (17, 18, 21, 22, 31)
def test_sleep_is_killed_at_the_wall(healthy):
    r = run(healthy, "import time\ntime.sleep(10**6)", timeout_s=0.5)
    assert r["status"] == "timeout" and 0.5 <= r["wall_s"] < 1.0, r


def test_input_sees_eof(healthy):
    r = run(healthy, "input()")
    assert r["status"] == "error" and r["exc_type"] == "EOFError", r


def test_cpu_spin_is_killed(healthy):
    r = run(healthy, "while True:\n    pass", timeout_s=1.0)
    assert r["status"] == "timeout", r


@BOTH
def test_cancelling_timers_does_not_escape(healthy, kind):
    r = run(healthy, kind=kind, code="""
import signal, time
signal.alarm(0)
for s in (signal.SIGXCPU, signal.SIGALRM, signal.SIGTERM, signal.SIGINT):
    signal.signal(s, signal.SIG_IGN)
while True:
    try:
        time.sleep(10)
    except BaseException:
        pass
""", timeout_s=0.7)
    assert r["status"] == "timeout" and r["wall_s"] < 1.2, r


def test_cpu_limit_holds_when_sigxcpu_is_ignored(healthy):
    r = run(healthy, "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass",
            timeout_s=15)   # wall far above the CPU limit: a loaded machine must not turn it into a wall timeout
    assert r["status"] == "timeout" and "CPU" in r["reason"], r
    assert r["cpu_s"] <= TEST_LIMITS["cpu_time_s"] + 1.5


def test_huge_int_to_str_is_refused(healthy):
    r = run(healthy, "print(10 ** 100000)")
    assert r["status"] == "error" and r["exc_type"] == "ValueError", r


def test_deep_recursion_is_contained(healthy):
    r = run(healthy, "import sys\nsys.setrecursionlimit(10**8)\ndef f(n):\n    return f(n + 1)\nf(0)", timeout_s=2)
    assert r["status"] in ("killed", "error", "memory", "timeout"), r


def test_segfault_is_reported_as_killed(healthy):
    r = run(healthy, "import ctypes\nctypes.string_at(0)")
    assert r["status"] == "killed" and r["signal"] == "SIGSEGV", r


# ---------------------------------------------------------------- limits the code cannot undo (30)
@pytest.mark.parametrize("res", ["RLIMIT_CPU", "RLIMIT_AS", "RLIMIT_NPROC", "RLIMIT_NOFILE", "RLIMIT_FSIZE"])
def test_rlimits_cannot_be_raised(healthy, res):
    r = run(healthy, f"import resource\nresource.setrlimit(resource.{res}, (resource.RLIM_INFINITY,) * 2)")
    assert r["status"] == "error" and r["exc_type"] == "ValueError", r


def test_fd_exhaustion_is_capped(healthy):
    r = run(healthy, "import os\nfds = []\ntry:\n    while True:\n        fds.append(os.open('/dev/null', 0))\n"
                     "except OSError as e:\n    print(len(fds), e.errno)")
    assert r["status"] == "ok", r
    n, errno_ = map(int, r["stdout"].split())
    assert n < 64 and errno_ == 24   # EMFILE


# ---------------------------------------------------------------- exits (32)
@pytest.mark.parametrize("code,status", [("import sys\nsys.exit(0)", "ok"), ("exit()", "ok"),
                                         ("import sys\nsys.exit(3)", "error"), ("import os\nos._exit(0)", "ok"),
                                         ("import os\nos._exit(5)", "error"), ("raise KeyboardInterrupt", "error")])
def test_exits_are_results(healthy, code, status):
    r = run(healthy, code)
    assert r["status"] == status, r


# ---------------------------------------------------------------- forging results (33, 34)
def test_printed_protocol_text_cannot_forge_a_result(healthy):
    r = run(healthy, 'print(\'{"status": "ok", "stdout": "forged"}\')\nprint("Tool call success")\n1/0')
    assert r["status"] == "error" and r["exc_type"] == "ZeroDivisionError", r


# every channel a cell might look for: its descriptors, its parent's (closed to it: non-dumpable), sockets
# it inherited, the session rendezvous, and each with a made-up result in the worker's own formats
FORGER = r"""
import _socket, json, os, struct
fake = json.dumps({"id": 1, "status": "ok", "exc_type": None, "stdout": "forged", "wall_s": 0.0})
frames = [fake.encode(), fake.encode() + b"\n", struct.pack(">I", len(fake)) + fake.encode(),
          b'{"ended": 2, "status": 0, "cpu_s": 0}\n', b'{"forked": 2}\n', b"\0" * 16]
hits = []
for fd in range(1024):
    for frame in frames:
        try:
            os.write(fd, frame)
            hits.append(fd)
        except OSError:
            pass
for name in os.listdir("/proc/self/fd"):
    try:
        with open(f"/proc/self/fd/{name}", "wb", buffering=0) as f:
            f.write(frames[0])
    except OSError:
        pass
for pid in {os.getppid(), 1}:
    try:
        os.listdir(f"/proc/{pid}/fd")
        hits.append(f"parent {pid}")
    except OSError:
        pass
for fd in range(3, 1024):
    try:
        s = _socket.socket(fileno=os.dup(fd))
        s.sendall(frames[2])
        hits.append(f"socket {fd}")
    except OSError:
        pass
try:
    for line in open("/proc/net/unix").read().splitlines()[1:]:
        name = line.split()[-1] if len(line.split()) > 7 else ""
        if name.startswith("@"):
            c = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
            c.settimeout(0.2)
            c.connect("\0" + name[1:])
            c.sendall(frames[1])
except OSError:
    pass
print("reached", sorted({h for h in hits if not isinstance(h, int) or h > 2}))
raise ValueError("the real error")
"""


@BOTH
def test_a_cell_cannot_forge_its_result_through_any_descriptor(healthy, kind):
    """The security property against forged results: nothing a cell writes, anywhere it can reach, turns its failure
    into `ok`. Its only descriptors are its own stdin, stdout and stderr."""
    r = run(healthy, FORGER, kind=kind)
    assert r["status"] == "error" and r["exc_type"] == "ValueError" and r["exit_code"] == 1, r
    assert r["stdout"].endswith("reached []\n"), r   # no descriptor but 0, 1, 2; no parent's fd table
    assert "ValueError: the real error" in r["traceback"] and "main.py" in r["traceback"], r
    nxt = run(healthy, "print(6 * 7)", kind=kind)
    assert nxt["status"] == "ok" and nxt["stdout"] == "42\n", nxt


def test_a_session_cell_cannot_forge_its_result_or_pose_as_the_next_holder(healthy):
    s = "forger-" + os.urandom(4).hex()
    first = healthy.run("kept = 'state'", session=s)
    assert first["status"] == "ok", first
    r = healthy.run(FORGER, session=s)
    assert r["status"] == "error" and r["exc_type"] == "ValueError" and r["stdout"].endswith("reached []\n"), r
    after = healthy.run("print(kept)", session=s)
    assert after["status"] == "ok" and after["stdout"] == "state\n" and after["session"]["state"] == "live", after
    for _ in range(4):   # stateless calls in every sandbox: what the forger left on the rendezvous is gone
        assert healthy.run("print(1)")["status"] == "ok"


@BOTH
def test_a_cell_that_writes_fake_reports_then_hangs_times_out(healthy, kind):
    # its times are measured outside it, and whatever it left running is killed before the next call
    r = run(healthy, kind=kind, code="""
import os, time
time.sleep(0.3)
fake = b'{"exc_type": null, "status": "ok", "wall_s": 0.0, "cpu_s": 0.0, "stdout": "forged"}'
for fd in range(0, 1024):
    try:
        os.write(fd, fake)
        os.close(fd)
    except OSError:
        pass
time.sleep(10)
""", timeout_s=1)
    assert r["status"] == "timeout" and r["wall_s"] >= 1.0, r   # what it wrote on fd 1 is just its stdout


def test_repr_that_raises_is_an_error_not_a_crash(healthy):
    r = run(healthy, "class X:\n    def __repr__(self):\n        raise RuntimeError('no')\nX()")
    assert r["status"] == "error" and r["exc_type"] == "RuntimeError", r


# ---------------------------------------------------------------- leaking state between calls (37)
def test_globals_builtins_and_modules_do_not_leak(healthy):
    for _ in range(2):
        run(healthy, "import builtins, numpy, sys\nleak = 1\nbuiltins.leak2 = 2\nnumpy.sum = None\n"
                     "sys.modules['evil'] = 1")
    rs = healthy.run_many([{"code": "import numpy, sys\nprint('leak' in globals(), hasattr(__builtins__, 'leak2') "
                                    "if not isinstance(__builtins__, dict) else 'leak2' in __builtins__, "
                                    "numpy.sum([1, 2]), 'evil' in sys.modules)"} for _ in range(4)])
    assert {r["stdout"] for r in rs} == {"False False 3 False\n"}, rs


@BOTH
def test_system_v_shared_memory_cannot_carry_state_to_the_next_call(healthy, kind):
    # a SysV segment would outlive the call in the sandbox's IPC namespace: creating one is denied
    code = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "print(libc.shmget(4242, 4096, 0o1666), ctypes.get_errno(), libc.msgget(4243, 0o1666), "
            "libc.semget(4244, 1, 0o1666))")
    for _ in range(2):
        r = run(healthy, code, kind=kind)
        assert r["status"] == "ok" and r["stdout"] == f"-1 {errno.EPERM} -1 -1\n", r


def test_rngs_are_reseeded_per_call(healthy):
    rs = healthy.run_many([{"code": "import random, numpy\nprint(random.random(), numpy.random.rand())"}
                           for _ in range(6)])
    outs = [r["stdout"] for r in rs]
    assert len(set(outs)) == 6, outs


def test_background_thread_output_does_not_reach_the_next_call(healthy):
    run(healthy, "import threading, time, sys\ndef spam():\n    while True:\n        print('SPAM')\n"
                 "        time.sleep(0.001)\nthreading.Thread(target=spam, daemon=True).start()")
    rs = healthy.run_many([{"code": "print('clean')"} for _ in range(4)])
    assert all(r["stdout"] == "clean\n" for r in rs), rs


# ---------------------------------------------------------------- results
def test_traceback_has_no_service_frames(healthy):
    r = run(healthy, "def f():\n    return 1 / 0\nf()")
    assert r["status"] == "error", r
    tb = r["traceback"]
    assert "worker.py" not in tb and 'File "/tmp/call/main.py", line 3, in <module>' in tb, tb
    assert "line 2, in f" in tb and tb.endswith("ZeroDivisionError: division by zero"), tb
    assert r["lineno"] == 2


def test_syntax_error_is_reported(healthy):
    r = run(healthy, "def (")
    assert r["status"] == "error" and r["exc_type"] == "SyntaxError" and "worker.py" not in r["traceback"], r


def test_bare_last_expression_is_printed_like_ipython(healthy):
    r = run(healthy, "import sympy\nx = sympy.symbols('x')\nsympy.factor(x**2 - 1)")
    assert r["status"] == "ok" and r["stdout"] == "(x - 1)*(x + 1)\n", r
    r = run(healthy, "x = 5\nNone")
    assert r["stdout"] == "", r
    r = run(healthy, "print('a')\n'b'")
    assert r["stdout"] == "a\n'b'\n", r


def test_stdin_is_fed(healthy):
    r = run(healthy, "import sys\nprint(sum(int(x) for x in sys.stdin.read().split()))", stdin="1 2 3\n" * 1000)
    assert r["status"] == "ok" and r["stdout"] == "6000\n", r


def test_an_interpreter_under_tmp_is_bound_over_the_private_scratch(monkeypatch):
    """A checkout (its .venv) under /tmp: the sandbox's private /tmp must not hide the interpreter, so the
    scratch tmpfs is mounted first and the interpreter's prefix bound on top of it."""
    import sys

    from sandbox.bwrap import bwrap_argv
    from sandbox.limits import Limits

    monkeypatch.setattr(sys, "prefix", "/tmp/fresh/.venv")
    argv = bwrap_argv(Limits(), None, as_root=True, kind="math", worker={})
    scratch = next(i for i in range(len(argv) - 1) if argv[i:i + 2] == ["--tmpfs", "/tmp"])
    venv = next(i for i in range(len(argv) - 2) if argv[i:i + 3] == ["--ro-bind", sys.prefix, sys.prefix])
    assert scratch < venv
    assert ["--dir", "/tmp"] not in [argv[i:i + 2] for i in range(len(argv) - 1)]   # /tmp keeps the scratch's mode


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"),
                    reason="needs root for a mount namespace")
def test_the_worker_as_pid_1_outside_bwrap_neither_sweeps_nor_wipes(tmp_path):
    """pid 1 of a bare `unshare -fp --mount-proc` is not a sandbox: the worker run there once emptied the host's
    /tmp. Here /tmp is a bind of a test directory, so a regression costs that directory only."""
    import json
    import struct
    import subprocess
    import sys

    from sandbox.bwrap import _BOOT, WORKER_DIR, WORKER_PACKAGE, compiled_worker
    from sandbox.limits import Limits

    # the bind hides everything under /tmp, a checkout there included: the worker is compiled into the directory
    # that is bound there, and the venv's base interpreter runs it (pid 1 needs only the standard library)
    python = os.path.realpath(sys.executable)
    if python.startswith("/tmp/"):
        pytest.skip(f"the interpreter itself lives under /tmp ({python})")
    keep = tmp_path / "keep"
    keep.write_text("host file")
    pkg = tmp_path / "worker" / WORKER_PACKAGE
    pkg.mkdir(parents=True)
    for name, image in compiled_worker().items():
        (pkg / name).write_bytes(image)
    boot = _BOOT.replace(repr(WORKER_DIR), repr("/tmp/worker"))
    script = f"mount --bind {tmp_path} /tmp && exec {python} -I -S -u -B -c \"{boot}\""
    proc = subprocess.Popen(["unshare", "-fpm", "--mount-proc", "sh", "-c", script], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE)

    def ask(msg):
        body = json.dumps(msg).encode()
        proc.stdin.write(struct.pack(">I", len(body)) + body)
        proc.stdin.flush()
        (n,) = struct.unpack(">I", proc.stdout.read(4))
        return json.loads(proc.stdout.read(n))

    try:
        lim = Limits(**TEST_LIMITS)
        assert ask({"op": "init", "limits": lim.for_worker(), "uid": None, "preload": [], "path": []})["pid"] == 1
        first = ask({"op": "exec", "code": "print(1)", "stdin": "", "timeout_s": 4.0, "session": None})
        assert first["status"] == "ok" and first["stdout"] == "1\n", first
        # the sweep after it refused, so this worker takes no further call
        assert "refused" in ask({"op": "exec", "code": "print(2)", "stdin": "", "timeout_s": 4.0, "session": None})
    finally:
        proc.stdin.close()
        proc.wait(30)
    assert keep.read_text() == "host file"
