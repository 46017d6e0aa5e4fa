"""An interactive session's cells and answers between a node's agent and its ranks, as frames.

The agent of a session's node (launch/host/agent.py) listens on an abstract Unix socket (no file, no
port; its name reaches the node's ranks as SDP_SESSION_CHANNEL). Each rank (launch/rank/cell_loop.py)
connects once, says who it is (its rank, the job's secret, the first cell it waits for) and then reads
cells and writes answers on that connection, blocking: no folder is polled on either side. The agent
hands every cell the launcher sends to each rank of its node (a writer thread per rank, so a rank busy
in a long cell never holds the agent's frame loop) and every answer back to the launcher as an
`answer` frame. It keeps the last few cells, so a rank started again after a death (SDP_SESSION_JOIN)
finds the cell it joins in even when that cell came before it connected. A connection from another
user, or without the job's secret, is closed unheard.

    rank -> agent   hello {rank, secret, first}   ready {rank, data}   done {rank, n, data}
    agent -> rank   cell {n, data}                (data: a pickle, base64; made once in the kernel)
"""
from __future__ import annotations

import hmac
import os
import queue
import secrets
import socket
import struct
import threading
from typing import Callable

from sdp_jupyter.launch.channel import ChannelClosed, decode, encode

KEEP = 4  # cells kept for a rank that connects late (a replacement joins the newest)


class SessionRelay:
    """One node's end of its ranks' session connections; `send` puts a frame to the launcher."""

    def __init__(self, send: Callable[[dict], None], secret: str):
        self.send, self.secret = send, secret
        self.name = f"sdp-session-{os.getpid()}-{secrets.token_hex(8)}"
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind("\0" + self.name)
        self._listener.listen(64)
        self._lock = threading.Lock()
        self._cells: list[dict] = []  # the newest KEEP cell frames, in order
        self._ranks: dict[int, queue.Queue] = {}  # rank -> its writer's queue (None ends the writer)
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="sdp-session-accept").start()

    def cell(self, frame: dict) -> None:
        """A cell from the launcher, for every rank of this node (and kept for one that connects later)."""
        frame = {"type": "cell", "n": int(frame["n"]), "data": frame["data"]}
        with self._lock:
            self._cells = (self._cells + [frame])[-KEEP:]
            for out in self._ranks.values():
                out.put(frame)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for out in self._ranks.values():
                out.put(None)
            self._ranks.clear()
        try:
            self._listener.close()
        except OSError:
            pass

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True, name="sdp-session-rank").start()

    def _serve(self, conn: socket.socket) -> None:
        reader = conn.makefile("rb")
        out, rank = None, -1
        try:
            uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[1]
            hello = decode(reader)
            if uid != os.getuid() or hello.get("type") != "hello" \
                    or not hmac.compare_digest(str(hello.get("secret", "")), self.secret):
                return  # another user's process, or not one of this job's ranks
            rank, first = int(hello["rank"]), int(hello.get("first", 0))
            out = queue.Queue()
            with self._lock:
                if self._closed:
                    return
                old = self._ranks.get(rank)
                if old is not None:  # its earlier process died: the new one takes its place
                    old.put(None)
                self._ranks[rank] = out
                for frame in self._cells:
                    if frame["n"] >= first:
                        out.put(frame)
            threading.Thread(target=self._write, args=(conn, out), daemon=True, name=f"sdp-session-to{rank}").start()
            while True:
                message = decode(reader)
                if message.get("type") in ("ready", "done"):
                    self.send({"type": "answer", "kind": message["type"], "rank": rank, "n": message.get("n"),
                               "data": message["data"]})
        except (ChannelClosed, OSError, ValueError, KeyError):
            pass
        finally:
            with self._lock:
                if out is not None and self._ranks.get(rank) is out:  # its process ended: no more cells for it
                    del self._ranks[rank]
                    out.put(None)
            reader.close()
            conn.close()

    @staticmethod
    def _write(conn: socket.socket, out: queue.Queue) -> None:
        while True:
            frame = out.get()
            if frame is None:
                return
            try:
                conn.sendall(encode(frame))
            except OSError:
                return
