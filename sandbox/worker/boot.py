"""How every process of a sandbox starts: pid 1 runs main(); a forked child that is to run a loop of its own
(the fork server, a session's holder) leaves the stack it inherited through Become and starts at the top."""
from . import settings


class Become(BaseException):
    """Raised by a freshly forked child to leave the stack it inherited: boot() catches it and calls the
    target from the top. The fork server and each session holder start this way, so whatever depth they were
    forked at, they run at boot -> loop, and the cells they fork (called directly: unwinding costs a forked
    cell ~60 copy-on-write faults) always start at the same depth: 5 frames below a script's module frame,
    so a cell recurses 5 levels less deep than `python3 main.py` before RecursionError. Without it, a
    session's holders would nest one generation deeper with every cell.

    Why an exception, and why a BaseException: become() is called right after a fork, deep in pid 1's call
    chain (serve -> Sessions.run -> new_holder, prefork -> ask_fork_server -> start_fork_server) or at the end of
    a session cell (holder_loop -> session_cell -> continue_session), and only unwinding can drop those frames;
    returning a value instead would thread "this is the child now" back through every caller on those paths. Like
    SystemExit, it must pass any `except Exception` on the way to boot(). Only our own frames are on that stack
    (a session cell's code has returned before it forks), and none of them has a finally or with block around
    a become() that would act in the child."""

    def __init__(self, target, args):
        self.target, self.args = target, args


def become(target, *args):
    raise Become(target, args)


def boot(main):
    """pid 1's entry (sandbox/bwrap.py runs it with server.main): main(), and in a forked child, the target
    it became."""
    try:
        return main()
    except Become as b:
        target, args = b.target, b.args
    while True:
        try:
            target(*args)
        except Become as b:   # a process forked under the target (a session cell's next holder)
            target, args = b.target, b.args
            continue
        except BaseException:
            pass
        settings.exit_now(0)
