"""The per-deployment credential of internal traffic: every worker gRPC call and `/drain`.

One shared token per deployment, sent as `authorization: Bearer <token>` metadata and checked in
constant time by a server interceptor; optionally gRPC over TLS with cert-manager's file layout
(`tls.crt`, `tls.key`, `ca.crt` in one directory; with `ca.crt` the peer must present a
certificate it signed). The token comes from the environment (a `secretKeyRef`) or a file (a
mounted Secret), never from the command line. Without a token a process refuses to start unless
told `--insecure-internal` (development only). See docs/security.md.

The TLS files are re-read when they change (cert-manager renews them in place): new connections,
served or made, use the renewed certificate. With `--peer-identity certificate` each worker holds
its own certificate, whose common name is its worker id (`worker/serving/peer_identity.py`).
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
PEER_IDENTITY_ENV = "DISAGG_PEER_IDENTITY"
# token: one credential for the whole deployment; certificate: each worker's own TLS certificate
PEER_IDENTITIES = ("token", "certificate")
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


class TLSDirectory:
    """The TLS files of one directory, read again whenever one of them changed: cert-manager
    (its csi-driver, or a Secret volume) renews a certificate in place, long before a pod ends."""

    NAMES = ("tls.crt", "tls.key", "ca.crt")

    def __init__(self, directory: str, server_name: str | None = None):
        self.directory = Path(directory)
        self.server_name = server_name or None
        self._stamp = self._stat()
        self._files = TLSFiles.load(directory, server_name)

    def _stat(self) -> tuple:
        out = []
        for name in self.NAMES:
            try:
                st = (self.directory / name).stat()  # follows the volume's ..data symlink
                out.append((st.st_mtime_ns, st.st_size, st.st_ino))
            except OSError:
                out.append(None)
        return tuple(out)

    def current(self) -> TLSFiles:
        """The files as they are now (the same object while nothing changed). A renewal caught half
        written keeps the previous files until the next call reads a whole set."""
        stamp = self._stat()
        if stamp != self._stamp:
            try:
                self._files = TLSFiles.load(str(self.directory), self.server_name)
                self._stamp = stamp
                log.info("gRPC TLS files in %s changed: new connections use them", self.directory)
            except MissingCredential as e:
                log.warning("gRPC TLS files in %s changed but could not be read (%s): keeping the "
                            "previous ones", self.directory, e)  # fmt: skip
        return self._files


@dataclass(frozen=True)
class InternalAuth:
    """token None means insecure (explicit development opt-out)."""

    token: str | None
    tls: TLSFiles | TLSDirectory | None = None
    peer_identity: str = "token"  # one of PEER_IDENTITIES

    def __repr__(self) -> str:  # never print the token
        return (f"InternalAuth(token={'set' if self.token else None}, tls={self.tls is not None}, "
                f"peer_identity={self.peer_identity})")  # fmt: skip

    def tls_files(self) -> TLSFiles | None:
        """The TLS files new connections use now."""
        return self.tls.current() if isinstance(self.tls, TLSDirectory) else self.tls

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
        files = self.tls_files()
        if files is None:
            return server.add_insecure_port(address)
        served = [files]

        def renewed():  # gRPC asks before each new connection's handshake
            now = self.tls_files()
            if now is served[0]:
                return None
            served[0] = now
            return _server_configuration(now)

        creds = grpc.dynamic_ssl_server_credentials(
            _server_configuration(files), renewed, require_client_authentication=files.ca is not None
        )
        return server.add_secure_port(address, creds)

    @staticmethod
    def _channel_args(files: TLSFiles | None, options):
        options = list(options or [])
        if files is not None and files.server_name:
            options.append(("grpc.ssl_target_name_override", files.server_name))
        return options

    @staticmethod
    def _channel_credentials(files: TLSFiles):
        return grpc.ssl_channel_credentials(
            root_certificates=files.ca, private_key=files.key, certificate_chain=files.cert
        )

    def aio_channel(self, address: str, options=None) -> grpc.aio.Channel:
        files = self.tls_files()
        options = self._channel_args(files, options)
        if files is None:
            return grpc.aio.insecure_channel(address, options=options)
        return grpc.aio.secure_channel(address, self._channel_credentials(files), options=options)

    def channel(self, address: str, options=None) -> grpc.Channel:
        files = self.tls_files()
        options = self._channel_args(files, options)
        if files is None:
            return grpc.insecure_channel(address, options=options)
        return grpc.secure_channel(address, self._channel_credentials(files), options=options)

    def wrap(self, stub):
        """`stub` whose every call carries the credential (sync and asyncio stubs alike)."""
        return stub if self.token is None else _AuthedStub(stub, self.metadata)


INSECURE = InternalAuth(None)


def _server_configuration(files: TLSFiles):
    return grpc.ssl_server_certificate_configuration([(files.key, files.cert)], root_certificates=files.ca)


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
def add_token_file_arg(p: argparse.ArgumentParser) -> None:
    """The flag of the deployment's internal credential (every process that calls a peer takes it)."""
    p.add_argument("--internal-token-file", default=os.environ.get(TOKEN_FILE_ENV),
                   help=f"file holding the deployment's internal credential (or set {TOKEN_ENV}; "
                        "never pass the token itself on the command line)")  # fmt: skip


def add_cli_args(p: argparse.ArgumentParser) -> None:
    add_token_file_arg(p)
    p.add_argument("--grpc-tls-dir", default=os.environ.get(TLS_DIR_ENV),
                   help="directory with tls.crt, tls.key and optionally ca.crt (cert-manager's layout): "
                        "gRPC over TLS, peers' certificates checked against ca.crt")  # fmt: skip
    p.add_argument("--grpc-tls-server-name", default=os.environ.get(TLS_SERVER_NAME_ENV),
                   help="name the peers' certificates carry (when they are reached by IP)")  # fmt: skip
    p.add_argument("--insecure-internal", action="store_true",
                   default=os.environ.get(INSECURE_ENV, "") not in ("", "0", "false"),
                   help="development only: accept and send internal calls without a credential")  # fmt: skip


def add_peer_identity_arg(p: argparse.ArgumentParser) -> None:
    """A worker's setting only: the router serves no gRPC, it only calls workers."""
    p.add_argument("--peer-identity", choices=PEER_IDENTITIES,
                   default=os.environ.get(PEER_IDENTITY_ENV) or PEER_IDENTITIES[0],
                   help="token: every holder of the internal credential may act for any worker; "
                        "certificate: each worker holds its own certificate (common name = its worker "
                        "id, --grpc-tls-dir with ca.crt) and a worker writes KV only into the blocks of "
                        "the worker whose certificate called it")  # fmt: skip


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
    tls = TLSDirectory(args.grpc_tls_dir, args.grpc_tls_server_name) if args.grpc_tls_dir else None
    identity = getattr(args, "peer_identity", PEER_IDENTITIES[0])
    if identity == "certificate" and (tls is None or tls.current().ca is None):
        raise MissingCredential(
            f"{prog}: --peer-identity certificate needs --grpc-tls-dir ({TLS_DIR_ENV}) holding ca.crt: "
            "a caller is known by the certificate it presents, which only mutual TLS checks"
        )
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
    return InternalAuth(token, tls, identity)
