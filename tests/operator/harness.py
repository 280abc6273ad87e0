"""The operator for tests: `tandem.operator.cli.operator` (what `tandem operator` runs) in a
thread with its own event loop, against whatever $KUBECONFIG points at; and polling."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import parse_qs, urlsplit

from tandem.operator.cli import operator
from tandem.operator.metrics import Samples
from tandem.operator.reconcile import OperatorConfig

T = TypeVar("T")


@contextlib.contextmanager
def operator_at(kubeconfig: Path, config: OperatorConfig) -> Iterator[OperatorThread]:
    """The operator running (`OperatorThread`) with $KUBECONFIG at `kubeconfig`, restored
    after it stops."""
    old = os.environ.get("KUBECONFIG")
    os.environ["KUBECONFIG"] = str(kubeconfig)
    try:
        with OperatorThread(config) as op:
            yield op
    finally:
        if old is None:
            os.environ.pop("KUBECONFIG", None)
        else:
            os.environ["KUBECONFIG"] = old


class OperatorThread:
    def __init__(self, config: OperatorConfig, namespaces: tuple[str, ...] = ()) -> None:
        self.stop_flag, self.ready_flag = threading.Event(), threading.Event()
        self.errors: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, args=(config, namespaces),
                                        daemon=True)

    def _run(self, config: OperatorConfig, namespaces: tuple[str, ...]) -> None:
        try:
            asyncio.run(operator(config, clusterwide=not namespaces, namespaces=namespaces,
                                 stop_flag=self.stop_flag, ready_flag=self.ready_flag))
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.errors.append(exc)

    def __enter__(self) -> OperatorThread:
        self._thread.start()
        assert self.ready_flag.wait(30), f"the operator did not start: {self.errors}"
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_flag.set()
        self._thread.join(30)
        assert not self._thread.is_alive(), "the operator did not stop"


class FakeMetrics:
    """A `MetricsSource` the test programs: Service name -> per pod samples."""

    def __init__(self) -> None:
        self.samples: dict[str, Samples] = {}
        self.calls: list[tuple[float, str]] = []
        self._lock = threading.Lock()

    def set(self, service: str, **pods: dict[str, float]) -> None:
        with self._lock:
            self.samples[service] = {pod: dict(m) for pod, m in pods.items()}

    def scrape(self, namespace: str, service: str) -> Samples:
        with self._lock:
            self.calls.append((time.monotonic(), service))
            return {p: dict(m) for p, m in self.samples.get(service, {}).items()}


class FakeRouter:
    """A real HTTP server answering the router's `GET /scaling?model=&role=` as the test
    programs it: (model, role) -> a demand and the body's other fields, or an HTTP status
    to fail with. `requests`: (monotonic time, path, query) of every request. Not
    programmed: 404, as the router answers for a model it does not know."""

    def __init__(self) -> None:
        self.answers: dict[tuple[str, str], dict[str, Any]] = {}
        self.failing: int | None = None  # every request answered with this status
        self.requests: list[tuple[float, str, dict[str, list[str]]]] = []
        self._lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                parts = urlsplit(self.path)
                query = parse_qs(parts.query)
                with outer._lock:
                    outer.requests.append((time.monotonic(), parts.path, query))
                    key = (query.get("model", [""])[0], query.get("role", [""])[0])
                    status, answer = outer.failing, outer.answers.get(key)
                if status is None and answer is None:
                    status = 404
                if status is not None:
                    self.send_response(status)
                    self.end_headers()
                    return
                body = json.dumps({"model": key[0], "role": key[1], **answer}).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def set(self, model: str, role: str, demand: float, **fields: Any) -> None:
        """Answer `demand` for (model, role); `fields`: the body's others (default 0)."""
        with self._lock:
            self.answers[(model, role)] = {
                "demand": demand, "queued": 0, "running": 0, "waiting": 0,
                "kv_utilization": 0.0, "ready_workers": 0, "queued_by_band": {}, **fields}

    def fail(self, status: int | None) -> None:
        with self._lock:
            self.failing = status

    def count(self) -> int:
        with self._lock:
            return len(self.requests)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def wait_for(fn: Callable[[], T], timeout: float = 10.0, what: str = "",
             interval: float = 0.05,
             errors: tuple[type[BaseException], ...] = (KeyError, IndexError, TypeError)) -> T:
    """`fn()` once it is truthy (`errors` mean: not yet); fails with the last value after
    `timeout` seconds."""
    deadline, value = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        try:
            value = fn()
        except errors as exc:
            value = exc  # not there yet
        else:
            if value:
                return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what or fn}: last {value!r}")


def condition(obj: dict[str, Any], type_: str) -> dict[str, Any] | None:
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c["type"] == type_:
            return c
    return None
