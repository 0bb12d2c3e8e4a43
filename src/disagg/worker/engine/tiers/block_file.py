"""One KV block as a file: what the disk tier writes and how a read proves it intact.

Layout (little-endian): magic, format version, block hash (u64), token count (u32), payload
length (u64), CRC-32 of everything after the checksum field; then the token ids (int64) and
the payload (the block's bytes across all layers, quantized blocks as their bytes). A read
checks the magic, the lengths against the file's size, the checksum, and that the hash and
the tokens are the ones asked for: a truncated, corrupted or foreign file is refused, never
served.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence

MAGIC = b"DGKV"
VERSION = 1
_HEADER = struct.Struct("<4sHQIQI")  # magic, version, hash, n_tokens, payload_len, crc32
HEADER_BYTES = _HEADER.size
SUFFIX = ".kvblock"


class CorruptBlock(ValueError):
    """The file is not the intact block that was asked for."""


def file_name(block_hash: int) -> str:
    return f"{block_hash:016x}{SUFFIX}"


def encode(
    block_hash: int, token_ids: Sequence[int], payload: bytes | memoryview
) -> list[bytes | memoryview]:
    """The file's contents as pieces to write in order (the payload is not copied)."""
    tokens = struct.pack(f"<{len(token_ids)}q", *token_ids)
    crc = zlib.crc32(payload, zlib.crc32(tokens))
    header = _HEADER.pack(MAGIC, VERSION, block_hash, len(token_ids), len(payload), crc)
    return [header, tokens, payload]


def file_size(n_tokens: int, payload_len: int) -> int:
    return HEADER_BYTES + 8 * n_tokens + payload_len


def decode(data: bytes | memoryview, block_hash: int, token_ids: Sequence[int]) -> memoryview:
    """The payload of `data` if it is the intact file of `block_hash` holding `token_ids`."""
    data = memoryview(data)
    if len(data) < HEADER_BYTES:
        raise CorruptBlock(f"{len(data)} bytes: shorter than the header")
    magic, version, stored_hash, n_tokens, payload_len, crc = _HEADER.unpack_from(data)
    if magic != MAGIC or version != VERSION:
        raise CorruptBlock(f"not a v{VERSION} KV block file (magic {bytes(magic)!r}, version {version})")
    if len(data) != file_size(n_tokens, payload_len):
        raise CorruptBlock(f"{len(data)} bytes, the header says {file_size(n_tokens, payload_len)}")
    tokens = data[HEADER_BYTES : HEADER_BYTES + 8 * n_tokens]
    payload = data[HEADER_BYTES + 8 * n_tokens :]
    if zlib.crc32(payload, zlib.crc32(tokens)) != crc:
        raise CorruptBlock("checksum mismatch")
    if stored_hash != block_hash:
        raise CorruptBlock(f"holds block {stored_hash:016x}, not {block_hash:016x}")
    if list(struct.unpack(f"<{n_tokens}q", tokens)) != list(token_ids):
        raise CorruptBlock("holds other token ids than the prompt's")
    return payload
