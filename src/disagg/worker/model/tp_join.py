"""How a rank joins its group's rank 0: the control connection and what travels on it first.

A rank connects to rank 0's control listener (authenticated: `multiprocessing.connection`'s HMAC
challenge with a shared key), says which rank it is and which host it runs on, and receives what
the group shares (`GroupSpec`: the model, the rendezvous port, the device type, the timeout).
Rank 0's own children and ranks started on other hosts (`disagg tp-ranks`) join the same way;
only the key differs: a random one for children, one derived from the deployment's internal
credential for ranks from other hosts, since the connection carries pickled objects.
"""

from __future__ import annotations

import hashlib
import socket
import struct
import time
from dataclasses import asdict, dataclass
from multiprocessing.connection import Client, Connection, answer_challenge, deliver_challenge

AUTHKEY_ENV = "DISAGG_TP_AUTHKEY"  # the control connection's key (hex), kept off the command line
# TCP keepalive on control connections: a host that vanishes without closing them (power loss,
# partition) is noticed in about IDLE + INTERVAL * COUNT seconds rather than never.
KEEPALIVE_IDLE, KEEPALIVE_INTERVAL, KEEPALIVE_COUNT = 10, 5, 3


def authkey_from_token(token: str) -> bytes:
    """The control connection's key for ranks on other hosts: bound to this use, so the key is
    not the credential the worker's other endpoints check."""
    return hashlib.sha256(b"disagg tensor-parallel control\0" + token.encode()).digest()


@dataclass(frozen=True)
class GroupSpec:
    """What every rank of a group gets from rank 0 once it has joined."""

    model: str
    dtype: str
    device_type: str  # "cuda" or "cpu": a rank uses the GPU its launcher gave it, or the CPU
    world_size: int
    store_port: int  # the rendezvous store, on rank 0's host
    timeout_s: float

    def to_dict(self) -> dict:
        return asdict(self)


def connect(address: tuple[str, int], authkey: bytes, timeout_s: float) -> Connection:
    """The control connection to rank 0, retried until `timeout_s` while rank 0 is not listening
    yet (a rank on another host may start first)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            conn = Client(address, authkey=authkey)
        except (ConnectionRefusedError, ConnectionResetError, socket.gaierror, TimeoutError) as exc:
            if time.monotonic() > deadline:
                raise ConnectionError(
                    f"rank 0 at {address[0]}:{address[1]} did not accept within {timeout_s:g}s: {exc}"
                ) from exc
            time.sleep(1.0)
            continue
        keepalive(conn)
        return conn


def authenticate(conn: Connection, authkey: bytes, timeout_s: float) -> None:
    """Rank 0's side of the HMAC challenge (what `Listener(authkey=...)` does on accept), each
    read bounded by `timeout_s`, so a peer that connects and says nothing cannot hold up the ranks
    that join after it. Raises AuthenticationError, or OSError / EOFError for a silent or gone peer;
    the bound stays on the connection until `recv_timeout(conn, 0)`."""
    recv_timeout(conn, timeout_s)
    deliver_challenge(conn, authkey)
    answer_challenge(conn, authkey)


def recv_timeout(conn: Connection, seconds: float) -> None:
    """Bound every read of `conn` (0: no bound); a read that times out raises OSError."""
    whole = int(seconds)
    timeval = struct.pack("ll", whole, int((seconds - whole) * 1e6))
    sock = socket.socket(fileno=conn.fileno())
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    finally:
        sock.detach()


def keepalive(conn: Connection) -> None:
    sock = socket.socket(fileno=conn.fileno())
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL),
                            ("TCP_KEEPCNT", KEEPALIVE_COUNT)):  # fmt: skip
            if hasattr(socket, name):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    finally:
        sock.detach()  # the connection keeps the descriptor


def peer_closed(conn: Connection) -> bool:
    """The other end closed the connection (or it broke) and nothing it sent is left unread."""
    sock = socket.socket(fileno=conn.fileno())
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True
    finally:
        sock.detach()
