"""Who may use the endpoint picker's gRPC port (`ExtProcSettings` `tls_*`, `allowed_clients`).

* `credentials`: the port's server credentials: TLS with the PEM pair, and with a client CA
  mutual TLS (client authentication required): a connection without a client certificate,
  or with one the CA did not issue, fails in the handshake, before any RPC. The mutual-TLS
  files are checked at start and followed as mounted Secrets change (`TLSFiles`). The rule
  is the port's, so it covers the health services on it as well as ext_proc (a gateway
  health-checking the picker over gRPC presents its client certificate there too; kubelet's
  gRPC probes cannot, so a TLS picker is probed over HTTP).
* `AllowedClients`: a server interceptor that serves an RPC only when the verified client
  certificate names one of the allowed identities (a SAN DNS name or URI, or the subject
  CN; gRPC's auth context), else PERMISSION_DENIED. Every service on the port passes it.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

import grpc

from tandem.protocol.tls import TLSFiles
from tandem.router.extproc.settings import ExtProcSettings

logger = logging.getLogger("tandem.router.extproc")
# gRPC auth-context properties naming the peer (x509_subject_alternative_name: every SAN;
# peer_dns / peer_uri: the DNS and URI ones, in gRPC releases that split them)
RECHECK_S = 5.0  # mutual TLS: the files are looked at again at most this often
NAME_PROPERTIES = ("x509_common_name", "x509_subject_alternative_name", "peer_dns", "peer_uri")


def credentials(s: ExtProcSettings) -> grpc.ServerCredentials | None:
    """The port's credentials (None: plaintext); OSError when a PEM file cannot be read or
    (mutual TLS) the files do not pass `TLSMaterial.check`. Mutual TLS re-reads the three
    files at most every RECHECK_S as new connections arrive (`protocol.tls.TLSFiles`:
    renewed certificates and a rotated client CA apply without a restart; a bad update
    keeps the last good files)."""
    if s.tls_cert is None or s.tls_key is None:
        return None
    if s.tls_client_ca is None:
        pair = [(Path(s.tls_key).read_bytes(), Path(s.tls_cert).read_bytes())]
        return grpc.ssl_server_credentials(pair)
    files = TLSFiles(Path(s.tls_cert), Path(s.tls_key), Path(s.tls_client_ca),
                     recheck_s=RECHECK_S)
    try:
        files.load()
    except ValueError as exc:
        raise OSError(f"ext_proc mutual TLS: {exc}") from None
    return files.server_credentials()  # requires a client certificate the CA issued


def client_names(auth: dict[str, Iterable[bytes]]) -> set[str]:
    """The identities a verified client certificate names (`context.auth_context()`)."""
    names: set[str] = set()
    for prop in NAME_PROPERTIES:
        for value in auth.get(prop, ()):
            names.add(value.decode("utf-8", "replace"))
    return names


class AllowedClients(grpc.aio.ServerInterceptor):
    """Serve an RPC only for a client certificate naming one of `allowed` (module doc)."""

    def __init__(self, allowed: Iterable[str]) -> None:
        self.allowed = frozenset(allowed)

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails],
                                         Awaitable[grpc.RpcMethodHandler]],
            details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler
        kind = ("stream" if handler.request_streaming else "unary") + "_" + \
            ("stream" if handler.response_streaming else "unary")
        inner = getattr(handler, kind)
        wrapped = self._wrap(inner, details.method)
        make = getattr(grpc, f"{kind}_rpc_method_handler")
        return make(wrapped, request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)

    async def _check(self, context: grpc.aio.ServicerContext, method: str) -> None:
        names = client_names(context.auth_context())
        if names & self.allowed:
            return
        shown = sorted(n[:128] for n in names)[:8]
        logger.warning("ext_proc: refused %s to a client certificate naming %s (not an "
                       "allowed client)", method, shown or "nothing")
        await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                            "this client certificate is not an allowed endpoint-picker client")

    def _wrap(self, inner: Callable[..., Any], method: str) -> Callable[..., Any]:
        if inspect.isasyncgenfunction(inner):  # answers yielded (ExternalProcessor/Process)
            async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
                await self._check(context, method)
                async for answer in inner(request, context):
                    yield answer

            return stream

        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await self._check(context, method)
            result = inner(request, context)  # a reply, or None after context.write
            return await result if inspect.isawaitable(result) else result

        return call
