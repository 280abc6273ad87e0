"""`ModelRunner.observe`: during the step that completes a prompt, an observer gets the
request's block table and then each layer as soon as its K/V are final, and not before
(what layer-by-layer KV transfer relies on)."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.llm import LLM
from tandem.engine.sampling_params import SamplingParams
from tests.engine.utils import make_tiny_model_dir


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    out = tmp_path_factory.mktemp("llama")
    make_tiny_model_dir(out, "llama", num_hidden_layers=4)
    return str(out)


class Recorder:
    """Copies every layer's pages of the request's blocks at each `layer_done`."""

    def __init__(self, caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.caches = caches
        self.tables: list[list[int]] = []
        self.layers: list[int] = []
        self.snapshots: list[list[torch.Tensor]] = []

    def begin(self, block_ids: list[int]) -> None:
        self.tables.append(block_ids)

    def layer_done(self, layer: int, event: object) -> None:
        assert event is None  # CPU
        ids = torch.tensor(self.tables[-1])
        self.layers.append(layer)
        self.snapshots.append([torch.stack((k[ids], v[ids])) for k, v in self.caches])


@pytest.mark.parametrize("budget", [4096, 24], ids=["one-step", "chunked"])
def test_layers_are_reported_in_order_once_final(path, budget):
    llm = LLM(path, block_size=4, kv_cache_memory=64 << 20, max_num_batched_tokens=budget)
    eng = llm.engine
    caches = eng.runner.kv_caches
    rec = Recorder(caches)
    prompt = [100 + (i * 37) % 3000 for i in range(61)]  # 15 full blocks and a token
    eng.runner.observe("p", rec)
    eng.add_request("p", prompt, SamplingParams(max_tokens=1, temperature=0.0),
                    keep_blocks=True)
    steps = 0
    while eng.has_unfinished_requests():
        eng.step()
        steps += 1
    eng.runner.unobserve("p")
    assert steps == (1 if budget > len(prompt) else -(-len(prompt) // budget))
    kept = [b.block_id for b in eng.kv.kept_blocks("p")]
    assert rec.tables == [kept]  # once, in the last step, the request's whole table
    num_layers = len(caches)
    assert rec.layers == list(range(num_layers))
    ids = torch.tensor(kept)
    final = [torch.stack((k[ids], v[ids])) for k, v in caches]
    for layer, snap in enumerate(rec.snapshots):
        assert torch.equal(snap[layer], final[layer])  # final when reported
        if layer + 1 < num_layers:  # the next layer's newest block is not written yet
            assert not torch.equal(snap[layer + 1][:, -1], final[layer + 1][:, -1])


def test_unobserved_and_decode_steps_report_nothing(path):
    llm = LLM(path, block_size=4, kv_cache_memory=64 << 20)
    eng = llm.engine
    rec = Recorder(eng.runner.kv_caches)
    eng.runner.observe("watched", rec)
    eng.add_request("other", list(range(200, 230)), SamplingParams(max_tokens=4))
    eng.add_request("watched", list(range(300, 330)), SamplingParams(max_tokens=4))
    while eng.has_unfinished_requests():
        eng.step()
    assert len(rec.tables) == 1 and rec.layers == list(range(len(eng.runner.kv_caches)))
