"""A session's cells and answers between a node's agent and its ranks (launch/host/session_relay.py):
frames over an abstract Unix socket, answered only for this job's ranks; a rank that connects late (a
replacement) gets the cell it joins in."""
from __future__ import annotations

import queue
import socket

import pytest

from sdp_jupyter.launch import channel
from sdp_jupyter.launch.host.session_relay import KEEP, SessionRelay

SECRET = "s" * 64


@pytest.fixture
def relay():
    sent: queue.Queue = queue.Queue()
    r = SessionRelay(sent.put, SECRET)
    r.sent = sent
    yield r
    r.close()


def connect(relay, rank: int, first: int = 0, secret: str = SECRET):
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect("\0" + relay.name)
    conn.settimeout(5)
    conn.sendall(channel.encode({"type": "hello", "rank": rank, "secret": secret, "first": first}))
    return conn, conn.makefile("rb")


def cell(n: int) -> dict:
    return {"type": "cell", "n": n, "data": channel.b64(f"cell {n}".encode())}


def test_cells_go_to_every_rank_and_answers_come_back_as_frames(relay):
    ranks = [connect(relay, r) for r in range(2)]
    for conn, _ in ranks:
        conn.sendall(channel.encode({"type": "ready", "data": channel.b64(b"r")}))
    assert {relay.sent.get(timeout=5)["rank"] for _ in ranks} == {0, 1}  # both registered before the cell
    relay.cell(cell(0))
    for r, (conn, reader) in enumerate(ranks):
        assert channel.decode(reader) == cell(0)
        conn.sendall(channel.encode({"type": "done", "n": 0, "data": channel.b64(b"answer %d" % r)}))
    answers = sorted((m["kind"], m["rank"], m["n"], channel.unb64(m["data"])) for m in
                     (relay.sent.get(timeout=5) for _ in ranks))
    assert answers == [("done", 0, 0, b"answer 0"), ("done", 1, 0, b"answer 1")]


def test_a_rank_that_connects_late_gets_the_kept_cells_from_the_one_it_joins_in(relay):
    for n in range(KEEP + 2):
        relay.cell(cell(n))
    conn, reader = connect(relay, 3, first=KEEP)  # a replacement that joins in cell KEEP
    assert [channel.decode(reader)["n"] for _ in range(2)] == [KEEP, KEEP + 1]
    relay.cell(cell(KEEP + 2))
    assert channel.decode(reader)["n"] == KEEP + 2


def test_a_connection_without_the_jobs_secret_is_closed_unheard(relay):
    conn, reader = connect(relay, 0, secret="not the secret")
    try:
        conn.sendall(channel.encode({"type": "done", "n": 0, "data": channel.b64(b"forged")}))
    except (BrokenPipeError, ConnectionResetError):
        pass  # the relay closed it first
    relay.cell(cell(0))
    with pytest.raises((channel.ChannelClosed, ConnectionResetError)):  # (reset: it closed with our frame unread)
        channel.decode(reader)  # no cell reached it: the relay closed it
    with pytest.raises(queue.Empty):
        relay.sent.get(timeout=0.5)  # and nothing it said went to the launcher
