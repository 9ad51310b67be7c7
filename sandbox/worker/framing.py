"""Bytes on descriptors and sockets: length-prefixed JSON frames (pid 1 <-> the service, pid 1 <-> holders),
a stateless cell's raw request, descriptors passed with SCM_RIGHTS.

Modules only pid 1 needs are imported where pid 1 uses them, after it has forked the fork server: every module
the fork server holds is in every cell's fork and exit. Sockets use _socket directly (socket.py brings
selectors, select, array and its enums)."""
import _socket
import json
import os
import sys

from .settings import HDR, REQ


def read_exact(fd, n):
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def read_frame(fd):
    hdr = read_exact(fd, 4)
    if hdr is None:
        return None
    body = read_exact(fd, HDR.unpack(hdr)[0])
    return None if body is None else json.loads(body)


def write_all(fd, data):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def write_frame(fd, obj):
    body = json.dumps(obj).encode()
    write_all(fd, HDR.pack(len(body)) + body)


def pack_request(code, stdin):
    """A stateless cell's request, as pid 1 sends it on the cell's own pipe: the lengths of code and stdin,
    then both. Raw bytes, not JSON: decoding a JSON frame cost each forked cell ~15 copy-on-write page faults.
    surrogatepass keeps code that JSON carried with lone surrogates as it was (compile reports it).
    Length-prefixed, not read to EOF: a fork server started later inherits pid 1's end of the pipe."""
    code = code.encode("utf-8", "surrogatepass")
    stdin = stdin.encode("utf-8", "replace")
    return REQ.pack(len(code), len(stdin)) + code + stdin


def read_request(fd):
    """(code, stdin bytes) from pid 1; None if it never fully arrived."""
    hdr = read_exact(fd, REQ.size)
    if hdr is None:
        return None
    n, m = REQ.unpack(hdr)
    body = read_exact(fd, n + m)
    if body is None:
        return None
    return body[:n].decode("utf-8", "surrogatepass"), body[n:]


def _rights(fds):
    return [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, b"".join(fd.to_bytes(4, sys.byteorder, signed=True)
                                                                for fd in fds))]


def send_fds(sock, msg, fds):
    sock.sendmsg([msg], _rights(fds))


def recv_fds(sock, bufsize, maxfds):
    """(message, fds) from one recvmsg; fds beyond maxfds are closed by the kernel (MSG_CTRUNC)."""
    msg, anc, _, _ = sock.recvmsg(bufsize, _socket.CMSG_SPACE(maxfds * 4))
    fds = []
    for level, kind, data in anc:
        if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
            fds += [int.from_bytes(data[i:i + 4], sys.byteorder, signed=True) for i in range(0, len(data) - 3, 4)]
    return msg, fds


def send_session_request(sock, obj, fds):
    """A session cell's request to its holder: a length-prefixed JSON frame, the cell's descriptors attached
    to its first bytes (the channel is a stream socket, so a large frame arrives in pieces)."""
    body = json.dumps(obj).encode()
    data = HDR.pack(len(body)) + body
    sock.settimeout(None)
    sent = sock.sendmsg([data], _rights(fds))
    if sent < len(data):
        sock.sendall(data[sent:])


def recv_session_request(sock):
    """(request, fds) as send_session_request sent them; (None, fds) if the channel closed."""
    data, fds = recv_fds(sock, 65536, 8)
    while 0 < len(data) < HDR.size:
        more = sock.recv(65536)
        if not more:
            return None, fds
        data += more
    if not data:
        return None, fds
    n = HDR.unpack(data[:HDR.size])[0]
    body = bytearray(data[HDR.size:])
    while len(body) < n:
        more = sock.recv(min(1 << 20, n - len(body)))
        if not more:
            return None, fds
        body += more
    return json.loads(body), fds


def socketpair(kind=_socket.SOCK_STREAM):
    return _socket.socketpair(_socket.AF_UNIX, kind)


def readable(fd, timeout):
    import select   # pid 1 only (see the module docstring)
    return bool(select.select([fd], (), (), timeout)[0])


def read_proc(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.read(fd, 4096)
    finally:
        os.close(fd)
