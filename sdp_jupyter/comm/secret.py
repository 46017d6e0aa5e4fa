"""Where a rank's job secret comes from (docs/security.md).

1. SDP_JOB_SECRET, set by our launchers (and by a user running plain torchrun across hosts).
   At least 16 bytes; an empty or short one is refused.
2. Without it, when the environment says the job spans several hosts (LOCAL_WORLD_SIZE below
   WORLD_SIZE and a MASTER_ADDR that is not loopback): refused, with how to set it, unless
   SDP_ALLOW_UNAUTHENTICATED=1, which runs with a secret anyone can derive (so effectively none)
   and warns on every rank.
3. Otherwise, on one host: the group's rank 0 makes a fresh secret and hands it to the group's
   other ranks through a 0600 file in a per-user 0700 directory, so only this user's processes can
   join. Which file is told through the group's store: a random name and rank 0's host, never the
   secret. So it works however the ranks were started (torchrun, mp.spawn with the rank passed to
   init_process_group and no environment, env://, tcp://, file://), two jobs on one machine never
   share a file, and a rank on another host says so instead of waiting (`group_secret`).
   `sdp_jupyter.comm.init()` (the numpy API) needs the secret before its store exists: there the
   process's RANK publishes and the file is named from MASTER_ADDR:MASTER_PORT, whose port the
   store's server holds for the job's life (`env_secret`).

The secret is never written to a store, a command line or a log. The file goes once every rank of
the group has connected (`JobSecret.release`), or at the publisher's exit.
"""
from __future__ import annotations

import atexit
import hashlib
import ipaddress
import json
import os
import secrets
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from sdp_jupyter._env import env_bool, env_int, env_str
from sdp_jupyter._files import UnsafePath, ensure_private_dir, open_checked, write_private

MIN_SECRET_BYTES = 16

# Where a secret came from, as error messages name it.
FROM_ENV = "SDP_JOB_SECRET"
FROM_FILE = "the one-host secret file"
FROM_CALLER = "the secret passed by the caller"
UNAUTHENTICATED = "SDP_ALLOW_UNAUTHENTICATED"


class SecretError(RuntimeError):
    """No usable job secret: the message says how to provide one."""


@dataclass
class JobSecret:
    """A job secret and where it came from: `value` (the bytes), `source` (FROM_ENV,
    FROM_FILE, FROM_CALLER or UNAUTHENTICATED, as error messages name it) and `release` (for the rank
    that published a one-host secret file: removes the file)."""

    value: bytes
    source: str  # FROM_ENV, FROM_FILE, FROM_CALLER or UNAUTHENTICATED
    release: Callable[[], None] | None = None  # the publisher's: remove the file (idempotent)

    def released(self) -> None:
        """Call `release`, if any (it removes a one-host secret file; idempotent): done once every rank has
        connected, or when the attempt failed."""
        if self.release is not None:
            self.release()


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
    """False when the environment says the job spans several hosts (rule 2 of the module docstring)."""
    world = env_int("WORLD_SIZE", 1, min=1)
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local is not None and local.strip() and env_int("LOCAL_WORLD_SIZE", 1, min=1) == world:
        return True
    return is_loopback(os.environ.get("MASTER_ADDR", "127.0.0.1"))


def user_dir() -> Path:
    """A directory only this user can enter: $XDG_RUNTIME_DIR/sdp or <tmp>/sdp-<uid>, mode 0700."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    d = Path(base) / "sdp" if base and os.path.isdir(base) else Path(tempfile.gettempdir()) / f"sdp-{os.getuid()}"
    try:
        return ensure_private_dir(d, repair=False)
    except UnsafePath:
        raise SecretError(f"{d} must be a directory owned by this user with mode 0700 (it is not: someone else "
                          "may be able to read job secrets there). Fix: remove it, or set SDP_JOB_SECRET") from None


def secret_file(name: str) -> Path:
    return user_dir() / f"secret-{hashlib.sha256(name.encode()).hexdigest()[:16]}"


def host_id() -> str:
    """This host as the one-host secret compares it: the host name and the kernel's boot id (test
    hosts in network namespaces share the boot id and the file system, not the host name)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def publish_local_secret(name: str) -> JobSecret:
    """The publisher: a fresh secret in a 0600 file only this user can read; removed by
    `release()` and, failing that, at this process's exit."""
    secret = secrets.token_hex(32).encode()
    path = secret_file(name)
    write_private(path, secret)

    def release() -> None:
        try:
            path.unlink()
        except FileNotFoundError:
            pass

    atexit.register(release)
    return JobSecret(secret, FROM_FILE, release)


def read_local_secret(name: str, timeout: float, *, fresh_since: float | None = None,
                      retry: Callable[[], str] | None = None) -> JobSecret:
    """The other ranks: the secret the publisher wrote, waiting for it up to `timeout`.
    `fresh_since`: ignore a file older than this (a leftover of an earlier job that used the same
    name); `retry`: called between tries for the name again (a store may be rewritten)."""
    deadline = time.monotonic() + timeout
    while True:
        path = secret_file(name)
        try:
            f = open_checked(path)
        except FileNotFoundError:
            if time.monotonic() > deadline:
                raise SecretError(f"the group's rank 0 did not publish a job secret in {path} within {timeout:g} s "
                                  "(it failed or has not started); or set SDP_JOB_SECRET on every rank") from None
            time.sleep(0.02)
            if retry is not None:
                name = retry()
            continue
        except UnsafePath:
            raise SecretError(f"{path} is not a 0600 file of this user: refusing to use it as the job secret") from None
        with f:
            st = os.fstat(f.fileno())
            data = f.read(4096)
        if len(data) >= MIN_SECRET_BYTES and (fresh_since is None or st.st_mtime >= fresh_since):
            return JobSecret(data, FROM_FILE)
        if time.monotonic() > deadline:
            raise SecretError(f"{path} holds no fresh job secret after {timeout:g} s; set SDP_JOB_SECRET on every rank")
        time.sleep(0.02)


def _process_start() -> float:
    try:
        return os.stat(f"/proc/{os.getpid()}").st_ctime
    except OSError:
        return 0.0


def _preset(where: str) -> JobSecret | None:
    """Rules 1 and 2: SDP_JOB_SECRET, or the refusal (or the unauthenticated secret) across hosts."""
    given = env_str("SDP_JOB_SECRET")
    if given is not None:
        return JobSecret(check_secret(given), FROM_ENV)
    if single_node():
        return None
    return _across_hosts(where)


def _across_hosts(where: str) -> JobSecret:
    if env_bool("SDP_ALLOW_UNAUTHENTICATED", False):
        print(f"[sdp_jupyter] WARNING: rank {os.environ.get('RANK', '?')} runs WITHOUT authentication "
              "(SDP_ALLOW_UNAUTHENTICATED=1): anyone who reaches MASTER_PORT or the engine's ports can join "
              "or read this job's data. Set SDP_JOB_SECRET instead.", file=sys.stderr, flush=True)
        return JobSecret(hashlib.sha256(b"sdp-unauthenticated:" + where.encode()).hexdigest().encode(), UNAUTHENTICATED)
    raise SecretError("this job spans several hosts and SDP_JOB_SECRET is not set, so nothing would stop a "
                      "stranger from joining it. Fix: export the same SDP_JOB_SECRET (>= 16 bytes, e.g. "
                      "`python -c 'import secrets; print(secrets.token_hex(32))'`) on every rank; "
                      "%%sdp_train, sdp-train and our SageMaker entry do this for you. "
                      "(SDP_ALLOW_UNAUTHENTICATED=1 runs without it, on a network you trust.)")


def env_secret(timeout: float = 300.0) -> JobSecret:
    """This process's job secret from its environment alone (RANK publishes; the file is named
    from MASTER_ADDR:MASTER_PORT): for `sdp_jupyter.comm.init()`, whose store needs the secret first."""
    where = f"{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{os.environ.get('MASTER_PORT', '')}"
    preset = _preset(where)
    if preset is not None:
        return preset
    if env_int("RANK", 0, min=0) == 0:
        return publish_local_secret(where)
    # A file older than this process by more than a minute is a leftover of an earlier job on
    # the same address and port (its rank 0 died during set-up): wait for the fresh one.
    return read_local_secret(where, timeout, fresh_since=_process_start() - 60)


def group_secret(rank: int, store, key: str, timeout: float = 300.0) -> JobSecret:
    """A process group's secret (rules 1-3 of the module docstring). `rank` is the rank the group was
    created with (not $RANK: mp.spawn passes it to init_process_group); `store` has set(key, bytes)
    and a blocking get(key); `key` is where the group's rank 0 says which file (and its host)."""
    preset = _preset(f"{os.environ.get('MASTER_ADDR', '')}:{os.environ.get('MASTER_PORT', '')}")
    if preset is not None:
        if rank == 0:  # so that a rank without SDP_JOB_SECRET says why instead of waiting for a file
            store.set(key, json.dumps({"source": preset.source}).encode())
        return preset
    if rank == 0:
        name = secrets.token_hex(16)
        made = publish_local_secret(name)
        store.set(key, json.dumps({"file": name, "host": host_id()}).encode())
        return made

    def told() -> str:
        try:
            record = json.loads(bytes(store.get(key)))
            if "source" in record and "file" not in record:
                raise SecretError(f"the group's rank 0 took its secret from {record['source']} and rank {rank} has "
                                  "none. Fix: set the same SDP_JOB_SECRET on every rank, or on none of them "
                                  "(one host)")
            name, host = str(record["file"]), str(record["host"])
        except (ValueError, KeyError, TypeError):
            raise SecretError(f"the store's '{key}' does not say where rank 0's secret is: another program wrote "
                              "it; use a fresh init_method, or set SDP_JOB_SECRET on every rank") from None
        if host != host_id():
            raise SecretError(f"rank {rank} runs on {socket.gethostname()}, not on rank 0's host "
                              f"({host.split('/')[0]}), and SDP_JOB_SECRET is not set: a job across hosts needs "
                              "the same SDP_JOB_SECRET (>= 16 bytes) on every rank; %%sdp_train and sdp-train set it")
        return name

    return read_local_secret(told(), timeout, retry=told)
