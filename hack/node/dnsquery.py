"""One DNS A query and its answer, on the wire (RFC 1035): how `up` checks the cluster's DNS
answers before it says it is ready. Pure."""

from __future__ import annotations

import struct

TYPE_A = 1
CLASS_IN = 1


def query(name: str, ident: int) -> bytes:
    header = struct.pack(">HHHHHH", ident, 0x0100, 1, 0, 0, 0)  # recursion desired, one question
    labels = b"".join(bytes([len(p)]) + p.encode() for p in name.rstrip(".").split(".")) + b"\0"
    return header + labels + struct.pack(">HH", TYPE_A, CLASS_IN)


def _skip_name(msg: bytes, i: int) -> int:
    while True:
        length = msg[i]
        if length == 0:
            return i + 1
        if length & 0xC0 == 0xC0:  # a compression pointer ends the name
            return i + 2
        i += 1 + length


def answer(msg: bytes, ident: int) -> tuple[int, list[str]]:
    """(rcode, the A records' addresses) of a response to `query(..., ident)`."""
    got, flags, qd, an, _, _ = struct.unpack(">HHHHHH", msg[:12])
    if got != ident or not flags & 0x8000:
        raise ValueError("not the response to this query")
    i = 12
    for _ in range(qd):
        i = _skip_name(msg, i) + 4
    addrs = []
    for _ in range(an):
        i = _skip_name(msg, i)
        rtype, _rclass, _ttl, length = struct.unpack(">HHIH", msg[i : i + 10])
        i += 10
        if rtype == TYPE_A and length == 4:
            addrs.append(".".join(str(b) for b in msg[i : i + 4]))
        i += length
    return flags & 0x000F, addrs
