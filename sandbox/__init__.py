"""rstar-hpc's sandbox: a per-node service that runs model-written Python in bubblewrap, fast and isolated.

Never imports torch or vLLM (standard library; numpy and sympy are imported only inside the sandboxes).

    sandbox.limits   Limits: every knob, with defaults (4 s wall, 1 GiB, 32 processes, 8 KiB output, ...)
    sandbox.pool     Pool: N persistent bwrap sandboxes, queue, sessions, stats (in-process use, tests)
    sandbox.route    which kind of sandbox a stateless call runs in (light: stdlib only; math: numpy/sympy)
    sandbox.server   Service: the Pool behind a TCP server, announced in the run directory
    sandbox.client   SandboxClient: batching, load-spreading, retrying client for many services
    sandbox.results  result record, statuses, render_rstar2() (the text the model sees)
    sandbox.protocol wire format and call validation
    sandbox.bwrap    one sandbox: the bwrap recipe and the process running the worker as its pid 1
    sandbox.worker   pid 1 inside each sandbox, its fork server, cells and session holders (stdlib only)
    sandbox.stats    what a pool counts

Threat model: what is guaranteed
--------------------------------
The code is untrusted (written by a model under RL, which will find any reward-relevant hole) but not a
targeted kernel exploit. Against it, each call is:
- isolated from the host: its own user (or, when the service runs as root, a uid of its own), pid, net,
  ipc, uts and mount namespaces (bwrap). The file system is an empty tmpfs with /usr, the interpreter and
  its site-packages bound read-only; no /home, /etc, /work, project or scratch directory of the host, so
  no other user's files, no keys, no tokens (an interpreter installed under /tmp is bound at its own path inside
  the sandbox's /tmp; the wipe never enters or removes it). The environment is rebuilt from scratch (bwrap is started
  with a scrubbed environment, so not even /proc/1/environ shows the launcher's). No network (an empty
  net namespace: loopback only). No capabilities, no_new_privs, a new session (no tty injection), and a
  seccomp filter against ptrace, process_vm_*, new namespaces, mounts, keyrings, bpf, io_uring, perf,
  modules, System V IPC (its objects would outlive a call) and kill(-1).
- limited by hard rlimits set in the cell's own process (soft = hard, which it cannot raise): CPU time,
  address space, processes+threads (RLIMIT_NPROC, counted per sandbox), open files, file size, core 0;
  a size-capped private /tmp and /dev/shm, wiped after every call. The wall-clock timer lives in pid 1 of
  the sandbox, a process with no signal handlers (so, inside its pid namespace, unkillable) that runs no
  user code and is non-dumpable; the service has a second timer on pid 1 itself. Output is read by pid 1
  through capped pipes (head + tail kept, the cell killed past output_kill_bytes).
- fresh: a stateless call runs in a newly forked child of a warm interpreter (numpy and sympy already
  imported in math sandboxes; a few stdlib modules in light ones, which take calls that import nothing
  else: same bwrap recipe, pid 1, limits and uid scheme, only the preloads differ, and the choice never
  changes what a cell sees), with re-seeded RNGs and an empty working directory; after it, every process it left is
  killed and its files removed, so nothing carries over to the next call. Sandboxes are also recycled
  after `recycle_after` calls and replaced on any anomaly (died, hung, processes surviving the sweep).
- answered or failed over: a client whose service dies or freezes (SIGSTOP, a wedged host) gets every
  call back, retried elsewhere and flagged `maybe_executed_before` when it may have run; a frozen service is
  noticed once a call outlives its time limit plus the client's `reply_margin_s` with no reply at all.
- judged by what its process did: a cell holds no descriptor but its stdin, stdout and stderr (and the files it
  opens), and its status follows from its exit status as the kernel reports it to its parent (the fork server,
  or the session's holder), the signal that ended it, or the limit pid 1 enforced; times and sizes are measured
  by pid 1 outside it. Nothing a cell writes, to any descriptor, turns a failure into `ok`. The exception fields
  (exc_type, traceback, lineno) are read from the traceback the interpreter printed, for display only. Sandbox
  output is never unpickled.
- run as CPython runs a script: the cell is `python3 main.py` in its working directory (a real `__main__`
  module with __file__, pickling of what it defines, multiprocessing and process pools, sys.exit and its exit
  codes, KeyboardInterrupt as death by SIGINT, atexit, non-daemon threads joined at the end, input() on its
  stdin). tests/sandbox/test_differential.py runs programs.yaml through both and compares. Where the sandbox
  must differ it says so: wall/CPU time, memory, processes, output size, network, files outside the work dir
  (a status or a `reason` naming the limit); a bare last expression is printed like IPython's (rStar2's tool
  does that; `display_last_expression: false` turns it off); a cell has 5 frames less of recursion depth
  than a script (the sandbox's own entry frames).

What is not guaranteed
----------------------
- Kernel bugs: namespaces + seccomp deny-list, not a VM. A kernel exploit escapes.
- Memory is limited per process (address space), not per sandbox: with no cgroup delegated to the job, a
  cell's threads/processes each get the limit, and tmpfs pages are not counted against it. Run the service
  in a Slurm job with a memory limit (the job's cgroup is the backstop; cells have oom_score_adj 1000 so
  they, not the service, are the OOM killer's first choice).
- Between sessions of one sandbox: sessions share a sandbox's uid, so a cell can signal another session's
  process by pid (kill(-1) is blocked, enumerating /proc is not; the victim session is then reported
  "replayed") and can read or write the other session's scratch directory under /tmp. Another session's
  memory and results stay out of reach (non-dumpable processes, ptrace denied, private result pipes).
- Within a session, a cell runs in a fork of the process that keeps the session's state, so code of an earlier
  cell (a patched builtin, a planted child process) can shape how later cells of the same session run, as in any
  notebook; never another session's or a stateless call's result. Threads a session cell starts end with the
  cell (the state lives on in a fork of the cell's process, which copies the calling thread only).
- Denial of service by CPU: a cell can burn its CPU/wall limit; BLAS/OpenMP are pinned to one thread.
- Unprivileged user namespaces must be enabled on the nodes (`rstar-hpc doctor` checks); Ubuntu >= 23.10
  needs an AppArmor profile for bwrap.
"""
from sandbox.limits import Limits
from sandbox.results import STATUSES, make_result, render_rstar2, truncate_middle

__all__ = ["STATUSES", "Limits", "make_result", "render_rstar2", "truncate_middle"]
