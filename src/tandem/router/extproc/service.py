"""The ext_proc gRPC servicer (`Process`: one `stream.ExtProcStream` per gRPC stream) and the
health services the endpoint-picker protocol names (`grpc.health.v1.Health`): `liveness`
(SERVING while the process answers), `readiness` and `envoy.service.ext_proc.v3.
ExternalProcessor` (SERVING while some worker is routable, else NOT_SERVING), and the
overall "" as readiness; refreshed every `HEALTH_INTERVAL_S`."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio

from tandem.router.extproc.settings import ExtProcSettings
from tandem.router.extproc.stream import ExtProcStream

if TYPE_CHECKING:
    from tandem.router.routes import RouterApp

logger = logging.getLogger("tandem.router.extproc")
SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
LIVENESS, READINESS = "liveness", "readiness"
HEALTH_INTERVAL_S = 1.0


class ExtProcService(pb_grpc.ExternalProcessorServicer):
    def __init__(self, ra: RouterApp, settings: ExtProcSettings) -> None:
        self.ra, self.settings = ra, settings

    async def Process(self, request_iterator: AsyncIterator[pb.ProcessingRequest],  # noqa: N802
                      context: grpc.aio.ServicerContext
                      ) -> AsyncIterator[pb.ProcessingResponse]:
        """Answer each message in order (`stream` module doc) until the gateway ends the
        stream or an immediate response ends it."""
        self.ra.metrics.extproc_streams.inc()
        stream = ExtProcStream(self.ra, self.settings)
        try:
            async for req in request_iterator:
                for answer in await stream.on_message(req):
                    yield answer
                if stream.finished:
                    return
        finally:
            stream.close()


def ready(ra: RouterApp) -> bool:
    """Some worker is routable now."""
    now = time.monotonic()
    return any(w.routable(now) for w in ra.router.workers.values())


class Health:
    """The health servicer and the task that keeps its statuses current."""

    def __init__(self, ra: RouterApp) -> None:
        self.ra = ra
        self.servicer = health_aio.HealthServicer()
        self.task: asyncio.Task | None = None

    async def refresh(self) -> None:
        serving = health_pb2.HealthCheckResponse.SERVING
        status = serving if ready(self.ra) else health_pb2.HealthCheckResponse.NOT_SERVING
        await self.servicer.set(LIVENESS, serving)
        for name in (READINESS, SERVICE, ""):
            await self.servicer.set(name, status)

    async def start(self) -> None:
        await self.refresh()
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(HEALTH_INTERVAL_S)
            try:
                await self.refresh()
            except Exception:  # a health refresh must never stop refreshing
                logger.exception("ext_proc health refresh failed")

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
        await self.servicer.enter_graceful_shutdown()
