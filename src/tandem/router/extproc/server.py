"""Start and stop the endpoint picker's gRPC server on the router's event loop
(`RouterApp.lifespan` calls `start` after the rest of the router is up, `stop` before it
stops). Plaintext unless `tls_cert` / `tls_key` are set (then TLS with that PEM pair, as the
reference EPP serves by default; gateways are configured to match), mutual TLS with
`tls_client_ca`, and only named clients with `allowed_clients` (`clientauth`). The port is
not shared (`grpc.so_reuseport` off): a second process binding it fails start-up instead of
silently splitting streams."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2_grpc

from tandem.router.extproc.clientauth import AllowedClients, credentials
from tandem.router.extproc.service import ExtProcService, Health
from tandem.router.extproc.settings import ExtProcSettings

if TYPE_CHECKING:
    from tandem.router.routes import RouterApp

logger = logging.getLogger("tandem.router.extproc")
MESSAGE_SLACK = 1 << 20  # a body chunk's message is bounded by the body limit + this


class ExtProcServer:
    """The ext_proc and health services on `settings.host:settings.port`; `port` is the bound
    one once started."""

    def __init__(self, ra: RouterApp, settings: ExtProcSettings) -> None:
        self.ra, self.settings = ra, settings
        self.health = Health(ra)
        self.server: grpc.aio.Server | None = None
        self.port = 0
        self.objectives: asyncio.Task | None = None  # the InferenceObjective watch

    async def start(self) -> int:
        s = self.settings
        limit = self.ra.settings.max_body_bytes + MESSAGE_SLACK
        interceptors = [AllowedClients(s.allowed_clients)] if s.allowed_clients else []
        server = grpc.aio.server(interceptors=interceptors,
                                 options=[("grpc.so_reuseport", 0),
                                          ("grpc.max_receive_message_length", limit),
                                          ("grpc.max_send_message_length", limit)])
        pb_grpc.add_ExternalProcessorServicer_to_server(ExtProcService(self.ra, s), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health.servicer, server)
        address = f"[{s.host}]:{s.port}" if ":" in s.host else f"{s.host}:{s.port}"
        try:
            if (creds := credentials(s)) is not None:
                self.port = server.add_secure_port(address, creds)
            else:
                self.port = server.add_insecure_port(address)
        except RuntimeError as exc:  # grpc: "Failed to bind"
            raise OSError(f"ext_proc: cannot listen on {address}: {exc}") from None
        if not self.port:
            raise OSError(f"ext_proc: cannot listen on {address}")
        await self.health.start()
        if s.watch is not None:  # configuration errors raise here, before serving
            gauge = self.ra.metrics.extproc_objectives
            s.watched.on_change.append(gauge.set)
            self.objectives = asyncio.create_task(s.watch.run(s.watched.replace))
            await asyncio.sleep(0)
            if self.objectives.done():
                self.objectives.result()
        await server.start()
        self.server = server
        logger.info("endpoint picker (ext_proc%s) on %s:%d",
                    " over mutual TLS" if s.tls_client_ca else " over TLS" if s.tls_cert
                    else "", s.host, self.port)
        return self.port

    async def stop(self) -> None:
        if (task := self.objectives) is not None:
            self.objectives = None
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.health.stop()
        if self.server is not None:
            await self.server.stop(self.settings.grace_s)
            self.server = None


async def start(ra: RouterApp, settings: ExtProcSettings) -> ExtProcServer:
    """A started server (OSError when the port cannot be bound)."""
    server = ExtProcServer(ra, settings)
    await server.start()
    return server
