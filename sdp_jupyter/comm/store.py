"""The rendezvous store: a small key-value server for ranks to find each other, without torch.

Rank 0 serves it on MASTER_ADDR:MASTER_PORT; every rank (rank 0 included) is a client. `get`
blocks until the key exists. torch's c10d stores offer the same two calls, so the communicator
accepts either.

Only processes that know the job secret may use it (docs/security.md). A connection starts with a
mutual HMAC-SHA256 challenge over two fresh nonces; a client that fails it is disconnected
before any request is read, so a stranger who reaches MASTER_PORT reads nothing and changes
nothing. The secret itself never travels and is never stored. Everything is bounded: key and
value sizes, the number of keys and of connections, every wait (a `get` timeout must be finite).
"""
from __future__ import annotations

import hmac
import hashlib
import math
import os
import socket
import socketserver
import struct
import threading
import time

MAX_PARTS = 4
MAX_KEY = 512
MAX_VALUE = 1 << 20
MAX_KEYS = 65536
MAX_CONNECTIONS = 512
MAX_GET_TIMEOUT = 86400.0
HANDSHAKE_SECONDS = 5.0
_HELLO = b"SDPS1"


class StoreAuthError(ConnectionError):
    """The other end of a store connection does not know the job secret."""


def _mac(secret: bytes, label: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, label + b"".join(parts), hashlib.sha256).digest()


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
    if not 1 <= nparts <= MAX_PARTS:
        raise ConnectionError("malformed store message")
    parts = []
    for _ in range(nparts):
        (n,) = struct.unpack("!I", _recv_exact(sock, 4))
        if n > MAX_VALUE:
            raise ConnectionError("store value too large")
        parts.append(_recv_exact(sock, n))
    return parts


def parse_request(parts: list[bytes]) -> tuple[str, bytes, bytes | float]:
    """Validate one request: ('set', key, value) or ('get', key, timeout seconds).
    Raises ValueError for anything else (the server then drops the connection)."""
    if len(parts) != 3 or not parts[1] or len(parts[1]) > MAX_KEY:
        raise ValueError("malformed request")
    if parts[0] == b"set":
        return "set", parts[1], parts[2]
    if parts[0] == b"get":
        timeout = float(parts[2].decode("ascii"))
        if not math.isfinite(timeout) or timeout < 0:
            raise ValueError("a get timeout must be a finite number of seconds")
        return "get", parts[1], min(timeout, MAX_GET_TIMEOUT)
    raise ValueError("unknown request")


class _Handler(socketserver.BaseRequestHandler):
    def handle(self):
        server: StoreServer = self.server  # type: ignore[assignment]
        sock = self.request
        try:
            sock.settimeout(HANDSHAKE_SECONDS)
            nonce = os.urandom(32)
            sock.sendall(_HELLO + nonce)
            proof = _recv_exact(sock, 64)
            client_nonce, mac = proof[:32], proof[32:]
            if not hmac.compare_digest(mac, _mac(server.secret, b"store-client", nonce, client_nonce)):
                return  # a stranger: say nothing more
            sock.sendall(_mac(server.secret, b"store-server", client_nonce, nonce))
            sock.settimeout(None)
            while True:
                kind, key, arg = parse_request(_recv_msg(sock))
                if kind == "set":
                    with server.cond:
                        if key not in server.data and len(server.data) >= MAX_KEYS:
                            _send_msg(sock, b"full")
                            continue
                        server.data[key] = arg  # type: ignore[assignment]
                        server.cond.notify_all()
                    _send_msg(sock, b"ok")
                else:
                    deadline = time.monotonic() + float(arg)  # type: ignore[arg-type]
                    with server.cond:
                        while key not in server.data:
                            left = deadline - time.monotonic()
                            if left <= 0 or server.closing:
                                break
                            server.cond.wait(min(left, 0.5))
                        value = server.data.get(key)
                    _send_msg(sock, *([b"ok", value] if value is not None else [b"timeout"]))
        except (ConnectionError, OSError, struct.error, ValueError, UnicodeDecodeError):
            return


class StoreServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, host: str, port: int, secret: bytes):
        self.secret = secret
        self.data: dict[bytes, bytes] = {}
        self.cond = threading.Condition()
        self.closing = False
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        super().__init__((host, port), _Handler)
        self.thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
        self.thread.start()

    def verify_request(self, request, client_address) -> bool:
        # At most MAX_CONNECTIONS at once: a flood of connections cannot exhaust threads.
        return self._slots.acquire(blocking=False)

    def shutdown_request(self, request):
        try:
            super().shutdown_request(request)
        finally:
            self._slots.release()

    def close(self):
        self.closing = True
        with self.cond:
            self.cond.notify_all()
        self.shutdown()
        self.server_close()


class TCPKeyValueStore:
    """Client of a StoreServer; `server=True` also starts the server (rank 0).

    `secret` (bytes, at least 16) authenticates this client to the server and the server to it.
    """

    def __init__(self, host: str, port: int, server: bool = False, timeout: float = 300.0,
                 secret: bytes | None = None):
        if secret is None:
            from sdp_jupyter.comm.secret import env_secret

            secret = env_secret().value
        if not math.isfinite(timeout) or timeout <= 0:
            raise ValueError(f"store timeout must be a positive finite number of seconds, not {timeout!r}")
        self.timeout = timeout
        self._secret = secret
        self._server = StoreServer(host, port, secret) if server else None
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while True:
            try:
                self._sock = self._connect(host, port)
                break
            except StoreAuthError:
                raise
            except OSError as exc:
                last = exc
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"could not reach the rendezvous store at {host}:{port} ({last}); "
                        "is rank 0 running and MASTER_ADDR/MASTER_PORT the same on every rank?"
                    ) from exc
                time.sleep(0.05)
        self._lock = threading.Lock()

    def _connect(self, host: str, port: int) -> socket.socket:
        sock = socket.create_connection((host, port), timeout=10)
        try:
            sock.settimeout(HANDSHAKE_SECONDS)
            hello = _recv_exact(sock, len(_HELLO) + 32)
            if hello[:len(_HELLO)] != _HELLO:
                raise StoreAuthError(f"{host}:{port} is not an sdp_jupyter rendezvous store")
            nonce, client_nonce = hello[len(_HELLO):], os.urandom(32)
            sock.sendall(client_nonce + _mac(self._secret, b"store-client", nonce, client_nonce))
            try:
                answer = _recv_exact(sock, 32)
            except ConnectionError:
                raise StoreAuthError(
                    f"the rendezvous store at {host}:{port} refused this rank: SDP_JOB_SECRET differs "
                    "between ranks (set the same value on every rank)") from None
            if not hmac.compare_digest(answer, _mac(self._secret, b"store-server", client_nonce, nonce)):
                raise StoreAuthError(f"the rendezvous store at {host}:{port} does not know the job secret")
        except BaseException:
            sock.close()
            raise
        return sock

    def _request(self, io_timeout: float, *parts: bytes) -> list[bytes]:
        with self._lock:
            self._sock.settimeout(io_timeout)
            try:
                _send_msg(self._sock, *parts)
                return _recv_msg(self._sock)
            except socket.timeout:
                raise TimeoutError("the rendezvous store did not answer in time") from None

    def set(self, key: str, value: bytes | str) -> None:
        if isinstance(value, str):
            value = value.encode()
        reply = self._request(30.0, b"set", key.encode(), value)
        if reply[0] != b"ok":
            raise RuntimeError(f"the rendezvous store refused '{key}' ({reply[0].decode(errors='replace')})")

    def get(self, key: str) -> bytes:
        reply = self._request(self.timeout + 10.0, b"get", key.encode(), repr(float(self.timeout)).encode())
        if reply[0] != b"ok":
            raise TimeoutError(f"timed out after {self.timeout:g} s waiting for '{key}' in the rendezvous store")
        return reply[1]

    def close_server(self) -> None:
        """Stop serving (rank 0, once every rank has what it needs); the client stays usable."""
        if self._server is not None:
            self._server.close()
            self._server = None

    def close(self) -> None:
        try:
            self._sock.close()
        finally:
            self.close_server()
