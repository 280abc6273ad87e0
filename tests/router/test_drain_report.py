"""A worker that reports it is draining (`Load.draining`, on SIGTERM) stops being routed to
at that load report, before its next readiness probe."""

from __future__ import annotations

import asyncio
import time

import grpc

from tandem.protocol import worker_pb2, worker_pb2_grpc
from tandem.router.index import PrefixIndex
from tandem.router.monitor import MonitorSettings, WorkerMonitor
from tandem.router.workers import Worker


class _Worker(worker_pb2_grpc.WorkerServicer):
    """A gRPC Worker whose load report says `draining` once told to; counts reports."""

    def __init__(self) -> None:
        self.draining = False
        self.reports = 0

    async def GetLoad(self, request, context):  # noqa: N802, ANN001, ANN201
        self.reports += 1
        return worker_pb2.Load(num_running=1, draining=self.draining)


def test_a_draining_load_report_makes_the_worker_unroutable_before_its_next_probe():
    async def scenario() -> None:
        server = grpc.aio.server()
        servicer = _Worker()
        worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        w = Worker(id="http://127.0.0.1:1", grpc_target=f"127.0.0.1:{port}")
        w.ready = True  # as its last probe found it; the probe loop is not running here
        mon = WorkerMonitor(w, PrefixIndex(), None, MonitorSettings(load_interval_s=0.02))
        mon._start_grpc_loops()
        try:
            deadline = time.monotonic() + 10
            while servicer.reports < 3:  # reports that it is not draining change nothing
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            assert w.ready and w.load.num_running == 1
            servicer.draining = True
            while w.ready:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
        finally:
            await mon.stop()
            await server.stop(None)

    asyncio.run(scenario())
