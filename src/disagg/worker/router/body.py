"""Request bodies, decoded by their Content-Encoding under a limit on the decoded size.

The router reads bodies itself (aiohttp's automatic decompression is off: it went on inflating a
compression bomb after the handler had answered 413, stalling the event loop). `BodyDecoder`
inflates as the compressed bytes arrive and never produces more than one byte past the limit, so
a small body that expands to gigabytes costs the limit's worth of work and is a 413. A body that
does not decode under the encoding it names is a 400; an encoding other than gzip, deflate or
identity is a 415 naming it. A gzip body may be several gzip members one after the other (as
`cat a.gz b.gz` makes, and RFC 1952 allows): it decodes to their contents joined, under the same
limit.
"""

from __future__ import annotations

import zlib

from aiohttp import web

from disagg.worker.router.errors import APIError

# zlib's window bits per encoding: 16 + MAX_WBITS reads a gzip wrapper; deflate is picked per body
_GZIP = 16 + zlib.MAX_WBITS
# Compressed bytes may exceed the limit by at most this share of it and a little more: deflate's
# worst case (incompressible data in stored blocks, 0.03%) fits, while a stream that produces
# nothing (empty blocks or members, sent for ever) is cut like one that produces too much.
_ENCODED_SLACK = 1 / 256
ENCODINGS = ("gzip", "x-gzip", "deflate", "identity")


def _too_large(limit: int) -> APIError:
    return APIError(
        413, f"the request body exceeds this server's limit of {limit} bytes", code="body_too_large"
    )


class BodyDecoder:
    """Feed the body as it arrives; each call returns the decoded bytes so far (pure: no I/O)."""

    def __init__(self, content_encoding: str, limit: int):
        self.encoding = content_encoding.strip().lower()
        if self.encoding not in ("", *ENCODINGS):
            raise APIError(
                415,
                f"Content-Encoding {content_encoding!r} is not supported; send the body as is, or "
                "compressed with gzip or deflate",
                code="unsupported_encoding",
            )
        self.limit = limit
        self.produced = 0  # decoded bytes handed out
        self.consumed = 0  # encoded bytes taken in
        self._z = None  # the decompressor, made on the first bytes (deflate's form is read from them)

    @property
    def compressed(self) -> bool:
        return self.encoding not in ("", "identity")

    def feed(self, data: bytes) -> bytes:
        self.consumed += len(data)
        if not self.compressed:
            return self._count(data)
        if not data:
            return b""
        if self.consumed > self.limit * (1 + _ENCODED_SLACK) + 4096:
            raise _too_large(self.limit)
        if self._z is None:
            self._z = zlib.decompressobj(self._wbits(data))
        parts = []
        while data:
            if self._z.eof:  # a member ended and more bytes follow: the next gzip member
                if self.encoding == "deflate":
                    raise self._invalid("data after the end of the compressed stream")
                self._z = zlib.decompressobj(_GZIP)
            try:
                # at most one byte past the limit: enough to know it is exceeded, and no more work
                out = self._z.decompress(data, self.limit + 1 - self.produced)
            except zlib.error as e:
                raise self._invalid(str(e)) from None
            parts.append(self._count(out))  # output cut at the cap is one byte past the limit: a 413
            # what follows the end of this member (empty unless it ended within `data`)
            data = self._z.unused_data if self._z.eof else b""
        return b"".join(parts)

    def finish(self) -> bytes:
        """After the last bytes arrived: the stream must have ended where the body did."""
        if self.compressed and (self._z is None or not self._z.eof):
            raise self._invalid("the compressed stream is truncated")
        return b""

    def _wbits(self, first: bytes) -> int:
        if self.encoding != "deflate":
            return _GZIP
        # RFC 9110's deflate is the zlib format, but clients also send raw deflate: a zlib stream
        # starts with compression method 8 in the low nibble of its first byte
        return zlib.MAX_WBITS if first[0] & 0x0F == 8 else -zlib.MAX_WBITS

    def _count(self, out: bytes) -> bytes:
        self.produced += len(out)
        if self.produced > self.limit:
            raise _too_large(self.limit)
        return out

    def _invalid(self, why: str) -> APIError:
        return APIError(
            400,
            f"the request body does not decode as Content-Encoding {self.encoding!r}: {why}",
            code="invalid_body",
        )


async def read_body(request: web.Request, limit: int) -> bytes:
    """The request's decoded body, read chunk by chunk; stops at the first byte past `limit`."""
    decoder = BodyDecoder(request.headers.get("Content-Encoding", ""), limit)
    if request.content_length is not None and not decoder.compressed and request.content_length > limit:
        raise _too_large(limit)
    parts = []
    while chunk := await request.content.readany():
        parts.append(decoder.feed(chunk))
    parts.append(decoder.finish())
    return b"".join(parts)
