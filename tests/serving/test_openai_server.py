"""The official `openai` client, unchanged, against a real worker process on a real port."""

from __future__ import annotations

import json
import socket
import time

import httpx
import openai
import pytest

from tandem import SamplingParams

from .helpers import metric, wait_idle

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small"]


@pytest.fixture(scope="module")
def client(worker):
    return openai.OpenAI(base_url=worker.url + "/v1", api_key="unused", max_retries=0)


def _greedy(real_llm, prompt, n=24):
    out = real_llm.generate([prompt], SamplingParams(max_tokens=n, temperature=0.0))[0]
    return out.outputs[0]


def test_models_lists_the_served_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_completions_match_the_offline_engine_exactly(client, real_llm):
    for prompt in PROMPTS:
        resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24,
                                         temperature=0)
        ref = _greedy(real_llm, prompt)
        choice = resp.choices[0]
        assert choice.text == ref.text
        assert choice.finish_reason == ref.finish_reason
        assert resp.usage.completion_tokens == len(ref.token_ids)
        assert resp.usage.prompt_tokens == len(real_llm.get_tokenizer().encode(prompt))


def test_batched_prompts_come_back_in_order(client, real_llm):
    resp = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=12, temperature=0)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert [c.text for c in resp.choices] == [_greedy(real_llm, p, 12).text for p in PROMPTS]


def test_chat_matches_llm_chat(client, real_llm):
    messages = [{"role": "user", "content": "Name three colors."}]
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20,
                                          temperature=0)
    ref = real_llm.chat(messages, SamplingParams(max_tokens=20, temperature=0.0))[0].outputs[0]
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == ref.text
    assert resp.object == "chat.completion"


def test_streaming_is_incremental_and_equals_the_whole(client, real_llm):
    ref = _greedy(real_llm, PROMPTS[2], 48)
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=48,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    pieces, stamps, usage, finish = [], [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.text:
                pieces.append(c.text)
                stamps.append(time.monotonic())
            finish = c.finish_reason or finish
    assert "".join(pieces) == ref.text
    assert finish == "length"
    assert usage is not None and usage.completion_tokens == 48
    # tokens arrived over time, not in one burst at the end
    assert len(pieces) >= 10
    assert stamps[-1] - stamps[0] > 0.1


def test_chat_streaming_sends_role_then_content(client, real_llm):
    messages = [{"role": "user", "content": "Say hello."}]
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16,
                                            temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:])  # role only once
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    ref = real_llm.chat(messages, SamplingParams(max_tokens=16, temperature=0.0))[0]
    assert text == ref.outputs[0].text
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_stop_strings_are_cut(client, real_llm):
    ref = _greedy(real_llm, PROMPTS[1], 24).text
    stop = ref[5:8]  # a string the greedy continuation is known to contain
    resp = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=24,
                                     temperature=0, stop=[stop])
    choice = resp.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.text == ref[: ref.index(stop)]


def test_seed_reproducible_and_n_samples(client):
    kw = dict(model=MODEL, prompt=PROMPTS[2], max_tokens=16, temperature=1.0, seed=1234)
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    assert a == b
    others = {client.completions.create(**{**kw, "seed": s}).choices[0].text for s in range(4)}
    assert len(others) > 1
    resp = client.completions.create(**{**kw, "n": 3}, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in resp.choices) == [0, 1, 2]
    assert resp.usage.completion_tokens == 3 * 16
    assert len({c.text for c in resp.choices}) > 1  # samples differ from each other


def test_logprobs(client):
    resp = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6,
                                     temperature=0, logprobs=3)
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == resp.choices[0].text
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) <= 3 and chosen <= 0.0
        assert max(top.values()) == pytest.approx(chosen)  # greedy picks the top token
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
        temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 for t in content)


def _prompt_logprobs(real_llm, prompt: str | list[int], k: int = 1):
    out = real_llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0,
                                                     prompt_logprobs=k))[0]
    return out.prompt_token_ids, out.prompt_logprobs


def test_echo_only_scores_the_prompt(client, real_llm):
    """lm-evaluation-harness's loglikelihood request: echo, max_tokens 0, logprobs: the
    prompt's tokens with their logprobs (the first has none), nothing generated."""
    prompt = "The quick brown fox jumps over the lazy dog."
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True,
                                     logprobs=1, temperature=0)
    ids, ref = _prompt_logprobs(real_llm, prompt)
    tok = real_llm.get_tokenizer()
    choice = resp.choices[0]
    assert choice.text == prompt and choice.finish_reason == "length"
    lp = choice.logprobs
    assert lp.tokens == [tok.decode([t], skip_special_tokens=False) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx([ref[i][t] for i, t in enumerate(ids)
                                                   if i], abs=1e-4)
    for i in range(1, len(ids)):  # the top-1 entry: greedy's token at that position
        best = max(ref[i].items(), key=lambda kv: kv[1])[0]
        assert list(lp.top_logprobs[i]) == [tok.decode([best], skip_special_tokens=False)]
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (len(ids), 0)


def test_echo_prefixes_the_prompt_to_text_and_logprobs(client, real_llm):
    prompt = PROMPTS[1]
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6,
                                      temperature=0, logprobs=2)
    echoed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6,
                                       temperature=0, logprobs=2, echo=True)
    ids, _ = _prompt_logprobs(real_llm, prompt)
    assert echoed.choices[0].text == prompt + _greedy(real_llm, prompt, 6).text
    assert plain.choices[0].text == _greedy(real_llm, prompt, 6).text
    lp, gen = echoed.choices[0].logprobs, plain.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 6
    assert lp.tokens[len(ids):] == gen.tokens
    assert lp.token_logprobs[len(ids):] == pytest.approx(gen.token_logprobs, abs=1e-4)
    # offsets index the echoed text: the generated part starts where the prompt ends
    assert lp.text_offset[len(ids):] == [o + len(prompt) for o in gen.text_offset]
    assert echoed.usage.completion_tokens == 6
    # token-id prompts echo their decoded text; batches and n > 1 echo per choice
    tok = real_llm.get_tokenizer()
    id_prompt = tok.encode("Roses are red,")
    batch = client.completions.create(model=MODEL, prompt=[PROMPTS[0], PROMPTS[2]],
                                      max_tokens=4, temperature=0, echo=True, n=2)
    assert [c.text for c in batch.choices] == [
        p + _greedy(real_llm, p, 4).text for p in (PROMPTS[0], PROMPTS[0], PROMPTS[2],
                                                   PROMPTS[2])]
    by_ids = client.completions.create(model=MODEL, prompt=id_prompt, max_tokens=4,
                                       temperature=0, echo=True)
    assert by_ids.choices[0].text == tok.decode(id_prompt, skip_special_tokens=False) + \
        _greedy(real_llm, id_prompt, 4).text


@pytest.mark.parametrize("max_tokens", [0, 8])
def test_echo_streams_the_prompt_first(client, real_llm, max_tokens):
    prompt = PROMPTS[0]
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                      temperature=0, echo=True, logprobs=1)
    chunks = list(client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, echo=True,
        logprobs=1, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].text == prompt
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == whole.choices[0].text
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs
              for t in c.choices[0].logprobs.tokens]
    assert tokens == whole.choices[0].logprobs.tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == max_tokens


@pytest.mark.parametrize(("body", "param"), [
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": 0.0}, "top_p"),
    ({"n": 5}, "n"),  # the worker caps n at 4
    ({"logprobs": 21}, "logprobs"),
    ({"prompt": ""}, "prompt"),
    ({"max_tokens": 9000}, "max_tokens"),  # prompt + max_tokens beyond the 8192 window
    ({"max_tokens": "many"}, "max_tokens"),
    ({"seed": 2**64}, "seed"),
])
def test_bad_parameters_get_400_with_the_field(client, body, param):
    kw = {"model": MODEL, "prompt": "hello", "max_tokens": 4, **body}
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(**kw)
    assert err.value.status_code == 400
    error = err.value.body
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param and error["message"]


def test_speculative_is_a_boolean_extension(client, real_llm):
    """`speculative: false` opts a request out (here, on a worker without speculative_config,
    the same greedy text); a value that is not a JSON boolean is a 400 naming it."""
    want = _greedy(real_llm, PROMPTS[1], 8)
    got = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=8,
                                    temperature=0, extra_body={"speculative": False})
    assert got.choices[0].text == want.text
    for bad in ("false", 0):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, max_tokens=2, messages=[
                {"role": "user", "content": "hi"}], extra_body={"speculative": bad})
        assert err.value.body["param"] == "speculative"
        assert err.value.body["type"] == "invalid_request_error"


def test_unsupported_fields_are_refused_and_allow_listed_ones_accepted(client, worker):
    """A field Tandem does not support is a 400 naming it, never ignored; OpenAI's no-effect
    fields (and nulls) are accepted, as the openai client sends them."""
    chat = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    for kw in ({"functions": [tool["function"]]}, {"logit_bias": {"1": 5}},
               {"extra_body": {"guided_whitespace_pattern": " "}}):
        field = next(iter(kw.get("extra_body", kw)))
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(**chat, **kw)
        assert err.value.body == {"message": f"{field} is not supported",
                                  "type": "invalid_request_error", "param": field,
                                  "code": 400}
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, best_of=2)
    assert err.value.body["message"] == "best_of is not supported"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**chat, store=True)
    assert err.value.body["param"] == "store"
    got = client.chat.completions.create(**chat, user="user-1234", store=False, tools=[],
                                         metadata={"team": "search"}, tool_choice=None)
    assert got.choices[0].finish_reason == "length"
    r = httpx.post(worker.url + "/tokenize", json={"prompt": "hi", "tools": [tool]}, timeout=10)
    assert (r.status_code, r.json()["error"]["param"]) == (400, "tools")


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-17", prompt="hi", max_tokens=2)
    assert err.value.body["param"] == "model"


def test_oversized_body_is_413(worker):
    big = "x" * (9 << 20)  # above the 8 MiB default limit
    r = httpx.post(worker.url + "/v1/completions", json={"prompt": big}, timeout=60)
    assert r.status_code == 413
    assert r.json()["error"]["code"] == 413


def test_malformed_json_is_400_not_500(worker):
    r = httpx.post(worker.url + "/v1/completions", content=b"{not json",
                   headers={"Content-Type": "application/json"}, timeout=10)
    assert r.status_code == 400
    assert "error" in r.json()


def test_tokenize_detokenize_round_trip(worker, real_llm):
    text = "Paged attention, continuous batching."
    r = httpx.post(worker.url + "/tokenize", json={"prompt": text}, timeout=10).json()
    assert r["tokens"] == real_llm.get_tokenizer().encode(text)
    back = httpx.post(worker.url + "/detokenize", json={"tokens": r["tokens"]}, timeout=10)
    assert back.json()["prompt"].endswith(text)


def test_metrics_use_vllm_names(client, worker):
    before = metric(worker.url, "vllm:generation_tokens_total")
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=0,
                              extra_body={"ignore_eos": True})
    assert metric(worker.url, "vllm:generation_tokens_total") == before + 5
    text = httpx.get(worker.url + "/metrics", timeout=10).text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                 "vllm:prompt_tokens_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_bucket",
                 "vllm:request_queue_time_seconds_bucket", "vllm:request_success_total"):
        assert f'{name}{{' in text, name
    assert f'model_name="{MODEL}"' in text


def test_disconnected_stream_frees_its_blocks_within_a_second(worker):
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 2000, "temperature": 0,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", worker.url + "/v1/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # one chunk in: the request is running; now hang up
    assert metric(worker.url, "vllm:num_requests_running") <= 1
    wait_idle(worker.url, within=1.0)


def test_disconnected_plain_request_frees_its_blocks_within_a_second(worker):
    body = json.dumps({"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 2000,
                       "temperature": 0, "ignore_eos": True}).encode()
    host, port = worker.url.split("//")[1].split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                 b"application/json\r\nContent-Length: " + str(len(body)).encode()
                 + b"\r\n\r\n" + body)
    deadline = time.monotonic() + 60
    while metric(worker.url, "vllm:num_requests_running") < 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    sock.close()  # hang up before any byte of the answer
    wait_idle(worker.url, within=1.0)


def test_openapi_schema_is_published(worker):
    schema = httpx.get(worker.url + "/openapi.json", timeout=10).json()
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize",
                 "/detokenize", "/health", "/ready", "/metrics"):
        assert path in schema["paths"], path
