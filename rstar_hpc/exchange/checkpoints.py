"""CommittedDirs: numbered directories (checkpoints, published policies) with a `latest` pointer.

Commit protocol (write into a temporary directory, fsync, publish by rename, then move `latest`), for
`<root>/<prefix>-00000123/`:
  1. `begin(123)` makes `<root>/.<prefix>-00000123.tmp-<host>-<pid>-<thread>/`; it inherits the root's Lustre layout.
  2. The caller's ranks write (and fsync) their files into it.
  3. `commit(123, tmp)` fsyncs every file, writes the marker COMMITTED.json (file sizes + caller metadata)
     atomically inside, renames the directory to its final name, fsyncs the root, and only then replaces
     `<root>/latest` (tmp + fsync + rename) with the directory name.
Readers trust `latest()` only if the directory it names holds the marker; otherwise (pointer lost or torn by a
crash) they fall back to the highest complete directory. `retain(k)` keeps the last k complete ones and never
the one `latest` names. Single writer: one coordinator (rank 0) commits, moves `latest` and prunes.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from pathlib import Path

from rstar_hpc.exchange.atomic import atomic_write_json, atomic_write_text, fsync_dir, is_tmp, tmp_name
from rstar_hpc.exchange.errors import ExchangeError, storage_guard

MARKER = "COMMITTED.json"
LATEST = "latest"
log = logging.getLogger(__name__)


class CommittedDirs:
    def __init__(self, root: str | os.PathLike, prefix: str = "step"):
        self.root, self.prefix = Path(root), prefix
        self._pattern = re.compile(rf"{re.escape(prefix)}-(\d+)")

    def path(self, step: int) -> Path:
        return self.root / f"{self.prefix}-{step:08d}"

    @property
    def latest_pointer(self) -> Path:
        return self.root / LATEST

    def begin(self, step: int) -> Path:
        """A fresh, empty in-progress directory for `step` (a leftover of a crashed attempt is replaced)."""
        tmp = Path(tmp_name(self.path(step)))
        with storage_guard(tmp, "directory"):
            self.root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
        return tmp

    def discard(self, tmp: str | os.PathLike) -> None:
        """Remove an in-progress directory whose save failed: it is never read, and on a full file system it
        holds the space the next attempt needs."""
        if not is_tmp(Path(tmp).name):
            raise ExchangeError(f"discard({tmp}): not an in-progress directory (begin() makes those); a committed "
                                f"directory is removed by retain() only")
        shutil.rmtree(tmp, ignore_errors=True)

    def guard(self, tmp: str | os.PathLike, what: str):
        """Around the caller's writes into `tmp` (step 2): a full or failing file system raises StorageError
        naming the directory and the free space, after discarding `tmp`."""
        return storage_guard(tmp, what, cleanup=lambda: self.discard(tmp))

    def commit(self, step: int, tmp: str | os.PathLike, **meta: object) -> Path:
        """Seal `tmp` as `step` and move `latest` to it; returns the final directory."""
        tmp, final = Path(tmp), self.path(step)
        latest = self.latest()
        if latest is not None and latest[0] >= step:
            raise ExchangeError(f"cannot commit {final.name}: {self.latest_pointer} already names "
                                f"{self.path(latest[0]).name}. Resume from latest() and save later steps; a "
                                f"committed directory is never rewritten.")
        files = {}
        # a failure before the rename leaves `latest` where it was and discards tmp (see guard)
        with self.guard(tmp, f"commit marker of {final.name} in"):
            for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
                with open(path, "rb") as f:
                    os.fsync(f.fileno())
                files[str(path.relative_to(tmp))] = path.stat().st_size
            atomic_write_json(tmp / MARKER, {"step": step, "files": files, "committed_at": time.time(), **meta})
            if final.exists():
                # a newer-than-latest orphan from a crash between rename and pointer update: latest never named it
                shutil.rmtree(final)
            os.rename(tmp, final)
        fsync_dir(self.root)
        # failing here, `final` is complete and latest() already falls back to it (the newest with a marker)
        atomic_write_text(self.latest_pointer, final.name + "\n", what="latest pointer")
        return final

    def is_complete(self, step: int) -> bool:
        return (self.path(step) / MARKER).is_file()

    def complete_steps(self) -> list[int]:
        steps = []
        for name in _listdir(self.root):
            m = self._pattern.fullmatch(name)
            if m and (self.root / name / MARKER).is_file():
                steps.append(int(m.group(1)))
        return sorted(steps)

    def latest(self) -> tuple[int, Path] | None:
        """(step, directory) of the newest complete commit, or None."""
        try:
            name = self.latest_pointer.read_text().strip()
        except FileNotFoundError:
            name = ""
        m = self._pattern.fullmatch(name)
        if m and (self.root / name / MARKER).is_file():
            return int(m.group(1)), self.root / name
        if name:
            log.warning("%s names %r, which is not a complete commit; falling back to the newest complete one",
                        self.latest_pointer, name)
        steps = self.complete_steps()
        return (steps[-1], self.path(steps[-1])) if steps else None

    def marker(self, step: int) -> dict:
        return json.loads((self.path(step) / MARKER).read_text())

    def retain(self, keep: int, tmp_older_than_s: float = 3600.0) -> list[Path]:
        """Delete all but the newest `keep` complete directories (never `latest`'s), and in-progress ones
        untouched for `tmp_older_than_s`. Failures (NFS silly-renames of open files) are logged, retried next time."""
        if keep < 1:
            raise ValueError(f"retain(keep={keep}): keep at least 1 (the one `latest` names)")
        latest = self.latest()
        protected = {latest[0]} if latest else set()
        steps = self.complete_steps()
        doomed = [self.path(s) for s in steps[:-keep] if s not in protected]
        now = time.time()
        for name in _listdir(self.root, hidden=True):
            path = self.root / name
            if is_tmp(name) and path.is_dir() and now - path.stat().st_mtime > tmp_older_than_s:
                doomed.append(path)
        removed = []
        for path in doomed:
            try:
                shutil.rmtree(path)
                removed.append(path)
            except OSError as e:
                log.warning("retention could not delete %s (%s); will retry on the next commit", path, e)
        return removed


def _listdir(folder: Path, hidden: bool = False) -> list[str]:
    try:
        return sorted(n for n in os.listdir(folder) if hidden or not n.startswith("."))
    except FileNotFoundError:
        return []
