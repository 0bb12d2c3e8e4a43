"""Request bodies: Content-Encoding decoded with a streaming limit (a compression bomb stops at the
first byte past the limit, in whichever gzip member it is), an undecodable body a 400, an unknown
encoding a 415."""

from __future__ import annotations

import gzip
import json
import random
import zlib

import pytest

from disagg.worker.router.body import BodyDecoder
from disagg.worker.router.errors import APIError

from .router_client import router_client as _client


def _decode(encoding: str, data: bytes, limit: int, chunk: int = 4096) -> bytes:
    d = BodyDecoder(encoding, limit)
    out = b"".join(d.feed(data[i : i + chunk]) for i in range(0, len(data), chunk))
    return out + d.finish()


@pytest.mark.parametrize("encoding", ["gzip", "x-gzip", "deflate", "identity", ""])
def test_each_encoding_round_trips(encoding):
    body = json.dumps({"model": "m", "prompt": "x" * 50_000}).encode()
    data = {"gzip": gzip.compress, "x-gzip": gzip.compress, "deflate": zlib.compress}.get(encoding, bytes)(
        body
    )
    assert _decode(encoding, data, limit=len(body)) == body


@pytest.mark.parametrize("size", [1000, 1 << 20])
def test_an_incompressible_body_at_the_limit_still_decodes(size):
    body = random.Random(size).randbytes(size)  # compressed, it is a little larger than the limit
    for encoding, compress in (("gzip", gzip.compress), ("deflate", zlib.compress)):
        assert _decode(encoding, compress(body), limit=size) == body


def test_raw_deflate_is_accepted_too():
    c = zlib.compressobj(wbits=-15)
    body = b'{"a": 1}' * 100
    assert _decode("deflate", c.compress(body) + c.flush(), limit=1000) == body


def test_a_bomb_stops_at_the_first_byte_past_the_limit():
    bomb = gzip.compress(b"\0" * (64 << 20))  # 64 MiB of zeros in ~64 KiB
    d = BodyDecoder("gzip", limit=1 << 20)
    with pytest.raises(APIError) as info:
        for i in range(0, len(bomb), 4096):
            d.feed(bomb[i : i + 4096])
    assert info.value.status == 413
    # what was decompressed: the limit and one byte, never the rest of the 64 MiB
    assert d.produced == (1 << 20) + 1
    assert d.consumed < len(bomb) // 4


@pytest.mark.parametrize("chunk", [4096, 7, 1])
def test_gzip_members_one_after_another_decode_to_their_contents_joined(chunk):
    first, second = b'{"model": "m", ' * 50, b'"prompt": "x"}' * 50
    data = gzip.compress(first) + gzip.compress(second)  # what `cat a.gz b.gz` sends
    assert _decode("gzip", data, limit=len(first) + len(second), chunk=chunk) == first + second


def test_a_bomb_in_a_later_gzip_member_stops_at_the_first_byte_past_the_limit():
    data = gzip.compress(b"{}") + gzip.compress(b"\0" * (64 << 20))
    d = BodyDecoder("gzip", limit=1 << 20)
    with pytest.raises(APIError) as info:
        for i in range(0, len(data), 4096):
            d.feed(data[i : i + 4096])
    assert info.value.status == 413 and d.produced == (1 << 20) + 1
    assert d.consumed < len(data) // 4


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_compressed_bytes_that_produce_nothing_are_cut_near_the_limit(encoding):
    """Empty deflate blocks (or empty gzip members) without end: the compressed bytes are bounded
    too, a little past the limit, not only what they inflate to."""
    if encoding == "gzip":
        head, empty = b"", gzip.compress(b"")
    else:
        head, empty = b"\x78\x9c", b"\x00\x00\x00\xff\xff"  # a zlib header, then empty stored blocks
    limit = 64 << 10
    d = BodyDecoder(encoding, limit)
    d.feed(head)
    with pytest.raises(APIError) as info:
        for _ in range(8 * limit // len(empty)):
            d.feed(empty)
    assert info.value.status == 413 and d.produced == 0
    assert d.consumed < 2 * limit


@pytest.mark.parametrize(
    "encoding, data",
    [
        ("gzip", b'{"model": "m", "prompt": "x"}'),  # the header without compression
        ("deflate", b'{"model": "m", "prompt": "x"}'),
        ("gzip", gzip.compress(b'{"model": "m"}')[:-12]),  # truncated
        ("gzip", gzip.compress(b'{"model": "m"}') + b"trailing"),
    ],
)
def test_a_body_that_does_not_decode_is_a_400(encoding, data):
    with pytest.raises(APIError) as info:
        _decode(encoding, data, limit=1 << 20)
    assert info.value.status == 400 and info.value.code == "invalid_body", info.value.message
    assert encoding in info.value.message


@pytest.mark.parametrize("encoding", ["br", "zstd", "gzip, gzip", "compress"])
def test_other_encodings_are_415s_naming_them(encoding):
    with pytest.raises(APIError) as info:
        BodyDecoder(encoding, limit=100)
    assert info.value.status == 415 and encoding in info.value.message


def test_an_identity_body_over_the_limit_is_a_413():
    d = BodyDecoder("", limit=10)
    d.feed(b"0123456789")
    with pytest.raises(APIError) as info:
        d.feed(b"x")
    assert info.value.status == 413


CHAT = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}).encode()


async def test_the_router_decodes_and_refuses_bodies_by_their_encoding(tokenizer):
    client = await _client(tokenizer, max_body_bytes=1 << 20)
    headers = {"Content-Type": "application/json"}
    try:
        # decoded: past validation, to the 503 of a pool with no worker
        half = len(CHAT) // 2
        members = gzip.compress(CHAT[:half]) + gzip.compress(CHAT[half:])
        for encoding, data in (("gzip", gzip.compress(CHAT)), ("deflate", zlib.compress(CHAT)),
                               ("gzip", members)):  # fmt: skip
            r = await client.post(
                "/v1/chat/completions", data=data, headers={**headers, "Content-Encoding": encoding}
            )
            assert r.status == 503, await r.text()
        r = await client.post(
            "/v1/chat/completions", data=CHAT, headers={**headers, "Content-Encoding": "gzip"}
        )
        body = await r.json()
        assert r.status == 400 and body["error"]["code"] == "invalid_body", body
        r = await client.post(
            "/v1/chat/completions", data=CHAT, headers={**headers, "Content-Encoding": "br"}
        )
        assert r.status == 415 and "br" in (await r.json())["error"]["message"]
        bomb = gzip.compress(b" " * (8 << 20))
        r = await client.post(
            "/v1/chat/completions", data=bomb, headers={**headers, "Content-Encoding": "gzip"}
        )
        assert r.status == 413 and (await r.json())["error"]["code"] == "body_too_large"
        r = await client.post("/v1/chat/completions", data=b" " * (2 << 20), headers=headers)
        assert r.status == 413
    finally:
        await client.close()
