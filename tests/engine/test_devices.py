"""Device and dtype resolution (engine/devices.py) and the EngineConfig fields behind them.

This machine's torch is whatever CI installed; the CUDA branches are driven by patching the
few torch functions `resolve_device` reads, and the real build is checked as it is.
"""

from __future__ import annotations

import json

import pytest
import torch

from tandem.engine.config import EngineConfig
from tandem.engine.devices import device_type, resolve_device, resolve_dtype
from tandem.engine.errors import ConfigError

NO_CUDA = not torch.cuda.is_available()


def _fake_cuda(monkeypatch: pytest.MonkeyPatch, count: int,
               init_error: str = "No CUDA GPUs are available") -> None:
    """A CUDA build of torch that sees `count` devices."""
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)

    def init() -> None:
        raise RuntimeError(init_error)

    monkeypatch.setattr(torch.cuda, "init", init)


@pytest.mark.skipif(not NO_CUDA, reason="needs a machine without CUDA")
def test_auto_is_the_cpu_without_cuda_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="tandem.engine.devices"):
        assert resolve_device("auto") == torch.device("cpu")
    assert "device auto: cpu" in caplog.text
    assert device_type("auto") == "cpu"


def test_cpu_and_auto_with_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    _fake_cuda(monkeypatch, 2)
    assert resolve_device("auto") == torch.device("cuda", 0)
    assert resolve_device("cuda") == torch.device("cuda", 0)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert device_type("auto") == "cuda" and device_type("cuda:1") == "cuda"


@pytest.mark.skipif(torch.version.cuda is not None, reason="needs a CPU-only torch build")
@pytest.mark.parametrize("name", ["cuda", "cuda:0", "cuda:3"])
def test_cuda_on_a_cpu_only_build_names_the_build(name: str) -> None:
    with pytest.raises(ConfigError) as err:
        resolve_device(name)
    msg = str(err.value)
    assert f"device {name!r}" in msg and "CPU-only" in msg and torch.__version__ in msg


def test_cuda_build_without_a_visible_device(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cuda(monkeypatch, 0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(ConfigError) as err:
        resolve_device("cuda")
    msg = str(err.value)
    assert "no CUDA device is visible" in msg
    assert "CUDA_VISIBLE_DEVICES=''" in msg and "No CUDA GPUs are available" in msg
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with pytest.raises(ConfigError, match="CUDA_VISIBLE_DEVICES is unset"):
        resolve_device("cuda:0")


def test_cuda_index_out_of_range(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cuda(monkeypatch, 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    with pytest.raises(ConfigError) as err:
        resolve_device("cuda:2")
    msg = str(err.value)
    assert "index 2 is out of range" in msg and "2 CUDA device(s)" in msg
    assert "CUDA_VISIBLE_DEVICES='4,5'" in msg


@pytest.mark.parametrize("name", ["gpu", "cuda:", "cuda:x", "CUDA", "mps", "cpu:0", " cpu", ""])
def test_malformed_device_names(name: str) -> None:
    with pytest.raises(ConfigError, match="device must be 'auto', 'cpu', 'cuda' or 'cuda:N'"):
        resolve_device(name)
    with pytest.raises(ConfigError, match="device must be"):
        EngineConfig(device=name)


def test_dtype_auto_and_explicit(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert resolve_dtype("auto", cpu) is torch.float32
    for name, dtype in [("float32", torch.float32), ("bfloat16", torch.bfloat16),
                        ("float16", torch.float16)]:
        assert resolve_dtype(name, cpu) is dtype and resolve_dtype(name, gpu) is dtype
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert resolve_dtype("auto", gpu) is torch.bfloat16  # H100/H200
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert resolve_dtype("auto", gpu) is torch.float16  # T4: no bfloat16
    with pytest.raises(ConfigError, match="dtype must be 'auto' or one of"):
        resolve_dtype("fp8", cpu)


def test_config_defaults_and_validation() -> None:
    cfg = EngineConfig()
    assert (cfg.device, cfg.dtype, cfg.gpu_memory_utilization, cfg.attention_backend) == (
        "auto", "auto", 0.9, "auto")
    assert EngineConfig(gpu_memory_utilization=1.0).gpu_memory_utilization == 1.0
    assert EngineConfig(gpu_memory_utilization=1).gpu_memory_utilization == 1
    for bad in (0, 0.0, -0.1, 1.01, 2, True, "0.5", None):
        with pytest.raises(ConfigError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
            EngineConfig(gpu_memory_utilization=bad)
    with pytest.raises(ConfigError, match="dtype must be one of"):
        EngineConfig(dtype="float64")
    for ok in ("auto", "cpu", "cuda", "cuda:7"):
        assert EngineConfig(device=ok).device == ok


@pytest.mark.skipif(not NO_CUDA, reason="needs a machine without CUDA")
def test_llm_on_cuda_fails_before_loading_anything() -> None:
    from tandem import LLM

    with pytest.raises(ConfigError, match="device 'cuda:0'"):
        LLM(device="cuda:0", model="/nonexistent/model.gguf")  # the device is checked first


@pytest.mark.parametrize(("declared", "key"), [("bfloat16", "torch_dtype"),
                                               ("bfloat16", "dtype"), ("float16", "dtype"),
                                               ("float32", "torch_dtype"), (None, None)])
def test_dtype_auto_on_the_cpu_follows_a_bfloat16_checkpoint_where_the_cpu_has_bf16(
        tmp_path, declared, key) -> None:
    """A checkpoint stored in bfloat16 runs in bfloat16 on a CPU with bfloat16 math
    (AVX512-BF16 or AMX; `TANDEM_CPU_ISA` capping below that gives float32); float16,
    float32 and undeclared checkpoints, GGUF files and missing directories run float32."""
    from tests.engine.isa_levels import LEVELS_HERE, forced_level

    cpu = torch.device("cpu")
    config = {"model_type": "llama"} | ({key: declared} if key else {})
    (tmp_path / "config.json").write_text(json.dumps(config))
    for level in LEVELS_HERE:
        with forced_level(level):
            hw = level in ("avx512_bf16", "amx")
            want = torch.bfloat16 if declared == "bfloat16" and hw else torch.float32
            assert resolve_dtype("auto", cpu, tmp_path) is want, level
            assert resolve_dtype("float32", cpu, tmp_path) is torch.float32
            assert resolve_dtype("auto", cpu, tmp_path / "missing") is torch.float32
            assert resolve_dtype("auto", cpu, None) is torch.float32
