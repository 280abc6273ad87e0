"""The static-buffer decode path of CUDA graphs, run eagerly (TANDEM_STATIC_DECODE=1; on the CPU
the Triton backend runs under the interpreter) and, on a GPU, replayed from captured graphs:
padded batches give the eager path's tokens. The model and its tokenizer are built at test
time (the GPU image has no bundled model)."""

from __future__ import annotations

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.engine.cuda_graphs import STATIC_DECODE_ENV

# decode steps after the shared prefill step, with these max_tokens: 5 rows (above the
# largest size: eager), 4 (size 4), 3, 3 (padded to 4), 2 (size 2), 1, 1 (size 1)
MAX_TOKENS = [2, 3, 5, 6, 8]
SIZES = (1, 2, 4)
CUDA = torch.cuda.is_available()


def _llm(model: str, **kw) -> LLM:
    return LLM(model, attention_backend="triton", dtype="float32", num_kv_blocks=64,
               max_num_seqs=8, cuda_graph_sizes=SIZES, enable_prefix_caching=False, **kw)


def _generate(llm: LLM) -> list[list[int]]:
    prompts = [[5 + i] * (3 + 7 * i) + [100 + i] for i in range(len(MAX_TOKENS))]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)
              for m in MAX_TOKENS]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("captured", [
    False, pytest.param(True, marks=pytest.mark.skipif(not CUDA, reason="needs CUDA"))])
def test_padded_static_decode_gives_the_eager_tokens(tiny_model, monkeypatch, captured):
    """Static buffers run eagerly (the environment's switch, any device) or, on a GPU by
    default, replayed from one captured graph per size."""
    if captured:
        monkeypatch.delenv(STATIC_DECODE_ENV, raising=False)
    else:
        monkeypatch.setenv(STATIC_DECODE_ENV, "1")
    llm = _llm(tiny_model)
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.sizes == SIZES
    assert sorted(graphs.graphs) == (list(SIZES) if captured else [])
    static = _generate(llm)
    assert dict(graphs.runs) == {4: 3, 2: 1, 1: 2}
    llm.engine.runner.graphs = None  # the same engine, every step eager
    eager = _generate(llm)
    assert static == eager
    assert [len(t) for t in static] == MAX_TOKENS
    assert len({tuple(t) for t in static}) == len(MAX_TOKENS)  # rows are not mixed up


def test_static_path_is_off_by_default_on_the_cpu_and_with_enforce_eager(tiny_model,
                                                                         monkeypatch):
    """By default: none on the CPU, captured graphs on a GPU; never with enforce_eager."""
    monkeypatch.delenv(STATIC_DECODE_ENV, raising=False)
    graphs = _llm(tiny_model).engine.runner.graphs
    if CUDA:
        assert graphs is not None and sorted(graphs.graphs) == list(SIZES)
    else:
        assert graphs is None
    monkeypatch.setenv(STATIC_DECODE_ENV, "1")
    assert _llm(tiny_model, enforce_eager=True).engine.runner.graphs is None
    # backends without fixed-buffer metadata never get the static path
    assert LLM(tiny_model, attention_backend="torch", num_kv_blocks=16,
               dtype="float32").engine.runner.graphs is None


def test_worker_flag_enforce_eager():
    import argparse

    from tandem.serving.worker import add_engine_args, engine_config

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config(p.parse_args(["--enforce-eager"])).enforce_eager is True
    assert engine_config(p.parse_args([])).enforce_eager is False
