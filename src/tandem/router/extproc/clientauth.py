"""Who may use the endpoint picker's gRPC port (`ExtProcSettings` `tls_*`, `allowed_clients`).

* `credentials`: the port's server credentials: TLS with the PEM pair, and with a client CA
  mutual TLS (`require_client_auth`): a connection without a client certificate, or with
  one the CA did not issue, fails in the handshake, before any RPC. The rule is the port's,
  so it covers the health services on it as well as ext_proc (a gateway health-checking the
  picker over gRPC presents its client certificate there too; kubelet's gRPC probes cannot,
  so a TLS picker is probed over HTTP).
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

from tandem.router.extproc.settings import ExtProcSettings

logger = logging.getLogger("tandem.router.extproc")
# gRPC auth-context properties naming the peer (x509_subject_alternative_name: every SAN;
# peer_dns / peer_uri: the DNS and URI ones, in gRPC releases that split them)
NAME_PROPERTIES = ("x509_common_name", "x509_subject_alternative_name", "peer_dns", "peer_uri")


def credentials(s: ExtProcSettings) -> grpc.ServerCredentials | None:
    """The port's credentials (None: plaintext); OSError when a PEM file cannot be read."""
    if s.tls_cert is None or s.tls_key is None:
        return None
    pair = [(Path(s.tls_key).read_bytes(), Path(s.tls_cert).read_bytes())]
    if s.tls_client_ca is None:
        return grpc.ssl_server_credentials(pair)
    return grpc.ssl_server_credentials(pair, root_certificates=Path(s.tls_client_ca)
                                       .read_bytes(), require_client_auth=True)


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
