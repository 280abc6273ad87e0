"""`tandem worker --tensor-parallel-size 2` as a real process: its completions equal the
one-rank engine's, `/ready` reports the engine, and when a rank process is killed the worker
fails its readiness, ends the request in flight with an error and exits with code 1 instead
of hanging."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from tandem.engine.llm import LLM
from tandem.engine.sampling_params import SamplingParams
from tests.engine.utils import make_tiny_model_dir
from tests.serving.helpers import start_worker

SHAPE = dict(hidden_size=96, intermediate_size=192, num_attention_heads=12,
             num_key_value_heads=6)
PROMPTS = ["Tensor parallel workers", "A rank that dies", "def add(a, b):"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tp-worker") / "tiny"
    make_tiny_model_dir(path, "llama", seed=6, **SHAPE)
    return str(path)


def _rank_pids(parent: int) -> list[int]:
    """The worker's spawned rank processes (not multiprocessing's resource tracker)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and b"spawn_main" in cmd and b"resource_tracker" not in cmd:
            pids.append(int(proc.name))
    return pids


def test_tp_worker_serves_then_exits_when_a_rank_dies(tmp_path, tiny: str) -> None:
    worker = start_worker(tmp_path, "--model", tiny, "--served-model-name", "tiny",
                          "--tensor-parallel-size", "2", "--num-threads", "1",
                          "--block-size", "4", "--max-model-len", "256")
    try:
        client = openai.OpenAI(base_url=worker.url + "/v1", api_key="x")
        got = [client.completions.create(model="tiny", prompt=p, max_tokens=10,
                                         temperature=0).choices[0].text for p in PROMPTS]
        ref = LLM(tiny, block_size=4, max_model_len=256, num_threads=1).generate(
            PROMPTS, SamplingParams(max_tokens=10, temperature=0.0))
        assert got == [o.outputs[0].text for o in ref]

        ranks = _rank_pids(worker.proc.pid)
        assert len(ranks) == 1, ranks
        streamed: list[str] = []
        error: list[BaseException] = []

        def stream() -> None:  # a long request, in flight when the rank dies
            try:
                for chunk in client.completions.create(
                        model="tiny", prompt="on and on", max_tokens=200, temperature=0,
                        stream=True, extra_body={"ignore_eos": True}):
                    streamed.append(chunk.choices[0].text)
            except Exception as exc:  # noqa: BLE001 - what the client saw
                error.append(exc)

        t = threading.Thread(target=stream)
        t.start()
        deadline = time.monotonic() + 30
        while len(streamed) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(ranks[0], signal.SIGKILL)
        t.join(timeout=30)
        assert not t.is_alive(), "the request in flight hung"
        assert 3 <= len(streamed) < 200
        assert len(error) == 1 and isinstance(error[0], openai.APIError)
        assert "the engine stopped: rank 1" in str(error[0]), error
        code = worker.proc.wait(timeout=30)  # exits by itself
        assert code == 1
        log = worker.log()
        assert "rank 1" in log and "exiting: the engine stopped" in log
        with pytest.raises(httpx.HTTPError):
            httpx.get(worker.url + "/ready", timeout=2)
    finally:
        worker.stop(signal.SIGKILL)


def _gone(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return True
        if stat.rsplit(")", 1)[1].split()[0] == "Z":  # exited, not yet reaped
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 0), (signal.SIGKILL, -9)])
def test_tp_worker_ranks_never_outlive_it(tmp_path, tiny: str, sig: int, code: int) -> None:
    """SIGTERM drains and stops the ranks (exit 0); after a SIGKILL the orphaned rank
    notices rank 0's sockets close and exits by itself."""
    worker = start_worker(tmp_path, "--model", tiny, "--tensor-parallel-size", "2",
                          "--num-threads", "1", "--block-size", "4", "--max-model-len", "256")
    try:
        (rank,) = _rank_pids(worker.proc.pid)
        worker.proc.send_signal(sig)
        assert worker.proc.wait(timeout=60) == code, worker.log()[-3000:]
        assert _gone(rank, within=30), f"rank {rank} outlived the worker"
    finally:
        worker.stop(signal.SIGKILL)
