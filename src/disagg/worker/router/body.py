"""Request bodies, decoded by their Content-Encoding under a limit on the decoded size.

The router reads bodies itself (aiohttp's automatic decompression is off: it went on inflating a
compression bomb after the handler had answered 413, stalling the event loop). `BodyDecoder`
inflates as the compressed bytes arrive and never produces more than one byte past the limit, so
a small body that expands to gigabytes costs the limit's worth of work and is a 413. A body that
does not decode under the encoding it names is a 400; an encoding other than gzip, deflate or
identity is a 415 naming it.
"""

from __future__ import annotations

import zlib

from aiohttp import web

from disagg.worker.router.errors import APIError

# zlib's window bits per encoding: 16 + MAX_WBITS reads a gzip wrapper; deflate is picked per body
_GZIP = 16 + zlib.MAX_WBITS
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
        if self._z is None:
            self._z = zlib.decompressobj(self._wbits(data))
        elif self._z.eof:
            raise self._invalid("data after the end of the compressed stream")
        try:
            # at most one byte past the limit: enough to know it is exceeded, and no more work
            out = self._z.decompress(data, self.limit + 1 - self.produced)
        except zlib.error as e:
            raise self._invalid(str(e)) from None
        self._count(out)  # output cut at the cap is one byte past the limit: a 413 here
        if self._z.eof and self._z.unused_data:
            raise self._invalid("data after the end of the compressed stream")
        return out

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
