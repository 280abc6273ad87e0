"""The embedding and LM head an EAGLE proposer chains through compute what the target's own
forward does around its layers: Gemma 3's scaled embedding (`embedding_multiplier`) and
soft-capped logits (`final_logit_softcap`), both for the target's own modules (one rank)
and for the unsharded copies read from the checkpoint (tensor parallelism)."""

from __future__ import annotations

import pytest
import torch
import transformers

from tandem import LLM, SamplingParams
from tandem.engine.spec_decode.target import load_heads
from tests.engine.utils import TINY_VOCAB, write_tiny_tokenizer

CAP = 3.0


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory) -> str:
    """A 2-layer random Gemma 3 (a sliding and a global layer) whose logits are soft-capped
    (Gemma 2's `final_logit_softcapping`, which Gemma 3's config also takes)."""
    torch.manual_seed(5)
    cfg = transformers.Gemma3TextConfig(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
        initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        max_position_embeddings=128, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], final_logit_softcapping=CAP)
    path = tmp_path_factory.mktemp("gemma3-capped")
    transformers.Gemma3ForCausalLM(cfg).eval().save_pretrained(path)
    write_tiny_tokenizer(path)
    return str(path)


def test_eagle_heads_scale_the_embedding_and_cap_the_logits_as_the_target(tiny_gemma3):
    llm = LLM(tiny_gemma3, device="cpu", dtype="float32", enforce_eager=True,
              speculative_config={"method": "eagle", "num_speculative_tokens": 2})
    model = llm.engine.model
    arch = model.config
    assert arch.embedding_multiplier == pytest.approx(64 ** 0.5)
    assert arch.final_logit_softcap == CAP
    seen: dict[str, torch.Tensor] = {}

    def layer0_input(_module, args):  # (x, residual, rope, cache, meta); x None at layer 0
        seen.setdefault("residual", args[1].clone())

    def outputs(_module, _args, out):  # the EAGLE runner asks for (logits, hidden)
        seen.setdefault("logits", out[0].clone())
        seen.setdefault("hidden", out[1].clone())

    hooks = [model.layers[0].register_forward_pre_hook(layer0_input),
             model.register_forward_hook(outputs)]
    prompt = [5, 17, 99, 140, 33, 61, 250, 7, 81]
    llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    for h in hooks:
        h.remove()
    proposer = llm.engine.speculator.proposer
    ids = torch.tensor(prompt)
    with torch.no_grad():
        assert torch.equal(proposer.embed_tokens(ids), seen["residual"])
        assert torch.equal(proposer.lm_head(seen["hidden"]), seen["logits"])
        assert seen["logits"].abs().max() <= CAP
        assert not torch.equal(model.lm_head(seen["hidden"]), seen["logits"])  # capped
        # the unsharded copies read from the checkpoint (tensor parallelism) agree (their
        # head a plain float matmul, the target's packed for the CPU: rounding apart)
        copies = load_heads(tiny_gemma3, torch.device("cpu"), torch.float32)
        assert torch.equal(copies.embed_tokens(ids), seen["residual"])
        torch.testing.assert_close(copies.lm_head(seen["hidden"]), seen["logits"],
                                   rtol=1e-5, atol=1e-5)
