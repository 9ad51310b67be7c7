"""Running a cell's code as `python3 main.py` would, and exiting as that process would: a real __main__ module,
the script on disk, sys.argv and sys.path[0], SystemExit's exit codes, sys.excepthook for an uncaught
exception, non-daemon threads joined and atexit run at the end, death by SIGINT after a KeyboardInterrupt."""
import _signal
import ast
import atexit
import builtins
import linecache
import os
import sys
import traceback

from . import settings
from .framing import write_all

# the package's own frames, cut from the front of a cell's traceback (the cell's first frame is its module)
_PACKAGE_DIR = os.path.dirname(sys._getframe().f_code.co_filename) + os.sep
_SourceFileLoader = sys.modules["_frozen_importlib_external"].SourceFileLoader   # a script's __loader__


def new_main(path):
    """A fresh `__main__` module, registered as sys.modules["__main__"], with what CPython gives a script run
    as `python3 main.py`: pickle and multiprocessing find cell-defined functions and classes through it."""
    mod = type(sys)("__main__")
    mod.__dict__.update(__file__=path, __builtins__=builtins, __cached__=None,
                        __loader__=_SourceFileLoader("__main__", path))
    sys.modules["__main__"] = mod
    return mod.__dict__


def enter_script(g, cwd, code, filename):
    """Point __main__, sys.argv, sys.path[0] and linecache at this cell's script `<cwd>/main.py`, written to
    disk as `python3 main.py` would find it (open(__file__), inspect, multiprocessing's spawn)."""
    path = os.path.join(cwd, settings.SCRIPT)
    g["__file__"] = path
    sys.argv[:] = [settings.SCRIPT]
    if not sys.path or sys.path[0] != cwd:
        sys.path.insert(0, cwd)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            write_all(fd, code.encode("utf-8", "surrogatepass"))
        finally:
            os.close(fd)
    except OSError:
        pass   # a file-size limit below the code's size: the cell still runs, from memory
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)


def exit_status_of(exc):
    """The exit status CPython gives an uncaught SystemExit (Python/pythonrun.c, _Py_HandleSystemExit): None
    is 0, an int is its low byte as exit() keeps it (out of a C long's range it is -1), anything else is
    printed to stderr and the status is 1."""
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return (code if -2**63 <= code < 2**63 else -1) & 0xFF
    try:
        sys.stderr.write(str(code) + "\n")
    except Exception:
        pass
    return 1


def print_uncaught(exc):
    """sys.excepthook, as CPython calls it for an uncaught exception, on a traceback without this package's
    frames."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        tb = tb.tb_next
    exc.__traceback__ = tb
    try:
        sys.excepthook(type(exc), exc, tb)
    except BaseException as hook_error:   # CPython's words when the hook itself fails
        try:
            sys.stderr.write("Error in sys.excepthook:\n")
            traceback.print_exception(hook_error)
            sys.stderr.write("\nOriginal exception was:\n")
            traceback.print_exception(exc)
        except Exception:
            pass


def run_cell(code, g, filename, display):
    """Run one cell in module globals `g`; the exit status CPython would give a script that ends here
    (INTERRUPTED: an uncaught KeyboardInterrupt, which CPython turns into death by SIGINT). With `display`,
    a bare last expression's value is printed as repr(), as rStar2's tool and IPython do."""
    try:
        tree = compile(code, filename, "exec", ast.PyCF_ONLY_AST)
        last = tree.body.pop() if display and tree.body and isinstance(tree.body[-1], ast.Expr) else None
        exec(compile(tree, filename, "exec"), g)
        if last is not None:
            value = eval(compile(ast.Expression(last.value), filename, "eval"), g)
            if value is not None:
                g["_"] = value
                sys.stdout.write(repr(value) + "\n")
        status = 0
    except SystemExit as e:
        status = exit_status_of(e)
    except BaseException as e:   # noqa: B036 - what the interpreter does with any uncaught exception
        print_uncaught(e)
        status = settings.INTERRUPTED if isinstance(e, KeyboardInterrupt) else 1
    return status


def flush_std():
    """Flush stdout and stderr; 120 if stdout cannot be flushed (CPython's status for that), else 0."""
    bad = 0
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except Exception:
            bad = bad or (120 if stream is sys.stdout else 0)
    return bad


def finish_script(status):
    """What CPython does after the main module of a script, then exit: wait for non-daemon threads, run
    atexit callbacks, flush the standard streams, re-raise SIGINT for an uncaught KeyboardInterrupt."""
    try:
        threading = sys.modules.get("threading")
        if threading is not None:
            try:
                threading._shutdown()
            except BaseException:
                pass
        try:
            atexit._run_exitfuncs()
        except BaseException:
            pass
        status = flush_std() or status
        if status == settings.INTERRUPTED:
            die_by_sigint()
    finally:
        settings.exit_now(130 if status == settings.INTERRUPTED else status)


def die_by_sigint():
    _signal.signal(_signal.SIGINT, _signal.SIG_DFL)
    os.kill(os.getpid(), _signal.SIGINT)
