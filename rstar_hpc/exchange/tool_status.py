"""Tool-call statuses: the words every role uses for how a tool call ended. Stdlib only (no pyarrow), so the
sandbox service can import it too.

The sandbox service reports nine of them (`sandbox.results`); the agent loop adds `parse_error` for a call
whose JSON did not parse. A trajectory records one per call (`ToolCall.status` in schema.py), and the algorithm
reads them (`rstar_hpc.algo.quality`: p_err counts FAILED ones and leaves INFRA ones out).
"""
from __future__ import annotations

TOOL_STATUSES = ("ok", "error", "timeout", "memory", "output_truncated", "killed", "invalid_request", "parse_error",
                 "internal_error", "unavailable")
"""Every status a tool call can carry, in a fixed order (synthetic data draws from it by index)."""
INFRA_TOOL_STATUSES = frozenset({"internal_error", "unavailable"})
"""The sandbox infrastructure failed (a sandbox died mid-call, no service reachable after the client's retries):
no verdict on the model's code, so these calls count neither as failed nor as made in p_err."""
FAILED_TOOL_STATUSES = frozenset({"error", "timeout", "memory", "killed", "invalid_request", "parse_error"})
"""Statuses counted as failed calls in p_err: raised an exception or exited non-zero (`error`), ran out
of wall/CPU time (`timeout`) or memory (`memory`), was killed by the sandbox (`killed`), named an unknown
tool or lacked arguments (`invalid_request`), or its JSON could not be parsed (`parse_error`)."""
