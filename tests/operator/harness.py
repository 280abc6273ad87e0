"""The operator for tests: `tandem.operator.cli.operator` (what `tandem operator` runs) in a
thread with its own event loop, against whatever $KUBECONFIG points at; and polling."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from tandem.operator.cli import operator
from tandem.operator.metrics import Samples
from tandem.operator.reconcile import OperatorConfig

T = TypeVar("T")


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
