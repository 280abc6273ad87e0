"""The router hashes every architecture's prompts as its worker does: for each family's tiny
checkpoint (tests/engine/test_architectures.py's, built once per session, its tokenizer
adding BOS as the family's hub tokenizers do: Llama 3's from tokenizer.json's
post-processor, Gemma 3's also named by `add_bos_token`, both chat templates opening with
`bos_token`), a real worker app serves a chat and a completion request, and the block-hash
chain the router computes for each (its tokenizer resolved as `tandem serve` passes it,
`router_tokenizers`) is exactly the chain the worker's engine cached for the prompt."""

from __future__ import annotations

import time

import httpx
import pytest

from tandem.engine.async_engine import AsyncLLMEngine
from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.protocol.block_hash import hash_block_chain, request_hash_keys
from tandem.router import prompt as prompts
from tandem.router.core import Router, RouterSettings
from tandem.router.main import TokenizerResolver
from tandem.router.workers import Worker
from tandem.serving.api_server import ServerSettings, build_app
from tandem.serving.embedded import router_tokenizers
from tests.engine.test_architectures import BLOCK, CASES, build_case
from tests.router.test_router_app import Served

FAMILIES = [n for n in CASES if n not in ("llama-yarn", "phi4-mini")]  # their kin run here
BODIES = {
    "chat": {"messages": [
        {"role": "system", "content": "You answer in one short sentence, in English."},
        {"role": "user", "content": "Which river runs through the old town of Prague?"}]},
    "completions": {"prompt": "The quick brown fox jumps over the lazy dog, twice."},
}


@pytest.mark.parametrize("name", FAMILIES)
def test_the_router_hashes_each_familys_prompts_as_its_worker(name, tmp_path_factory):
    case = build_case(name, tmp_path_factory)
    model = f"org/tiny-{name}"
    config = EngineConfig(model=case.path, dtype="float32", block_size=BLOCK,
                          num_kv_blocks=64 * CASES[name].pool_scale,  # (a KV group's block)
                          num_threads=1, served_model_name=model)
    app = build_app(ServerSettings(served_model_name=model),
                    lambda: AsyncLLMEngine(LLMEngine(config)))
    served = Served(app, lean=False)
    try:
        deadline = time.monotonic() + 60
        while (ready := httpx.get(served.url + "/ready", timeout=5)).status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        block_size = ready.json()["block_size"]
        engine = app.state.holder.get()
        flags = router_tokenizers(config)
        resolver = TokenizerResolver(flags[1::2], {})
        router = Router(RouterSettings(seed=0), resolver)
        router.add_worker(Worker(id=served.url, model=model, ready=True, block_size=block_size))
        for kind, body in BODIES.items():
            body = {**body, "model": model, "max_tokens": 1, "temperature": 0}
            r = httpx.post(f"{served.url}/v1/{'chat/' if kind == 'chat' else ''}completions",
                           json=body, timeout=60)
            assert r.status_code == 200, r.text
            parsed = prompts.parse(kind, body, resolver(model))
            (chain,) = router.hashes(parsed, model).values()
            ids = parsed.token_ids
            assert r.json()["usage"]["prompt_tokens"] == len(ids), kind
            assert len(chain) == len(ids) // block_size >= 8, kind
            assert engine.cached_prefix_len(chain) == len(chain), kind  # every block, exactly
            if CASES[name].bos:  # one BOS leads either prompt (the template's, or the
                # tokenizer's): without it no block would be the worker's
                assert ids[0] == 1 and (kind == "chat" or ids[1] != 1), kind
                keys = request_hash_keys(model, None, "")
                assert engine.cached_prefix_len(hash_block_chain(ids[1:], block_size,
                                                                 keys)) == 0, kind
    finally:
        served.stop()
