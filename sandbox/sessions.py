"""A session as the pool keeps it: where it lives, whether its process is there, and the history that rebuilds it.

What the caller sees in `result["session"]`:
  state "new"       first cell of the session: fresh globals
  state "live"      the session's process was still there: globals as left by its earlier cells
  state "replayed"  the session had been evicted (idle / memory / capacity) or its sandbox was recycled,
                    crashed or lost the process: its earlier cells were re-run, output discarded and errors
                    ignored (as rStar2's jupyter tool does), then this cell ran. Cells are re-run, not
                    restored: randomness, time and I/O may differ ("replay_note" says why it happened).
  state "lost"      earlier state could not be rebuilt (its history outgrew max_history_bytes, or this service
                    never saw the earlier cells, e.g. after the client moved the session off a dead node):
                    the cell ran on fresh globals.
  "rolled_back": true   this cell did not finish (timeout, crash, os._exit, ...), or its state could not be
                    carried on: the session keeps the state from before it, and the cell is not part of the
                    replay history.
Where sessions are placed, evicted and forgotten is the pool's (sandbox/pool.py): it knows the sandboxes.
"""
from __future__ import annotations

import dataclasses
import time


@dataclasses.dataclass
class Session:
    sid: str
    slot: int | None = None
    live: bool = False             # a holder process exists in `slot`
    history: list = dataclasses.field(default_factory=list)   # (code, stdin, timeout_s) of kept cells
    history_bytes: int = 0
    history_lost: bool = False
    cells: int = 0
    pending: int = 0
    last_used: float = 0.0
    pss: int = 0
    why_gone: str | None = None   # why the live state went away (evicted: idle, memory, ...)
    released: bool = False        # its owner is done with it: forget it once its queued cells have run
    parked: list = dataclasses.field(default_factory=list)   # its jobs while no sandbox has room for it

    def prepare(self, call: dict, max_history_bytes: int) -> dict:
        """The caller's view of the state the next cell (`call`) starts from; "replayed": the pool re-runs
        `history` first."""
        info = {"id": self.sid, "state": "live", "cells": self.cells}
        if self.live:
            return info
        if self.cells == 0 and not self.history:
            if call.get("session_seq", 0) > 0:
                info["state"] = "lost"
                info["note"] = (f"this service has no record of the session's {call['session_seq']} earlier "
                                "cell(s) (the session moved here from another service?): fresh globals")
            else:
                info["state"] = "new"
            return info
        if self.history_lost:
            info["state"] = "lost"
            info["note"] = (f"{self.why_gone or 'state gone'}; the history outgrew max_history_bytes="
                            f"{max_history_bytes}, so it could not be replayed: fresh globals")
            self.history_lost = False
            return info
        info["state"] = "replayed"
        info["replayed_cells"] = len(self.history)
        info["note"] = f"{self.why_gone or 'state gone'}; earlier cells re-run with output discarded"
        return info

    def finish(self, call: dict, reply: dict, info: dict, max_history_bytes: int) -> None:
        """Take the sandbox's `reply` to the cell `call`: whether the process lives on, and the history."""
        self.pending -= 1
        self.last_used = time.time()
        alive = bool(reply.get("session_alive"))
        rolled_back = bool(reply.get("session_rolled_back"))
        info["rolled_back"] = rolled_back or not alive
        if reply.get("session_note") and info["state"] == "live":
            # the holder vanished between calls (e.g. killed by another session's cell): treat as lost
            info["state"], info["note"] = "lost", reply["session_note"]
        self.live = alive
        self.pss = int(reply.get("session_pss") or 0)
        if not alive:
            self.why_gone = reply.get("reason") or "session process died"
        if alive and not rolled_back:
            self.cells += 1
            size = len(call["code"]) + len(call["stdin"])
            if self.history_bytes + size > max_history_bytes:
                self.history_lost = True   # replay would be wrong without every kept cell
                self.history.clear()
            if not self.history_lost:
                self.history.append((call["code"], call["stdin"], call["timeout_s"]))
                self.history_bytes += size
        info["cells"] = self.cells
