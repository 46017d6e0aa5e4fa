"""Where a rank's job secret comes from (docs/security.md).

1. SDP_JOB_SECRET, set by our launchers (and by a user running plain torchrun across hosts).
   At least 16 bytes; an empty or short one is refused.
2. Without it, on one node (LOCAL_WORLD_SIZE == WORLD_SIZE, or a loopback MASTER_ADDR): rank 0 makes
   a fresh secret and hands it to the node's other ranks through a 0600 file in a per-user 0700
   directory, so only this user's processes can join.
3. Without it, across nodes: refused, with how to set it, unless SDP_ALLOW_UNAUTHENTICATED=1, which
   runs with a secret anyone can derive (so effectively none) and warns on every rank.

The secret is never written to a store, a command line or a log.
"""
from __future__ import annotations

import hashlib
import ipaddress
import os
import secrets
import sys
import tempfile
import time
from pathlib import Path

from sdp_jupyter._env import env_bool, env_int
from sdp_jupyter._files import UnsafePath, ensure_private_dir, open_checked, write_private

MIN_SECRET_BYTES = 16


class SecretError(RuntimeError):
    """No usable job secret: the message says how to provide one."""


def check_secret(secret: bytes | str, source: str = "SDP_JOB_SECRET") -> bytes:
    if isinstance(secret, str):
        secret = secret.encode()
    if len(secret) < MIN_SECRET_BYTES:
        raise SecretError(f"{source} is {'empty' if not secret else f'only {len(secret)} bytes'}: a job secret "
                          f"must be at least {MIN_SECRET_BYTES} bytes. Fix: export SDP_JOB_SECRET=$(python -c "
                          "'import secrets; print(secrets.token_hex(32))') with the same value on every rank")
    return secret


def is_loopback(host: str) -> bool:
    """True for "localhost" and a loopback IP address (127.0.0.0/8, ::1); False for any other name."""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def single_node() -> bool:
    """True when this job certainly runs on one host (so a file can carry the secret)."""
    world = env_int("WORLD_SIZE", 1, min=1)
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local is not None and local.strip() and env_int("LOCAL_WORLD_SIZE", 1, min=1) == world:
        return True
    return is_loopback(os.environ.get("MASTER_ADDR", "127.0.0.1"))


def uses_local_file() -> bool:
    """True when the job secret travels through the one-node file (rule 2 above): no
    SDP_JOB_SECRET, and one host."""
    return "SDP_JOB_SECRET" not in os.environ and single_node()


def user_dir() -> Path:
    """A directory only this user can enter: $XDG_RUNTIME_DIR/sdp or <tmp>/sdp-<uid>, mode 0700."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    d = Path(base) / "sdp" if base and os.path.isdir(base) else Path(tempfile.gettempdir()) / f"sdp-{os.getuid()}"
    try:
        return ensure_private_dir(d, repair=False)
    except UnsafePath:
        raise SecretError(f"{d} must be a directory owned by this user with mode 0700 (it is not: someone else "
                          "may be able to read job secrets there). Fix: remove it, or set SDP_JOB_SECRET") from None


def _secret_file() -> Path:
    where = f"{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{os.environ.get('MASTER_PORT', '')}"
    return user_dir() / f"secret-{hashlib.sha256(where.encode()).hexdigest()[:16]}"


def publish_local_secret() -> bytes:
    """Rank 0 of a one-node job: a fresh secret in a 0600 file only this user can read."""
    secret = secrets.token_hex(32).encode()
    write_private(_secret_file(), secret)
    return secret


def read_local_secret(timeout: float) -> bytes:
    """Other ranks of a one-node job: the secret rank 0 wrote (waiting for it up to `timeout`)."""
    path = _secret_file()
    deadline = time.monotonic() + timeout
    while True:
        try:
            f = open_checked(path)
        except FileNotFoundError:
            if time.monotonic() > deadline:
                raise SecretError(f"rank 0 did not publish a job secret in {path} within {timeout:g} s; "
                                  "set SDP_JOB_SECRET on every rank") from None
            time.sleep(0.02)
            continue
        except UnsafePath:
            raise SecretError(f"{path} is not a 0600 file of this user: refusing to use it as the job secret") from None
        with f:
            st = os.fstat(f.fileno())
            data = f.read(4096)
        # A file older than this process by more than a minute is a leftover of an earlier job on
        # the same address and port (its rank 0 died during set-up): wait for the fresh one.
        if len(data) >= MIN_SECRET_BYTES and st.st_mtime >= _process_start() - 60:
            return data
        time.sleep(0.02)


def _process_start() -> float:
    try:
        return os.stat(f"/proc/{os.getpid()}").st_ctime
    except OSError:
        return 0.0


def remove_local_secret() -> None:
    try:
        _secret_file().unlink()
    except (FileNotFoundError, SecretError):
        pass


_removal_at_exit = False


def release_local_secret(group_size: int) -> None:
    """Called when a group set up with the one-node file secret is connected. The file is the job's,
    not the group's (the process's RANK 0 publishes it once; every smddp group of the job reads it),
    so it goes as soon as a group spanning the whole job is connected (every rank has read it); after
    a subgroup only at the publisher's exit, since ranks outside that subgroup may still need it
    (tp x dp jobs create their dp groups first, and a file removed after one of them left the other
    group's ranks waiting for it)."""
    global _removal_at_exit
    if env_int("RANK", 0, min=0) != 0:
        return
    if group_size >= env_int("WORLD_SIZE", 1, min=1):
        remove_local_secret()
    elif not _removal_at_exit:
        import atexit

        _removal_at_exit = True
        atexit.register(remove_local_secret)


_cached: dict[str, bytes] = {}


def job_secret(timeout: float = 300.0) -> bytes:
    """This rank's job secret, by the rules in the module docstring. The process's RANK decides
    who publishes the one-node secret, once per process (subgroups reuse it)."""
    given = os.environ.get("SDP_JOB_SECRET")
    if given is not None:
        return check_secret(given)
    if uses_local_file():
        where = f"{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{os.environ.get('MASTER_PORT', '')}"
        if where not in _cached:
            _cached[where] = publish_local_secret() if env_int("RANK", 0, min=0) == 0 else read_local_secret(timeout)
        return _cached[where]
    if env_bool("SDP_ALLOW_UNAUTHENTICATED", False):
        print(f"[sdp_jupyter] WARNING: rank {os.environ.get('RANK', '?')} runs WITHOUT authentication "
              "(SDP_ALLOW_UNAUTHENTICATED=1): anyone who reaches MASTER_PORT or the engine's ports can join "
              "or read this job's data. Set SDP_JOB_SECRET instead.", file=sys.stderr, flush=True)
        where = f"{os.environ.get('MASTER_ADDR', '')}:{os.environ.get('MASTER_PORT', '')}"
        return hashlib.sha256(b"sdp-unauthenticated:" + where.encode()).hexdigest().encode()
    raise SecretError("this job spans several hosts and SDP_JOB_SECRET is not set, so nothing would stop a "
                      "stranger from joining it. Fix: export the same SDP_JOB_SECRET (>= 16 bytes, e.g. "
                      "`python -c 'import secrets; print(secrets.token_hex(32))'`) on every rank; "
                      "%%sdp_train, sdp-train and our SageMaker entry do this for you. "
                      "(SDP_ALLOW_UNAUTHENTICATED=1 runs without it, on a network you trust.)")
