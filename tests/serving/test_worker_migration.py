"""The worker's side of request migration (`serving.migration.apply`), on real responders:
which streams carry token ids and which may be resumed (one prompt, one choice, no echo,
no parser), and the 400 for a resume of anything else or a malformed one. The router's
signature, which both headers need, is checked before (`tests/router/test_migration.py`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tandem.protocol.migration import RESUME_HEADER, TOKENS_HEADER, Resume
from tandem.protocol.openai_api import ChatCompletionRequest, CompletionRequest
from tandem.protocol.tokenizer import Tokenizer
from tandem.serving import migration
from tandem.serving.api_server import ServerSettings
from tandem.serving.convert import completion_prompts
from tandem.serving.errors import APIError
from tandem.serving.responses import ChatResponder, CompletionResponder
from tests.engine.utils import write_tiny_tokenizer

RESUME = Resume("cmpl-x", 5, 3, [40, 41]).encode()


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    path = tmp_path_factory.mktemp("tok")
    write_tiny_tokenizer(path)
    return Tokenizer.load(str(path))


def completion(tok: Tokenizer, headers: dict, **body) -> CompletionResponder:
    req = CompletionRequest.model_validate({"prompt": "hi", "stream": True, **body})
    r = CompletionResponder(req, tok, ServerSettings(served_model_name="m"), "cmpl-1")
    migration.apply(SimpleNamespace(headers=headers), r, len(completion_prompts(req)))
    return r


@pytest.mark.parametrize(("body", "why"), [
    ({"prompt": ["one", "two"]}, "several prompts"),
    ({"prompt": [[1, 2], [3]]}, "several prompts"),
    ({"n": 2}, "n > 1"), ({"echo": True}, "echoes"), ({"stream": False}, "not streamed"),
])
def test_only_a_single_output_stream_gets_token_ids_or_a_resume(tok, body, why):
    assert not completion(tok, {TOKENS_HEADER: "1"}, **body).return_tokens
    with pytest.raises(APIError) as err:
        completion(tok, {RESUME_HEADER: RESUME, TOKENS_HEADER: "1"}, **body)
    assert err.value.status == 400 and why in err.value.message
    assert err.value.param == RESUME_HEADER


def test_a_single_output_stream_gets_token_ids_and_resumes(tok):
    r = completion(tok, {TOKENS_HEADER: "1"}, prompt=[[1, 2, 3]])  # one tokenized prompt
    assert r.return_tokens and r.resume is None
    r = completion(tok, {RESUME_HEADER: RESUME})
    assert not r.return_tokens and (r.request_id, r.created) == ("cmpl-x", 5)
    assert r.resume is not None and (r.resume.token_ids, r.resume.sent_chars) == ([40, 41], 3)
    req = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "hi"}], "stream": True})
    chat = ChatResponder(req, tok, ServerSettings(served_model_name="m"), "chatcmpl-1")
    migration.apply(SimpleNamespace(headers={TOKENS_HEADER: "1"}), chat)
    assert chat.return_tokens


def test_a_malformed_resume_is_a_400_naming_the_header(tok):
    with pytest.raises(APIError) as err:
        completion(tok, {RESUME_HEADER: "cmpl-x;5;0;!!"})
    assert err.value.status == 400 and err.value.message.startswith(RESUME_HEADER)
