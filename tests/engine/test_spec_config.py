"""`speculative_config` (vLLM's keys) into `SpeculativeConfig`: EngineConfig normalises a dict,
`LLM(speculative_config=...)` hands it on, bad values are a ConfigError naming the key; and
`SamplingParams(speculative=False)`, the per-request opt-out. Model-free."""

from __future__ import annotations

import types

import pytest

from tandem.engine import llm as llm_module
from tandem.engine.config import EngineConfig
from tandem.engine.errors import ConfigError, InvalidRequestError
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.spec_decode.config import MAX_SPECULATIVE_TOKENS, SpeculativeConfig

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
         "prompt_lookup_max": 5}
SELF_DRAFT = {"method": "draft", "model": "self", "draft_quantization": "int4",
              "draft_num_layers": 12, "num_speculative_tokens": 3, "adaptive": False}


def test_a_dict_is_normalised_and_round_trips():
    for raw in (NGRAM, SELF_DRAFT, {"method": "draft", "model": "/m/draft.gguf"},
                {"method": "eagle"}, {"method": "eagle", "model": "/m/head.safetensors"}):
        cfg = EngineConfig(speculative_config=dict(raw)).speculative_config
        assert isinstance(cfg, SpeculativeConfig)
        assert {k: v for k, v in cfg.to_dict().items() if k in raw} == raw
        assert SpeculativeConfig.from_dict(cfg.to_dict()) == cfg
        assert EngineConfig(speculative_config=cfg).speculative_config is cfg
    assert EngineConfig().speculative_config is None
    defaults = EngineConfig(speculative_config={"method": "ngram"}).speculative_config
    assert (defaults.num_speculative_tokens, defaults.prompt_lookup_min,
            defaults.prompt_lookup_max, defaults.adaptive) == (4, 2, 5, True)


BAD = [
    ("x", "speculative_config must be an object"),
    ([("method", "ngram")], "speculative_config must be an object"),
    ({}, "speculative_config.method is required"),
    ({"method": "medusa"}, "speculative_config.method must be one of"),
    ({"method": "ngram", "k": 3}, "speculative_config: unknown keys ['k']"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an "
                                                       "integer in [1, 16]"),
    ({"method": "ngram", "num_speculative_tokens": MAX_SPECULATIVE_TOKENS + 1},
     "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": "4"}, "num_speculative_tokens"),
    ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 3},
     "prompt_lookup_max must be an integer in [4, 64]"),
    ({"method": "ngram", "adaptive": "yes"}, "adaptive must be true or false"),
    ({"method": "ngram", "model": "self"}, "speculative_config.model applies to methods"),
    ({"method": "draft"}, "speculative_config.model is required for method 'draft'"),
    ({"method": "draft", "model": ""}, "model is required"),
    ({"method": "draft", "model": "self", "draft_quantization": "nf4"}, "draft_quantization"),
    ({"method": "draft", "model": "self", "draft_num_layers": 0}, "draft_num_layers"),
    ({"method": "eagle", "draft_num_layers": 2}, "draft_num_layers to 'draft' only"),
]


@pytest.mark.parametrize(("raw", "words"), BAD, ids=[w for _, w in BAD])
def test_bad_values_are_config_errors_naming_the_key(raw, words):
    with pytest.raises(ConfigError) as e:
        EngineConfig(speculative_config=raw)
    assert words in str(e.value)


def test_llm_hands_speculative_config_to_the_engine(monkeypatch):
    seen = []

    def engine(config):  # noqa: ANN001, ANN202 - what LLM reads of the engine it built
        seen.append(config)
        return types.SimpleNamespace(config=config)

    monkeypatch.setattr(llm_module, "LLMEngine", engine)
    llm_module.LLM(speculative_config=dict(NGRAM), max_num_seqs=8)
    (cfg,) = seen
    assert cfg.speculative_config == SpeculativeConfig(**NGRAM) and cfg.max_num_seqs == 8
    with pytest.raises(ConfigError, match="unknown keys"):
        llm_module.LLM(speculative_config={"method": "ngram", "lookahead": 2})


def test_sampling_params_opt_out():
    assert SamplingParams().speculative is True
    p = SamplingParams(speculative=False, n=3, seed=7, temperature=0.8)
    clones = [p.clone_for_sample(i) for i in range(3)]
    assert [c.speculative for c in clones] == [False] * 3
    assert [c.seed for c in clones] == [7, 8, 9]
    assert SamplingParams(n=2).clone_for_sample(1).speculative is True
    for bad in (0, 1, "false", None):
        with pytest.raises(InvalidRequestError, match="speculative must be true or false"):
            SamplingParams(speculative=bad)
