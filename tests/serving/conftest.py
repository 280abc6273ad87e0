"""Fixtures of the serving tests: a real worker process on a real port (the helpers live in
`tests/serving/helpers.py`)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.serving.helpers import WorkerProcess, start_worker


@pytest.fixture(scope="module")
def worker(tmp_path_factory) -> Iterator[WorkerProcess]:
    w = start_worker(tmp_path_factory.mktemp("worker"), "--max-n", "4")
    yield w
    assert w.stop() == 0, w.log()
