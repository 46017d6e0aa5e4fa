"""A minimal key-value store for rendezvous without torch.

Rank 0 serves it on MASTER_ADDR:MASTER_PORT; every rank (rank 0 included) is a client.
`get` blocks until the key exists. torch's c10d stores offer the same two calls, so the
communicator accepts either.
"""
from __future__ import annotations

import socket
import socketserver
import struct
import threading
import time


def _send_msg(sock: socket.socket, *parts: bytes) -> None:
    payload = b"".join(struct.pack("!I", len(p)) + p for p in parts)
    sock.sendall(struct.pack("!I", len(parts)) + payload)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("store connection closed")
        buf += chunk
    return bytes(buf)


def _recv_msg(sock: socket.socket) -> list[bytes]:
    (nparts,) = struct.unpack("!I", _recv_exact(sock, 4))
    if nparts > 16:
        raise ConnectionError("malformed store message")
    parts = []
    for _ in range(nparts):
        (n,) = struct.unpack("!I", _recv_exact(sock, 4))
        if n > 1 << 20:
            raise ConnectionError("store value too large")
        parts.append(_recv_exact(sock, n))
    return parts


class _Handler(socketserver.BaseRequestHandler):
    def handle(self):
        server: StoreServer = self.server  # type: ignore[assignment]
        try:
            while True:
                parts = _recv_msg(self.request)
                if parts[0] == b"set" and len(parts) == 3:
                    with server.cond:
                        server.data[parts[1]] = parts[2]
                        server.cond.notify_all()
                    _send_msg(self.request, b"ok")
                elif parts[0] == b"get" and len(parts) == 3:
                    timeout = float(parts[2])
                    deadline = time.monotonic() + timeout
                    with server.cond:
                        while parts[1] not in server.data:
                            left = deadline - time.monotonic()
                            if left <= 0 or server.closing:
                                break
                            server.cond.wait(min(left, 0.5))
                        value = server.data.get(parts[1])
                    _send_msg(self.request, *([b"ok", value] if value is not None else [b"timeout"]))
                else:
                    return
        except (ConnectionError, OSError, struct.error, ValueError):
            return


class StoreServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, host: str, port: int):
        self.data: dict[bytes, bytes] = {}
        self.cond = threading.Condition()
        self.closing = False
        super().__init__((host, port), _Handler)
        self.thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
        self.thread.start()

    def close(self):
        self.closing = True
        with self.cond:
            self.cond.notify_all()
        self.shutdown()
        self.server_close()


class TCPKeyValueStore:
    """Client of a StoreServer; `server=True` also starts the server (rank 0)."""

    def __init__(self, host: str, port: int, server: bool = False, timeout: float = 300.0):
        self.timeout = timeout
        self._server = StoreServer(host, port) if server else None
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while True:
            try:
                self._sock = socket.create_connection((host, port), timeout=10)
                break
            except OSError as exc:
                last = exc
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"could not reach the rendezvous store at {host}:{port} ({last}); "
                        "is rank 0 running and MASTER_ADDR/MASTER_PORT the same on every rank?"
                    ) from exc
                time.sleep(0.05)
        self._sock.settimeout(None)
        self._lock = threading.Lock()

    def set(self, key: str, value: bytes | str) -> None:
        if isinstance(value, str):
            value = value.encode()
        with self._lock:
            _send_msg(self._sock, b"set", key.encode(), value)
            _recv_msg(self._sock)

    def get(self, key: str) -> bytes:
        with self._lock:
            _send_msg(self._sock, b"get", key.encode(), str(self.timeout).encode())
            reply = _recv_msg(self._sock)
        if reply[0] != b"ok":
            raise TimeoutError(f"timed out after {self.timeout:g} s waiting for '{key}' in the rendezvous store")
        return reply[1]

    def close(self) -> None:
        try:
            self._sock.close()
        finally:
            if self._server is not None:
                self._server.close()
