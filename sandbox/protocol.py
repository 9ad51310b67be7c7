"""Wire format between clients and the service, and validation of one call.

A frame is a 4-byte big-endian length and that many bytes of UTF-8 JSON. Client -> service:
    {"op": "exec", "rid": 7, "calls": [call, ...]}    at most MAX_BATCH calls
    {"op": "stats", "rid": 8}  |  {"op": "ping", "rid": 9}
    {"op": "release", "rid": 10, "sessions": [id, ...]}   the caller is done with these sessions: free them
Service -> client, one frame per finished call, in completion order:
    {"rid": 7, "i": 0, "result": {...}}
and {"rid": 8, "stats": {...}} / {"rid": 9, "ok": true} / {"rid": 10, "released": n} (sessions it knew);
{"rid": r, "error": "..."} for a bad frame.
A call: {"id": any JSON, "code": str, "stdin": str = "", "session": str | null = null,
         "timeout_s": number = service default, "session_seq": int = 0 (this cell's index in its session,
         so a service that never saw the session can tell that earlier state is missing)}.
"""
from __future__ import annotations

import asyncio
import json
import struct

from sandbox.limits import Limits
from sandbox.results import make_result

MAX_BATCH = 64
_HDR = struct.Struct(">I")


class FrameTooLarge(ValueError):
    pass


def encode(obj: object) -> bytes:
    body = json.dumps(obj, separators=(",", ":")).encode()
    return _HDR.pack(len(body)) + body


async def read_frame(reader: asyncio.StreamReader, max_bytes: int) -> object | None:
    try:
        hdr = await reader.readexactly(4)
    except asyncio.IncompleteReadError:
        return None
    (n,) = _HDR.unpack(hdr)
    if n > max_bytes:
        raise FrameTooLarge(f"frame of {n} bytes exceeds the service's max_request_bytes={max_bytes}")
    body = await reader.readexactly(n)
    return json.loads(body)


def validate_call(obj: object, limits: Limits) -> tuple[dict | None, dict | None]:
    """(call, None) for a good call, (None, invalid_request result) otherwise."""
    cid = obj.get("id") if isinstance(obj, dict) else None

    def bad(msg: str) -> tuple[None, dict]:
        return None, make_result(cid, "invalid_request", msg)

    if not isinstance(obj, dict):
        return bad(f"a call must be a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - {"id", "code", "stdin", "session", "timeout_s", "session_seq"})
    if unknown:
        return bad(f"unknown keys {unknown}; a call has id, code, stdin, session, timeout_s, session_seq")
    code, stdin = obj.get("code"), obj.get("stdin", "")
    if stdin is None:
        stdin = ""
    if not isinstance(code, str):
        return bad("'code' must be a string")
    if not isinstance(stdin, str):
        return bad("'stdin' must be a string")
    if len(code.encode("utf-8", "surrogatepass")) > limits.max_code_bytes:
        return bad(f"code exceeds max_code_bytes={limits.max_code_bytes}")
    if len(stdin.encode("utf-8", "surrogatepass")) > limits.max_stdin_bytes:
        return bad(f"stdin exceeds max_stdin_bytes={limits.max_stdin_bytes}")
    if "\x00" in code:
        return bad("code contains a NUL byte")
    session = obj.get("session")
    if session is not None and (not isinstance(session, str) or not 0 < len(session) <= 256):
        return bad("'session' must be null or a string of 1..256 characters")
    timeout = obj.get("timeout_s", limits.timeout_s)
    if timeout is None:
        timeout = limits.timeout_s
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= limits.max_timeout_s:
        return bad(f"'timeout_s' must be a number in (0, {limits.max_timeout_s}]")
    seq = obj.get("session_seq", 0)
    if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
        return bad("'session_seq' must be a non-negative integer")
    return {"id": cid, "code": code, "stdin": stdin, "session": session, "timeout_s": float(timeout),
            "session_seq": seq}, None
