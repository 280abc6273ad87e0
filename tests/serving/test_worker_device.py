"""`tandem worker` on a device it cannot use exits 1 with the reason, and `tandem serve`
hands each worker its own GPU (`serving/gpus.py`, `serving/embedded.plan`)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import pytest
import torch

from tandem.serving.embedded import plan as _plan
from tandem.serving.gpus import GpuSlot, assign_gpus, gpu_plan, visible_gpus
from tests.serving.helpers import free_port


def _worker(*flags: str, env: dict[str, str] | None = None) -> tuple[int, str, float]:
    started = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "tandem.cli", "worker", "--port",
                        str(free_port()), *flags], capture_output=True, text=True, timeout=120,
                       env=env)
    return r.returncode, r.stdout + r.stderr, time.monotonic() - started


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_worker_asked_for_cuda_exits_1_with_the_reason_before_serving():
    rc, out, _ = _worker("--device", "cuda")
    assert rc == 1, out
    reason = ("CPU-only" if torch.version.cuda is None else "no CUDA device is visible")
    assert "exiting: device 'cuda'" in out and reason in out, out
    assert ") serving " not in out and "Traceback" not in out  # uvicorn never started


def test_worker_asked_for_triton_without_its_interpreter_exits_1_with_the_reason():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        pytest.skip("Triton runs on this machine's GPU")
    rc, out, _ = _worker("--device", "cpu", "--attention-backend", "triton", env=env)
    assert rc == 1, out
    assert "attention backend 'triton' cannot run on cpu" in out and "TRITON_INTERPRET" in out


def test_assign_gpus_one_each_then_round_robin():
    assert assign_gpus([], 3) == []
    assert assign_gpus(["0", "1", "2", "3"], 2) == [GpuSlot("0", 1, 0), GpuSlot("1", 1, 0)]
    assert assign_gpus(["3", "5"], 5) == [
        GpuSlot("3", 3, 0), GpuSlot("5", 2, 0), GpuSlot("3", 3, 1), GpuSlot("5", 2, 1),
        GpuSlot("3", 3, 2)]
    for n_gpus in range(1, 6):
        for n in range(1, 12):
            slots = assign_gpus([str(g) for g in range(n_gpus)], n)
            per_gpu = {g: sum(s.gpu == g for s in slots) for g in {s.gpu for s in slots}}
            assert len(slots) == n and len(per_gpu) == min(n, n_gpus)
            assert max(per_gpu.values()) - min(per_gpu.values()) <= 1  # balanced
            assert all(s.sharers == per_gpu[s.gpu] for s in slots)
            assert [s.wave for s in slots] == [i // n_gpus for i in range(n)]


def test_visible_gpus_reads_cuda_visible_devices_as_cuda_does():
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2, 3,GPU-8f1c"}) == ["2", "3", "GPU-8f1c"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "1,-1,2"}) == ["1"]  # CUDA stops at -1
    if not torch.cuda.is_available() and not os.path.exists("/dev/nvidia0"):
        assert visible_gpus({}) == []


def test_tensor_parallel_workers_get_consecutive_gpu_groups():
    gpus = [str(g) for g in range(8)]
    assert assign_gpus(gpus, 2, per_worker=4) == [GpuSlot("0,1,2,3", 1, 0),
                                                  GpuSlot("4,5,6,7", 1, 0)]
    assert assign_gpus(gpus[:6], 3, per_worker=2) == [
        GpuSlot("0,1", 1, 0), GpuSlot("2,3", 1, 0), GpuSlot("4,5", 1, 0)]
    # more workers than groups: groups shared round-robin; a leftover GPU stays unused
    assert assign_gpus(gpus[:5], 3, per_worker=2) == [
        GpuSlot("0,1", 2, 0), GpuSlot("2,3", 1, 0), GpuSlot("0,1", 2, 1)]
    with pytest.raises(ValueError, match="needs 4 GPUs per worker; 2 visible"):
        assign_gpus(["0", "1"], 1, per_worker=4)
    for bad in (0, -2):  # a clear error, not a ZeroDivisionError
        with pytest.raises(ValueError, match="--tensor-parallel-size must be >= 1"):
            assign_gpus(gpus, 2, per_worker=bad)
        with pytest.raises(ValueError, match="--tensor-parallel-size must be >= 1"):
            gpu_plan(2, ["-tp", str(bad)], gpus)
    envs, _, _ = gpu_plan(2, ["--tensor-parallel-size", "2"], gpus[:4])
    assert envs == [{"CUDA_VISIBLE_DEVICES": "0,1"}, {"CUDA_VISIBLE_DEVICES": "2,3"}]
    envs, _, _ = gpu_plan(1, ["-tp", "3"], gpus[:4])
    assert envs == [{"CUDA_VISIBLE_DEVICES": "0,1,2"}]


def test_gpu_plan_flags():
    envs, waves, flags = gpu_plan(3, [], ["0", "1"])
    assert envs == [{"CUDA_VISIBLE_DEVICES": g} for g in "010"] and waves == [0, 0, 1]
    assert flags == [["--device", "cuda", "--gpu-memory-utilization", "0.45"],
                     ["--device", "cuda"],
                     ["--device", "cuda", "--gpu-memory-utilization", "0.45"]]
    _, _, flags = gpu_plan(2, ["--gpu-memory-utilization=0.7", "--device", "cuda"], ["0"])
    assert flags == [[], []]  # the user's own values stand
    for user in (["--device", "cpu"], ["--device=cuda:1"]):
        assert gpu_plan(2, user, ["0", "1"]) == ([{}, {}], [0, 0], [[], []])
    assert gpu_plan(2, [], []) == ([{}, {}], [0, 0], [[], []])


def test_serve_plan_gives_each_worker_its_gpu():
    ports = iter(range(9000, 9100))
    args = argparse.Namespace(host="127.0.0.1", port=8000, log_level="INFO", workers=None,
                              prefill=1, decode=2, pd_threshold=None,
                              pd_max_prefill_queue=None, pd_max_local_prefill=None)
    d = _plan(args, ["--max-num-seqs", "8"], lambda host: next(ports), gpus=["4", "6"])
    assert [role for role, _, _ in d.workers] == ["prefill", "decode", "decode"]
    assert d.envs == [{"CUDA_VISIBLE_DEVICES": g} for g in ("4", "6", "4")]
    assert d.waves == [0, 0, 1]
    for (_, _, cmd), util in zip(d.workers, ("0.45", None, "0.45"), strict=True):
        assert cmd[cmd.index("--device") + 1] == "cuda"
        assert (cmd[cmd.index("--gpu-memory-utilization") + 1]
                if "--gpu-memory-utilization" in cmd else None) == util
    cpu = _plan(args, [], lambda host: next(ports), gpus=[])
    assert cpu.envs == [{}, {}, {}] and all("--device" not in c for _, _, c in cpu.workers)
