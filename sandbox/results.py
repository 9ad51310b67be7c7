"""Results: the structured record every call gets, and the rStar2 text the model sees.

Status values:
  ok                its process exited with status 0 (a SystemExit(0) or os._exit(0) counts)
  error             it exited non-zero: an uncaught exception (exc_type, traceback), sys.exit(n), ...; or an
                    uncaught KeyboardInterrupt (death by SIGINT, as CPython's); `reason` names a sandbox limit
                    when one caused it (processes, open files, file size, scratch space, network)
  timeout           wall or CPU time limit; the cell was killed
  memory            an uncaught MemoryError under the address-space limit
  output_truncated  output beyond max_output_bytes (head + tail kept); killed if it passed output_kill_bytes
  killed            ended by a signal we did not send (SIGSEGV from a C stack overflow, the OOM killer, ...)
  invalid_request   the request itself was malformed (message in `reason`); nothing ran
  internal_error    the sandbox failed while running the call (the call may have run: `maybe_executed`)
  unavailable       no service could take the call; it did not run
"""
from __future__ import annotations

from rstar_hpc.exchange.tool_status import TOOL_STATUSES

STATUSES = tuple(s for s in TOOL_STATUSES if s != "parse_error")   # parse_error is the agent loop's, not ours
SUCCESS = ("ok", "output_truncated")


def make_result(call_id: object, status: str, reason: str | None = None, **fields: object) -> dict:
    assert status in STATUSES, status
    r = {"id": call_id, "status": status, "stdout": "", "stderr": "", "exc_type": None, "traceback": None,
         "reason": reason, "wall_s": 0.0, "cpu_s": 0.0, "queue_s": 0.0, "session": None, "attempts": 1,
         "maybe_executed": False}
    r.update(fields)
    return r


def truncate_middle(text: str, max_chars: int, marker: str = "...(truncated)...") -> str:
    """verl's rule for tool responses: keep head and tail halves around a marker."""
    if max_chars <= 0 or len(text) <= max_chars:
        return text
    half = max_chars // 2
    return text[:half] + marker + text[len(text) - half:]


_RSTAR2_REASON = {"timeout": "worker_timeout", "internal_error": "internal_error",
                  "unavailable": "internal_error", "invalid_request": "invalid_input", "error": ""}


def render_rstar2(result: dict, max_chars: int = 0) -> str:
    """The text rStar2-Agent's model was trained on (code-judge + rStar's `run_tool_calls_on_server_async`):

        Tool call success            |  Tool call failure
        stdout: ...   (if any)       |  reason: worker_timeout | internal_error | ...
        stderr: ...   (if any)       |  stdout: ... / stderr: ... (if any)
        execution time: 0.12s        |  execution time: 4.00s

    A cell killed for flooding output is a failure. `max_chars` > 0 applies verl's middle truncation
    (rStar2 ran with 256).
    """
    status = result.get("status")
    reason = result.get("reason") or ""
    success = status in SUCCESS and "killed" not in reason
    lines = ["Tool call success"] if success else \
        ["Tool call failure", "reason: " + _RSTAR2_REASON.get(status, reason)]
    if result.get("stdout"):
        lines.append("stdout: " + result["stdout"])
    if result.get("stderr"):
        lines.append("stderr: " + result["stderr"])
    lines.append(f"execution time: {float(result.get('wall_s') or 0.0):.2f}s")
    return truncate_middle("\n".join(lines), max_chars)
