"""Bounded, seeded, structure-aware fuzzing of what crosses a trust boundary (issue 11):

- the engine's handshake (a stranger's client proof: mutated fields, short, long, garbage);
- the engine's frames, sent by an authenticated peer during a collective (every header field
  mutated, payloads of wrong sizes, error frames with odd bodies);
- the rendezvous store's requests (before and after authentication) and its request parser.

Each target runs for SDP_FUZZ_SECONDS (default 5; give more, or another seed, for a longer hunt)
from a fixed seed (SDP_FUZZ_SEED), in a child process where a crash would kill only the child: the
test fails on any crash (signal), any hang
past the per-case deadline, or any exception other than the engine's own error. Inputs that once
failed are kept in tests/engine/fuzz_corpus/ and replayed first, every run.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
HERE = Path(__file__).resolve().parent
CORPUS = HERE / "fuzz_corpus"
SECONDS = float(os.environ.get("SDP_FUZZ_SECONDS", "5"))
SEED = int(os.environ.get("SDP_FUZZ_SEED", "1234"))

# The child: one fuzz target, bounded in time; prints a JSON summary as its last line.
CHILD = r'''
import hashlib, hmac, json, os, random, socket, struct, sys, threading, time
from sdp_jupyter import _engine

target, seconds, seed, corpus = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
rng = random.Random(seed)
SECRET = b"f" * 32
FRAME = struct.Struct("<IBBBBIIQQQQ")            # native/include/sdp/transport.h FrameHeader (48 bytes)
PROOF_HEAD = struct.Struct("<IIB3xIII")           # ClientProof up to the nonce

def mutate(b: bytes) -> bytes:
    b = bytearray(b)
    for _ in range(rng.randint(1, 4)):
        how = rng.random()
        if how < 0.4 and b:
            b[rng.randrange(len(b))] = rng.randrange(256)
        elif how < 0.6 and b:
            i = rng.randrange(len(b)); del b[i:i + rng.randint(1, 8)]
        elif how < 0.8:
            i = rng.randrange(len(b) + 1); b[i:i] = os.urandom(rng.randint(1, 8))
        elif b:
            i = rng.randrange(max(1, len(b) - 4)); b[i:i + 4] = rng.choice([b"\xff\xff\xff\xff", b"\0\0\0\0", b"\x7f\xff\xff\xff"])
    return bytes(b)

def corpus_inputs(kind):
    """Regression inputs: tests/engine/fuzz_corpus/<kind>.jsonl, one JSON object per line."""
    path = os.path.join(corpus, kind + ".jsonl")
    if not os.path.exists(path):
        return []
    return [json.loads(l) for l in open(path) if l.strip()]

def pair(timeout=1.0):
    lis = _engine.Engine(1, [0, 1], SECRET, "127.0.0.1", timeout, 1 << 20, -1)
    port, _ = lis.prepare()
    return lis, port

def client_proof(nonce, role=1, node=0, local=0, rank=0):
    head = PROOF_HEAD.pack(0x48504453, 1, role, node, local, rank) + b"n" * 32
    return head + hmac.new(SECRET, b"C" + nonce + head, hashlib.sha256).digest()

def handshake_case(make):
    """make(server nonce) -> the bytes a stranger (or a peer with the secret) answers with."""
    lis, port = pair(timeout=0.3)
    errs = []
    t = threading.Thread(target=lambda: errs.append(_safe(lambda: lis.connect(["127.0.0.1", "127.0.0.1"], [0, port]))))
    t.start()
    s = socket.create_connection(("127.0.0.1", port), timeout=3)
    hello = s.recv(40)
    try:
        s.sendall(make(hello[8:40]))
        s.settimeout(0.3)
        s.recv(64)
    except OSError:
        pass
    s.close()
    t.join(5)
    assert not t.is_alive(), "connect() did not return within its deadline"
    assert errs and errs[0] is not None, "set-up succeeded with a stranger as the peer"
    lis.shutdown()

def _safe(fn):
    try:
        fn()
        return None
    except _engine.EngineError as e:
        return str(e)

def frame_case(data: bytes):
    """An authenticated node-0 leader that sends `data` where an all_reduce frame is expected."""
    lis, port = pair(timeout=0.5)
    t = threading.Thread(target=lambda: _safe(lambda: lis.connect(["127.0.0.1", "127.0.0.1"], [0, port])))
    t.start()
    s = socket.create_connection(("127.0.0.1", port), timeout=3)
    hello = s.recv(40)
    s.sendall(client_proof(hello[8:40]))
    s.recv(36)
    t.join(5)
    import numpy as np
    x = np.ones(16, dtype=np.float32)
    h = lis.submit(1, x.ctypes.data, 16, 0, 0, 0)
    try:
        s.sendall(data)
    except OSError:
        pass
    t0 = time.monotonic()
    res = _safe(lambda: lis.wait(h, 10.0))
    took = time.monotonic() - t0
    assert took < 5.0, f"wait took {took:.1f} s"
    s.close()
    lis.shutdown()
    return res

def valid_frame(kind=1, n=16):
    return FRAME.pack(0x46504453, kind, 1, 0, 0, 0, 0, 1, n, 0, n * 4) + b"\0" * (n * 4)

def store_case(data: bytes, authenticated: bool, store_port, srv):
    from sdp_jupyter.comm.store import _HELLO, _mac
    s = socket.create_connection(("127.0.0.1", store_port), timeout=3)
    try:
        hello = s.recv(len(_HELLO) + 32)
        if authenticated:
            cn = os.urandom(32)
            s.sendall(cn + _mac(SECRET, b"store-client", hello[len(_HELLO):], cn))
            s.recv(32)
        s.sendall(data)
        s.settimeout(0.2)
        try:
            s.recv(4096)
        except OSError:
            pass
    finally:
        s.close()

cases = 0
deadline = time.monotonic() + seconds
if target == "handshake":
    for f in corpus_inputs("handshake"):  # signed proofs with hostile fields
        handshake_case(lambda nonce, f=f: client_proof(nonce, f["role"], f["node"], f["local"], f["rank"])); cases += 1
    while time.monotonic() < deadline:
        fields = (rng.choice([0, 1, 2, 3, 255]), rng.choice([0, 1, 2, 0xFFFFFFFF, 0x80000000]),
                  rng.choice([0, 1, 7, 0xFFFFFFFF]), rng.choice([0, 1, 5, 0x7FFFFFFF, 0xFFFFFFFF]))
        how = rng.random()
        if how < 0.4:    # signed: reaches the checks behind authentication
            make = lambda nonce, f=fields: client_proof(nonce, *f)
        elif how < 0.8:  # signed, then mutated
            make = lambda nonce, f=fields: mutate(client_proof(nonce, *f))
        else:            # garbage of any length
            make = lambda nonce, n=rng.randint(0, 200): os.urandom(n)
        handshake_case(make); cases += 1
elif target == "frames":
    for f in corpus_inputs("frames"):
        frame_case(bytes.fromhex(f["hex"])); cases += 1
    while time.monotonic() < deadline:
        kind = rng.choice([1, 1, 1, 2, 3, 9])
        f = valid_frame(kind)
        if kind == 2:  # an error frame: body length and body vary
            n = rng.choice([0, 1, 5, 4096, 1 << 30])
            f = FRAME.pack(0x46504453, 2, 0, 0, 0, 0, 0, 1, 0, 0, n) + os.urandom(min(n, rng.randint(0, 64)))
        frame_case(mutate(f)); cases += 1
elif target == "store":
    from sdp_jupyter.comm.store import TCPKeyValueStore, parse_request, _send_msg
    import socket as _s
    sk = _s.socket(); sk.bind(("127.0.0.1", 0)); port = sk.getsockname()[1]; sk.close()
    st = TCPKeyValueStore("127.0.0.1", port, server=True, timeout=2, secret=SECRET)
    st.set("k", b"v")
    def request():
        parts = [rng.choice([b"get", b"set", b"del", b""]), os.urandom(rng.randint(0, 20)),
                 rng.choice([b"1", b"nan", b"-1", b"inf", b"1e308", os.urandom(4)])]
        return struct.pack("!I", len(parts)) + b"".join(struct.pack("!I", len(p)) + p for p in parts)
    for f in corpus_inputs("store"):
        store_case(bytes.fromhex(f["hex"]), f.get("authenticated", True), port, st); cases += 1
    while time.monotonic() < deadline:
        data = mutate(request())
        store_case(data, rng.random() < 0.7, port, st); cases += 1
        # the parser alone: only ValueError (a dropped connection) may come out of it
        try:
            parse_request([os.urandom(rng.randint(0, 5)) for _ in range(rng.randint(0, 4))])
        except ValueError:
            pass
    assert st.get("k") == b"v", "the store lost a key while being fuzzed"
    st.close()
print(json.dumps({"target": target, "cases": cases}))
'''


@pytest.mark.parametrize("target", ["handshake", "frames", "store"])
def test_fuzz(target):
    env = dict(os.environ)
    env.pop("PYTEST_CURRENT_TEST", None)
    p = subprocess.run([sys.executable, "-c", CHILD, target, str(SECONDS), str(SEED), str(CORPUS)],
                       capture_output=True, text=True, timeout=SECONDS + 120, env=env)
    assert p.returncode == 0, f"{target} fuzzing crashed or failed (exit {p.returncode}):\n{p.stderr[-4000:]}"
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    assert summary["cases"] >= 5, summary
