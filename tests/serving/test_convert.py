"""OpenAI request -> engine parameter mapping (pure functions, no server)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tandem.engine.errors import InvalidRequestError
from tandem.engine.outputs import CompletionOutput, RequestOutput
from tandem.protocol.openai_api import ChatCompletionRequest, CompletionRequest
from tandem.serving.convert import completion_prompts, sampling_params, usage


def test_openai_defaults_and_vllm_extensions():
    p = sampling_params(CompletionRequest(prompt="x"), max_n=4)
    assert (p.temperature, p.top_p, p.max_tokens, p.n) == (1.0, 1.0, 16, 1)
    p = sampling_params(CompletionRequest(
        prompt="x", temperature=0, top_k=5, min_p=0.1, repetition_penalty=1.2, seed=3,
        stop=["\n"], stop_token_ids=[7], ignore_eos=True, min_tokens=2, max_tokens=9,
        logprobs=2), max_n=4)
    assert (p.greedy, p.top_k, p.min_p, p.repetition_penalty, p.seed) == (True, 5, 0.1, 1.2, 3)
    assert (p.stop_strings, p.stop_token_ids, p.ignore_eos) == (("\n",), [7], True)
    assert (p.min_tokens, p.max_tokens, p.logprobs) == (2, 9, 2)


def test_chat_max_completion_tokens_wins_and_logprobs_map():
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                max_completion_tokens=7, logprobs=True, top_logprobs=3)
    p = sampling_params(req, max_n=1)
    assert (p.max_tokens, p.logprobs) == (7, 3)
    plain = sampling_params(ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}]),
                            max_n=1)
    assert p.max_tokens == 7 and plain.max_tokens is None and plain.logprobs is None


@pytest.mark.parametrize(("req", "param"), [
    (CompletionRequest(prompt="x", n=9), "n"),
    (CompletionRequest(prompt="x", suffix="y"), "suffix"),
    (CompletionRequest(prompt="x", echo=True, max_tokens=0, min_tokens=1), "min_tokens"),
    (CompletionRequest(prompt="x", max_tokens=0), "max_tokens"),  # 0 only with echo
    (CompletionRequest(prompt="x", temperature=-1), "temperature"),
    (CompletionRequest(prompt="x", seed=2**64), "seed"),  # would overflow torch's generator
    (ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], top_logprobs=2),
     "top_logprobs"),
    (ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], logprobs=True,
                           top_logprobs=21), "top_logprobs"),
])
def test_bad_values_name_their_field(req, param):
    with pytest.raises(InvalidRequestError) as err:
        sampling_params(req, max_n=4)
    assert err.value.param == param


def test_prompt_shapes():
    assert completion_prompts(CompletionRequest(prompt="a")) == ["a"]
    assert completion_prompts(CompletionRequest(prompt=[1, 2])) == [[1, 2]]
    assert completion_prompts(CompletionRequest(prompt=["a", "b"])) == ["a", "b"]
    assert completion_prompts(CompletionRequest(prompt=[[1], [2, 3]])) == [[1], [2, 3]]
    for empty in ("", [], [""], [[]]):
        with pytest.raises(InvalidRequestError):
            completion_prompts(CompletionRequest(prompt=empty))


def test_client_sizes_are_bounded_before_tokenizing():
    with pytest.raises(ValidationError):
        CompletionRequest(prompt=["x"] * 257)
    with pytest.raises(ValidationError):
        CompletionRequest(prompt="x", stop=["s"] * 17)
    with pytest.raises(ValidationError):
        CompletionRequest(prompt=[-1])
    with pytest.raises(ValidationError):
        ChatCompletionRequest(messages=[])


def test_usage_counts_every_sample_and_cached_tokens():
    outs = [RequestOutput("r", None, [1, 2, 3], [CompletionOutput(0, "a", [5, 6]),
                                                 CompletionOutput(1, "b", [7])],
                          num_cached_tokens=2)]
    u = usage(outs)
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (3, 3, 6)
    assert u.prompt_tokens_details == {"cached_tokens": 2}


def test_echo_asks_for_the_prompts_logprobs_and_echo_only_computes_one_token():
    p = sampling_params(CompletionRequest(prompt="x", echo=True, logprobs=2, max_tokens=5),
                        max_n=1)
    assert (p.prompt_logprobs, p.logprobs, p.max_tokens) == (2, 2, 5)
    p = sampling_params(CompletionRequest(prompt="x", echo=True, logprobs=0, max_tokens=0),
                        max_n=1)
    assert (p.prompt_logprobs, p.logprobs, p.max_tokens) == (0, 0, 1)
    p = sampling_params(CompletionRequest(prompt="x", echo=True), max_n=1)
    assert p.prompt_logprobs is None  # no logprobs asked for: nothing extra computed
    assert sampling_params(CompletionRequest(prompt="x", logprobs=1), max_n=1
                           ).prompt_logprobs is None
