"""The frame codec the per-host agent and its peers speak (the kernel's remote targets, the Ray actor
that relays frames): 4-byte big-endian length, then a JSON object with a "type". Heartbeats, the
frame limit and the package version both sides compare live here too. A leaf: json, struct, base64.
"""
from __future__ import annotations

import base64
import json
import struct

MAX_FRAME = 1 << 30            # a frame over 1 GiB is refused (a --push that large belongs on shared storage)
HEARTBEAT_EVERY = 1.0          # seconds between pings, both ways
HEARTBEAT_TIMEOUT = 15.0       # no frame for this long: the other side is gone


class ChannelClosed(EOFError):
    """The other end of the channel went away."""


def encode(message: dict) -> bytes:
    body = json.dumps(message, separators=(",", ":")).encode()
    return struct.pack(">I", len(body)) + body


def read_exact(stream, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = stream.read(n - got)
        if not chunk:
            raise ChannelClosed("the channel closed")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def read_body(stream) -> bytes:
    """The next frame's JSON bytes from a binary stream; ChannelClosed at its end."""
    (size,) = struct.unpack(">I", read_exact(stream, 4))
    if size > MAX_FRAME:
        raise ValueError(f"a frame of {size} bytes is over the {MAX_FRAME}-byte limit")
    return read_exact(stream, size)


def parse(body: bytes) -> dict:
    """A frame's JSON bytes as a message; ValueError on garbage."""
    message = json.loads(body)
    if not isinstance(message, dict) or not isinstance(message.get("type"), str):
        raise ValueError("a frame is not an object with a type")
    return message


def decode(stream) -> dict:
    """The next frame from a binary stream; ChannelClosed at its end, ValueError on garbage."""
    return parse(read_body(stream))


def b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode()


def unb64(text: str | None) -> bytes | None:
    return None if text is None else base64.b64decode(text)


def version() -> str:
    """This sdp_jupyter's version, as the hello says it (the package's own `__version__`, which its
    metadata is made from: reading the metadata instead cost every agent 40 ms at start)."""
    from sdp_jupyter import __version__

    return __version__
