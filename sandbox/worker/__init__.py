"""The in-sandbox half: pid 1 of one bwrap sandbox, a warm fork server. Standard library only.

Runs as pid 1 inside bwrap (`--as-pid-1`), imported compiled by `python -I -u -B -c` (sandbox/bwrap.py), so it
must stay stdlib-only apart from the libraries it pre-imports for user code. It speaks length-prefixed JSON on
fds it dups away from 0/1 (the service's pipes), never runs user code itself, and has no handler for any signal
user code could send, so inside its pid namespace it cannot be killed (pid_namespaces(7)). Each call runs in a
fresh forked child (stateless) or in a fork of the session's holder (stateful), as `python3 main.py` would run
it; limits are hard rlimits set in the child, the wall timer lives in pid 1, and after every call everything but
pid 1, the fork server, its pre-forked spare cell and live session holders is killed and the call's scratch
directory removed.

A cell holds no descriptor of ours: its stdin, stdout and stderr only. Its result is its exit status, which
its parent takes from the kernel (wait4) and reports; nothing the cell writes reaches a channel of ours.

Stateless cells are forked by a fork server, a child of pid 1 forked once from the warm interpreter, not by
pid 1 itself: a fork write-protects the forking process's whole heap, and pid 1's per-call work (framing,
supervision, sweeping) then paid ~200 copy-on-write faults per call. The fork server only forks and reaps on
request, and a cell that kills or stops it (it is the cell's parent) costs a replacement at most.

Sessions: holder H keeps the state and a channel to pid 1. For a cell it forks C, which closes that channel and
runs the cell; H reports C's exit status. A cell that ran to its end (even with an exception) forks D, its
continuation with the state it left, and exits; D reaches pid 1 through the sandbox's holder rendezvous (an
abstract Unix socket; pid 1 knows D from the kernel's peer credentials) and is the holder from then on. A cell
that died (timeout, signal, os._exit, memory kill) forked no D: H still holds the state from before the cell,
which is rolled back, and the result says so.

    settings.py    names, message formats and the settings pid 1 fixes before its first fork
    boot.py        how every process of a sandbox starts (boot, become)
    framing.py     bytes on descriptors and sockets
    cell.py        turning a forked child into a cell: descriptors, signals, hard limits, RNGs
    script.py      running a cell's code as `python3 main.py` would, and exiting as it would
    forkserver.py  the fork server and the stateless cells it forks
    holders.py     a session's processes: the holder, its cells, the next holder
    sessions.py    pid 1's table of sessions, and the rendezvous their next holders reach it through
    scratch.py     the writable places: work directories, and the wipe after each call
    report.py      a cell's result from what its process did
    procfs.py      what pid 1 reads in /proc about the sandbox's processes
    server.py      pid 1: start-up, the request loop, supervision, sweeping
"""
