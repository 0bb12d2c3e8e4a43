"""The per-deployment credential of internal traffic: every worker gRPC call and `/drain`.

One shared token per deployment, sent as `authorization: Bearer <token>` metadata and checked in
constant time by a server interceptor; optionally gRPC over TLS with cert-manager's file layout
(`tls.crt`, `tls.key`, `ca.crt` in one directory; with `ca.crt` the peer must present a
certificate it signed). The token comes from the environment (a `secretKeyRef`) or a file (a
mounted Secret), never from the command line. Without a token a process refuses to start unless
told `--insecure-internal` (development only). See docs/security.md.
"""

from __future__ import annotations

import argparse
import hmac
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import grpc
from prometheus_client import Counter

log = logging.getLogger("disagg.auth")

TOKEN_ENV = "DISAGG_INTERNAL_TOKEN"
TOKEN_FILE_ENV = "DISAGG_INTERNAL_TOKEN_FILE"
TLS_DIR_ENV = "DISAGG_GRPC_TLS_DIR"
TLS_SERVER_NAME_ENV = "DISAGG_GRPC_TLS_SERVER_NAME"
INSECURE_ENV = "DISAGG_INSECURE_INTERNAL"
METADATA_KEY = "authorization"

REFUSED = Counter(
    "disagg_internal_auth_refused_total",
    "Internal calls (gRPC, /drain) refused for a missing or wrong credential.",
    ["endpoint"],
)


class MissingCredential(SystemExit):
    pass


@dataclass(frozen=True)
class TLSFiles:
    cert: bytes
    key: bytes
    ca: bytes | None
    server_name: str | None = None

    @classmethod
    def load(cls, directory: str, server_name: str | None = None) -> TLSFiles:
        d = Path(directory)
        try:
            cert, key = (d / "tls.crt").read_bytes(), (d / "tls.key").read_bytes()
        except OSError as e:
            raise MissingCredential(f"gRPC TLS directory {d}: {e.strerror}: {e.filename}") from None
        ca = (d / "ca.crt").read_bytes() if (d / "ca.crt").is_file() else None
        return cls(cert, key, ca, server_name or None)


@dataclass(frozen=True)
class InternalAuth:
    """token None means insecure (explicit development opt-out)."""

    token: str | None
    tls: TLSFiles | None = None

    def __repr__(self) -> str:  # never print the token
        return f"InternalAuth(token={'set' if self.token else None}, tls={self.tls is not None})"

    # ---- checks -----------------------------------------------------------------------------
    def check(self, presented: str | None) -> bool:
        """`presented`: the value of the authorization header or metadata."""
        if self.token is None:
            return True
        expected = f"Bearer {self.token}".encode()
        return hmac.compare_digest(expected, (presented or "").encode())

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return () if self.token is None else ((METADATA_KEY, f"Bearer {self.token}"),)

    @property
    def headers(self) -> dict[str, str]:
        return {} if self.token is None else {"Authorization": f"Bearer {self.token}"}

    # ---- gRPC ---------------------------------------------------------------------------------
    def interceptors(self) -> list:
        return [] if self.token is None else [_TokenInterceptor(self)]

    def add_port(self, server, address: str) -> int:
        if self.tls is None:
            return server.add_insecure_port(address)
        creds = grpc.ssl_server_credentials(
            [(self.tls.key, self.tls.cert)],
            root_certificates=self.tls.ca,
            require_client_auth=self.tls.ca is not None,
        )
        return server.add_secure_port(address, creds)

    def _channel_args(self, options):
        options = list(options or [])
        if self.tls is not None and self.tls.server_name:
            options.append(("grpc.ssl_target_name_override", self.tls.server_name))
        return options

    def _channel_credentials(self):
        return grpc.ssl_channel_credentials(
            root_certificates=self.tls.ca, private_key=self.tls.key, certificate_chain=self.tls.cert
        )

    def aio_channel(self, address: str, options=None) -> grpc.aio.Channel:
        options = self._channel_args(options)
        if self.tls is None:
            return grpc.aio.insecure_channel(address, options=options)
        return grpc.aio.secure_channel(address, self._channel_credentials(), options=options)

    def channel(self, address: str, options=None) -> grpc.Channel:
        options = self._channel_args(options)
        if self.tls is None:
            return grpc.insecure_channel(address, options=options)
        return grpc.secure_channel(address, self._channel_credentials(), options=options)

    def wrap(self, stub):
        """`stub` whose every call carries the credential (sync and asyncio stubs alike)."""
        return stub if self.token is None else _AuthedStub(stub, self.metadata)


INSECURE = InternalAuth(None)


class _Method:
    def __init__(self, fn, metadata):
        self._fn, self._md = fn, metadata

    def __call__(self, *args, metadata=None, **kw):
        return self._fn(*args, metadata=(*self._md, *(metadata or ())), **kw)

    def future(self, *args, metadata=None, **kw):
        return self._fn.future(*args, metadata=(*self._md, *(metadata or ())), **kw)


class _AuthedStub:
    def __init__(self, stub, metadata):
        self._stub, self._md = stub, metadata

    def __getattr__(self, name):
        return _Method(getattr(self._stub, name), self._md)


def _denied(handler):
    """A handler of the same shape as `handler` that refuses the call."""
    message = "missing or wrong internal credential"

    async def unary(_request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def streaming(_request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - abort raises

    ser = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary, **ser)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(streaming, **ser)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary, **ser)
    return grpc.stream_stream_rpc_method_handler(streaming, **ser)


class _TokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, auth: InternalAuth):
        self._auth = auth

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        presented = next((v for k, v in details.invocation_metadata or () if k == METADATA_KEY), None)
        if self._auth.check(presented if isinstance(presented, str) else None):
            return handler
        REFUSED.labels(details.method.rsplit("/", 1)[-1]).inc()
        return _denied(handler)


# ---- configuration -----------------------------------------------------------------------------
def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--internal-token-file", default=os.environ.get(TOKEN_FILE_ENV),
                   help=f"file holding the deployment's internal credential (or set {TOKEN_ENV}; "
                        "never pass the token itself on the command line)")  # fmt: skip
    p.add_argument("--grpc-tls-dir", default=os.environ.get(TLS_DIR_ENV),
                   help="directory with tls.crt, tls.key and optionally ca.crt (cert-manager's layout): "
                        "gRPC over TLS, peers' certificates checked against ca.crt")  # fmt: skip
    p.add_argument("--grpc-tls-server-name", default=os.environ.get(TLS_SERVER_NAME_ENV),
                   help="name the peers' certificates carry (when they are reached by IP)")  # fmt: skip
    p.add_argument("--insecure-internal", action="store_true",
                   default=os.environ.get(INSECURE_ENV, "") not in ("", "0", "false"),
                   help="development only: accept and send internal calls without a credential")  # fmt: skip


def read_token(token_file: str | None, prog: str) -> str | None:
    """The credential from `token_file` (a mounted Secret) or DISAGG_INTERNAL_TOKEN; None without."""
    if token_file:
        try:
            token = Path(token_file).read_text().strip()
        except OSError as e:
            raise MissingCredential(f"{prog}: --internal-token-file: {e.strerror}: {e.filename}") from None
        if not token:
            raise MissingCredential(f"{prog}: --internal-token-file {token_file} is empty")
        return token
    return os.environ.get(TOKEN_ENV, "").strip() or None


def from_cli_args(args, prog: str) -> InternalAuth:
    """The credential from --internal-token-file or DISAGG_INTERNAL_TOKEN; a clear exit without one."""
    token = read_token(args.internal_token_file, prog)
    tls = TLSFiles.load(args.grpc_tls_dir, args.grpc_tls_server_name) if args.grpc_tls_dir else None
    if token is None:
        if not args.insecure_internal:
            raise MissingCredential(
                f"{prog}: no internal credential: set {TOKEN_ENV} (from a Secret) or --internal-token-file "
                f"(a mounted Secret); --insecure-internal ({INSECURE_ENV}=1) turns authentication off "
                "for development only"
            )
        log.warning(
            "internal authentication is OFF (--insecure-internal): anyone who reaches the ports is trusted"
        )
    return InternalAuth(token, tls)
