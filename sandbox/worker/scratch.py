"""The writable places of a sandbox (its private /tmp and /dev/shm tmpfs): the work directories of calls and
sessions, and the wipe after every call. What bwrap put there before any call (the directories leading to an
interpreter bound under /tmp, and the bind itself: a venv in $TMPDIR, a checkout under /tmp) is the skeleton:
never removed, and the wipe never descends into another mount. Run only in a sandbox (server.py checks)."""
import os

from .settings import SCRIPT

ROOTS = ("/tmp", "/dev/shm")


def rmtree(path):
    # imported here, in pid 1 only, not at start: shutil maps zlib, bz2 and lzma (~30 memory areas) into the
    # interpreter every cell is forked from, and each fork and exit would copy and tear down their page tables
    import shutil
    shutil.rmtree(path, ignore_errors=True)


def scan_skeleton():
    """{path: is a directory of the scratch tmpfs} for everything under the roots at start-up; a path on
    another device (an interpreter's read-only bind) maps to False and is never entered."""
    found = {}
    for root in ROOTS:
        dev = os.lstat(root).st_dev
        todo = [root]
        while todo:
            d = todo.pop()
            for entry in os.scandir(d):
                st = entry.stat(follow_symlinks=False)
                inside = st.st_dev == dev and entry.is_dir(follow_symlinks=False)
                found[entry.path] = inside
                if inside:
                    todo.append(entry.path)
    return found


def make_workdir(name):
    """/tmp/<name>, empty and private to the sandbox's uid."""
    path = f"/tmp/{name}"
    try:
        os.mkdir(path, 0o700)   # usually gone already: the wipe removed it
    except FileExistsError:
        rmtree(path)
        os.mkdir(path, 0o700)
    return path


def wipe(skeleton, keep, roots=ROOTS):
    """Remove whatever the call left in the writable places, except `keep` (live sessions' and the spare's
    directories) and the skeleton: nothing outside the scratch tmpfs is ever walked or deleted."""
    for top in roots:
        try:
            names = os.listdir(top)
        except OSError:
            continue
        for name in names:
            path = os.path.join(top, name)
            if path in keep:
                continue
            if path in skeleton:
                if skeleton[path]:
                    wipe(skeleton, keep, (path,))   # a directory leading to a bind: clean what a cell added in it
                continue
            if os.path.isdir(path) and not os.path.islink(path):
                try:
                    os.unlink(path + "/" + SCRIPT)   # the usual case: the call left only its script
                except OSError:
                    pass
                try:
                    os.rmdir(path)
                except OSError:
                    rmtree(path)
            else:
                try:
                    os.unlink(path)
                except OSError:
                    pass
