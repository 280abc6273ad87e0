"""`tandem worker --speculative-config JSON` into EngineConfig (json.loads, a bad value is a
usage error naming the key), `tandem serve` handing it to every worker, the OpenAI body's
`speculative` extension (a strict boolean) into SamplingParams, and vLLM's
`vllm:spec_decode_*` counters on /metrics. Model-free."""

from __future__ import annotations

import dataclasses
import json

import pytest
from prometheus_client import generate_latest
from pydantic import ValidationError

from tandem.cli import main
from tandem.engine.spec_decode.config import SpeculativeConfig
from tandem.protocol.openai_api import ChatCompletionRequest, CompletionRequest
from tandem.serving.convert import sampling_params
from tandem.serving.embedded import plan as _plan
from tandem.serving.metrics import ServerMetrics
from tandem.serving.worker import engine_config
from tests.serving.test_worker_quant_flags import _ports, _stats, worker_parser

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 4}


def spec(argv: list[str]) -> SpeculativeConfig | None:
    return engine_config(worker_parser().parse_args(argv), serving=True).speculative_config


def test_the_flag_reaches_the_engine_config():
    assert spec([]) is None
    assert spec(["--speculative-config", json.dumps(NGRAM)]) == SpeculativeConfig(**NGRAM)
    draft = {"method": "draft", "model": "self", "draft_quantization": "int4"}
    assert spec(["--speculative-config", json.dumps(draft)]).to_dict() == {
        **draft, "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5,
        "adaptive": True}


@pytest.mark.parametrize(("value", "words"), [
    ("ngram", "argument --speculative-config: not JSON"),
    ("{'method': 'ngram'}", "not JSON"),  # a Python literal is not JSON
    ("__import__('os').getcwd()", "not JSON"),  # never evaluated
    ("[1, 2]", "speculative_config must be an object"),
    ('{"num_speculative_tokens": 2}', "speculative_config.method is required"),
    ('{"method": "ngram", "typo": 1}', "speculative_config: unknown keys ['typo']"),
    ('{"method": "ngram", "num_speculative_tokens": 99}',
     "speculative_config.num_speculative_tokens must be an integer in [1, 16], got 99"),
    ('{"method": "draft"}', "speculative_config.model is required for method 'draft'"),
])
def test_bad_values_are_usage_errors(value, words, capsys):
    with pytest.raises(SystemExit) as e:
        worker_parser().parse_args(["--speculative-config", value])
    assert e.value.code == 2 and words in capsys.readouterr().err


def test_serve_passes_it_to_the_workers_that_decode(monkeypatch):
    seen = []
    monkeypatch.setattr("tandem.cli._serve",
                        lambda args, extra, config: seen.append((args, extra)))
    main(["serve", "--workers", "1", "--prefill", "1", "--decode", "1",
          "--speculative-config", json.dumps(NGRAM)])
    ((args, extra),) = seen
    d = _plan(args, extra, _ports())
    got = {role: spec(cmd[cmd.index("worker") + 1:]) for role, _, cmd in d.workers}
    assert got == {"both": SpeculativeConfig(**NGRAM), "decode": SpeculativeConfig(**NGRAM),
                   "prefill": None}  # a prefill worker decodes nothing
    assert "--speculative-config" not in d.router


def test_serve_refuses_a_bad_one_before_starting_anything(monkeypatch, capsys):
    started = []
    monkeypatch.setattr("tandem.serving.embedded.worker_auth_key_file", lambda: started.append(1))
    with pytest.raises(SystemExit) as e:
        main(["serve", "--workers", "2", "--speculative-config", '{"method": "lookahead"}'])
    assert e.value.code == 2 and "speculative_config.method must be one of" in (
        capsys.readouterr().err)
    assert started == []


def test_the_request_field_is_a_strict_boolean():
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    for body in ({"prompt": "x"}, chat):
        kind = CompletionRequest if "prompt" in body else ChatCompletionRequest
        assert sampling_params(kind(**body), max_n=1).speculative is True
        assert sampling_params(kind(**body, speculative=False), max_n=1).speculative is False
        # null means the default, as for every field (docs/openai-api.md)
        assert sampling_params(kind(**body, speculative=None), max_n=1).speculative is True
        for bad in ("false", 0, 1, [True]):
            with pytest.raises(ValidationError) as e:
                kind(**body, speculative=bad)
            assert [err["loc"] for err in e.value.errors()] == [("speculative",)]


def _exposition(m: ServerMetrics) -> list[str]:
    return generate_latest(m.registry).decode().splitlines()


def test_spec_decode_counters_use_vllms_names():
    stats = dataclasses.replace(_stats(), spec_num_drafts=7, spec_num_draft_tokens=21,
                                spec_num_accepted_tokens=12, spec_accepted_per_pos=(6, 4))
    m = ServerMetrics("demo", lambda: stats)
    m.attach(16, 8, num_speculative_tokens=3)
    lines = _exposition(m)
    for name, value in (("drafts", 7), ("draft_tokens", 21), ("accepted_tokens", 12)):
        assert f'vllm:spec_decode_num_{name}_total{{model_name="demo"}} {value:.1f}' in lines
        assert f"# TYPE vllm:spec_decode_num_{name}_total counter" in lines
    per_pos = [line for line in lines
               if line.startswith("vllm:spec_decode_num_accepted_tokens_per_pos_total")]
    assert per_pos == [  # k = 3 positions, the last one not reached yet
        f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="demo",'
        f'position="{i}"}} {n:.1f}' for i, n in enumerate((6, 4, 0))]


def test_no_spec_decode_series_without_speculation():
    m = ServerMetrics("demo", _stats)
    m.attach(16, 8)
    assert not [line for line in _exposition(m) if "spec_decode" in line]
    m = ServerMetrics("demo", lambda: None)  # still loading
    m.attach(16, 8, num_speculative_tokens=4)
    assert not [line for line in _exposition(m) if "spec_decode" in line]
