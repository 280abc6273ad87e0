"""gRPC peers under `tls.TLSFiles`: the server-side identity check and client channels that
follow certificate renewals. Torch-free (the router uses it).

* `PeerIdentityInterceptor(name)`: every call on the server must come from a client whose
  certificate carries the DNS SAN `name` (PERMISSION_DENIED otherwise), so one CA can sign
  several InferenceServices without their pods serving each other.
* `PeerChannel(target, tls, options)`: a grpc.aio channel to one peer, made from the TLS
  files current when it is made and verifying the peer against `tls.server_name`; `get()`
  replaces it once the files changed (checked at most every `tls.recheck_s`), closing the
  old one after `retire_grace_s` so calls in flight on it can end.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Sequence
from typing import Any

import grpc

from tandem.protocol.tls import TLSFiles

logger = logging.getLogger(__name__)
SAN_PROPERTY = "x509_subject_alternative_name"


def peer_names(context: grpc.aio.ServicerContext) -> list[str]:
    """The subject alternative names of the calling peer's verified certificate."""
    return [v.decode("utf-8", "replace") for v in context.auth_context().get(SAN_PROPERTY, ())]


class PeerIdentityInterceptor(grpc.aio.ServerInterceptor):
    """Refuses (PERMISSION_DENIED) every call whose client certificate lacks `identity`."""

    def __init__(self, identity: str) -> None:
        self.identity = identity

    async def _check(self, context: grpc.aio.ServicerContext) -> None:
        names = peer_names(context)
        if self.identity not in names:
            logger.warning("gRPC: refused peer %s: its certificate names %s, not %s",
                           context.peer(), names or "nothing", self.identity)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"the client certificate does not name {self.identity}")

    async def intercept_service(self, continuation: Any,
                                details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return None
        check = self._check
        kw = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
        if not handler.response_streaming:
            inner = handler.stream_unary if handler.request_streaming else handler.unary_unary

            async def unary_response(request: Any, context: grpc.aio.ServicerContext) -> Any:
                await check(context)
                result = inner(request, context)
                return await result if inspect.isawaitable(result) else result

            make = (grpc.stream_unary_rpc_method_handler if handler.request_streaming
                    else grpc.unary_unary_rpc_method_handler)
            return make(unary_response, **kw)
        inner = handler.stream_stream if handler.request_streaming else handler.unary_stream

        async def streamed_response(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await check(context)
            result = inner(request, context)
            if inspect.isawaitable(result):  # writes with context.write()
                await result
                return
            if hasattr(result, "__aiter__"):
                async for message in result:
                    yield message
            else:
                for message in result:
                    yield message

        make = (grpc.stream_stream_rpc_method_handler if handler.request_streaming
                else grpc.unary_stream_rpc_method_handler)
        return make(streamed_response, **kw)


def server_interceptors(tls: TLSFiles | None) -> list[grpc.aio.ServerInterceptor]:
    """The identity check when `tls` names one; nothing otherwise."""
    return [PeerIdentityInterceptor(tls.server_name)] if tls and tls.server_name else []


class PeerChannel:
    """A grpc.aio channel to `target`: plaintext without `tls`, else mutual TLS from the
    files current when it was made, rebuilt by `get()` once they change."""

    def __init__(self, target: str, tls: TLSFiles | None,
                 options: Sequence[tuple[str, Any]] = (), retire_grace_s: float = 30.0) -> None:
        self.target = target
        self.tls = tls
        self.options = list(options)
        self.retire_grace_s = retire_grace_s
        self._channel: grpc.aio.Channel | None = None
        self._fingerprint = ""
        self._retired: dict[grpc.aio.Channel, asyncio.Task] = {}

    def get(self) -> grpc.aio.Channel:
        tls = self.tls
        if tls is None:
            if self._channel is None:
                self._channel = grpc.aio.insecure_channel(self.target, options=self.options)
            return self._channel
        material = tls.current()
        if self._channel is not None and material.fingerprint == self._fingerprint:
            return self._channel
        if (old := self._channel) is not None:
            logger.info("gRPC TLS: new channel to %s with the renewed certificates",
                        self.target)
            task = asyncio.ensure_future(old.close(grace=self.retire_grace_s))
            self._retired[old] = task
            task.add_done_callback(lambda _: self._retired.pop(old, None))
        self._channel = grpc.aio.secure_channel(
            self.target, tls.channel_credentials(material),
            options=[*self.options, *tls.channel_options()])
        self._fingerprint = material.fingerprint
        return self._channel

    async def close(self) -> None:
        """Close the channel and any retired one now (their calls in flight are cancelled)."""
        channels = [c for c in (self._channel, *self._retired) if c is not None]
        self._channel = None
        await asyncio.gather(*(c.close() for c in channels), *self._retired.values(),
                             return_exceptions=True)
