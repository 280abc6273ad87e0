"""The ASGI lifespan protocol from the server's side: `startup()` before serving,
`shutdown()` after.

An app that does not speak lifespan (it raises or returns at once) is served anyway, as
uvicorn's "auto" mode does; a `lifespan.startup.failed` is raised as `RuntimeError`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

logger = logging.getLogger(__name__)


class Lifespan:
    def __init__(self, app: Any) -> None:
        self.app = app
        self.inbox: asyncio.Queue[dict[str, str]] = asyncio.Queue()
        self.task: asyncio.Task | None = None
        self.started: asyncio.Future | None = None
        self.stopped: asyncio.Future | None = None
        self.supported = True

    async def _run(self) -> None:
        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"},
                 "state": {}}
        try:
            await self.app(scope, self.inbox.get, self._send)
        except Exception:
            if self.started is not None and not self.started.done():
                logger.info("the app does not support the ASGI lifespan", exc_info=True)
                self.supported = False
            else:
                logger.exception("lifespan failed")
        finally:
            for fut in (self.started, self.stopped):
                if fut is not None and not fut.done():
                    fut.set_result(None)

    async def _send(self, message: Mapping[str, Any]) -> None:
        kind = message["type"]
        if kind == "lifespan.startup.complete":
            self.started.set_result(None)  # type: ignore[union-attr]
        elif kind == "lifespan.startup.failed":
            self.started.set_exception(  # type: ignore[union-attr]
                RuntimeError(f"app start-up failed: {message.get('message', '')}"))
        elif kind in ("lifespan.shutdown.complete", "lifespan.shutdown.failed"):
            if kind.endswith("failed"):
                logger.error("app shutdown failed: %s", message.get("message", ""))
            self.stopped.set_result(None)  # type: ignore[union-attr]

    async def startup(self) -> None:
        loop = asyncio.get_running_loop()
        self.started, self.stopped = loop.create_future(), loop.create_future()
        self.task = loop.create_task(self._run())
        await self.inbox.put({"type": "lifespan.startup"})
        await self.started

    async def shutdown(self) -> None:
        if self.task is None or self.task.done():
            return
        await self.inbox.put({"type": "lifespan.shutdown"})
        await self.stopped
        await self.task
