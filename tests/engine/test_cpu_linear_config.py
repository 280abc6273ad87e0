"""`EngineConfig.cpu_linear` names what it does: "packed" packs the CPU float32 linears once at
load (native panels or oneDNN's layout, whichever the CPU and TANDEM_LINEAR_KERNEL pick),
"torch" leaves them plain `F.linear`; the old name "onednn" is read as "packed" with a
warning, anything else is a ConfigError listing the values."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from tandem.engine.config import CPU_LINEARS, EngineConfig
from tandem.engine.errors import ConfigError
from tandem.engine.model.cpu_linear import packing_available
from tandem.engine.model_build import build_shard
from tandem.engine.native import load_native
from tandem.engine.quant.base import QuantLinear
from tandem.engine.quant.float_methods import PackedMethod
from tests.engine.utils import make_tiny_model_dir

CPU = torch.device("cpu")


def test_the_values_and_the_default():
    assert CPU_LINEARS == ("packed", "torch")
    assert EngineConfig().cpu_linear == "packed"
    assert EngineConfig(cpu_linear="torch").cpu_linear == "torch"


def test_onednn_is_the_deprecated_name_of_packed(caplog):
    with caplog.at_level(logging.WARNING, logger="tandem.engine.config"):
        cfg = EngineConfig(cpu_linear="onednn")
    assert cfg.cpu_linear == "packed"
    (record,) = [r for r in caplog.records if "cpu_linear" in r.getMessage()]
    assert record.levelno == logging.WARNING
    assert 'cpu_linear="onednn" is deprecated: it is "packed"' in record.getMessage()


@pytest.mark.parametrize("value", ["mkl", "native", "", "Packed"])
def test_other_values_are_refused(value):
    with pytest.raises(ConfigError, match=r"cpu_linear must be one of \('packed', 'torch'\), "
                                          rf"got {value!r}"):
        EngineConfig(cpu_linear=value)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    make_tiny_model_dir(path, "llama", seed=5, tokenizer="trained")
    return path


@pytest.mark.parametrize("value", ["packed", "onednn", "torch"])
def test_the_linears_are_what_the_value_names(tiny, value):
    cfg = EngineConfig(model=str(tiny), device="cpu", dtype="float32", cpu_linear=value)
    model = build_shard(cfg, tiny, CPU, torch.float32).model
    down = model.layers[0].mlp.down_proj
    if value == "torch" or not packing_available(torch.float32, CPU, load_native()):
        assert type(down) is nn.Linear
    else:
        assert isinstance(down, QuantLinear) and isinstance(down.method, PackedMethod)
