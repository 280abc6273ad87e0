"""Request body -> the prompt's token ids and block-hash chain, exactly as a worker sees them.

Uses only the torch-free shared modules: `protocol.tokenizer` (same tokenizer files, same
`encode` / chat-template calls as the worker) and `protocol.block_hash` (same chain, same
model id, adapter weight digest and `cache_salt` keys). For a model the router has no
tokenizer for, `text_hashes` chains fixed-size chunks of the prompt's text instead
(approximate mode).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tandem.protocol.block_hash import (
    BlockHash,
    hash_block_bytes,
    hash_block_chain,
    request_hash_keys,
    root_hash,
    token_bytes,
)
from tandem.protocol.openai_api import ChatCompletionRequest, CompletionRequest
from tandem.protocol.responses_api import as_chat
from tandem.protocol.tokenizer import Tokenizer

TEXT_CHUNK_CHARS = 256  # approximate mode: one pseudo-block per this many characters
SEGMENT_BLOCKS = 32  # blocks per memoized stretch of a hash chain
MAX_TOKEN_ID = 2**32 - 1  # token ids hash as uint32 (`token_bytes`); no vocabulary is larger
MEMO_BYTES = 32 << 20  # token bytes the chain memo keeps (about as much again in hashes)


class ChainMemo:
    """Stretches of hash chains already computed, keyed by (parent hash, the stretch's
    token bytes, block size): a prompt that repeats an earlier prefix (a shared system
    prompt, the next turn of a conversation) hashes only its new blocks. Exact: the key
    holds every input of the stretch's hashes. LRU, bounded by `MEMO_BYTES` of keys."""

    def __init__(self, max_bytes: int = MEMO_BYTES) -> None:
        self.max_bytes, self.bytes = max_bytes, 0
        self._lru: OrderedDict[tuple[bytes, bytes, int], list[BlockHash]] = OrderedDict()

    def chain(self, data: bytes, block_size: int, parent: BlockHash) -> list[BlockHash]:
        """`hash_block_bytes(data, block_size, parent)`, memoized by stretch."""
        step = SEGMENT_BLOCKS * block_size * 4
        whole = len(data) // step * step
        out: list[BlockHash] = []
        lru = self._lru
        for off in range(0, whole, step):
            key = (parent, data[off:off + step], block_size)
            got = lru.get(key)
            if got is None:
                got = lru[key] = hash_block_bytes(key[1], block_size, parent)
                self.bytes += step
                while self.bytes > self.max_bytes and lru:
                    self.bytes -= len(lru.popitem(last=False)[0][1])
            else:
                lru.move_to_end(key)
            out += got
            parent = got[-1]
        out += hash_block_bytes(data[whole:], block_size, parent)
        return out


MEMO = ChainMemo()


@dataclass
class ParsedPrompt:
    """What routing needs from one request body."""

    model: str
    token_ids: list[int] | None  # None when no tokenizer is known for the model
    text: str  # the rendered prompt text (approximate mode); "" for token-id prompts
    cache_salt: str
    stream: bool
    # the worker needs every prompt position's logits (echo with logprobs): it computes the
    # prompt itself, whatever it holds or could import
    prompt_logits: bool = False


@dataclass(frozen=True)
class Rendered:
    """A body validated and rendered as the worker renders it, its text not yet tokenized
    (`parse` is `render`, then `parsed` with the tokenizer's ids)."""

    model: str
    text: str
    ids: list[int] | None  # known without the tokenizer (a token-id prompt), else None
    tokenize: bool  # the text still needs the tokenizer
    add_special_tokens: bool
    cache_salt: str
    stream: bool
    prompt_logits: bool

    def parsed(self, ids: list[int] | None) -> ParsedPrompt:
        return ParsedPrompt(model=self.model, token_ids=ids, text=self.text,
                            cache_salt=self.cache_salt, stream=self.stream,
                            prompt_logits=self.prompt_logits)


def render(kind: str, body: Mapping[str, Any], tokenizer: Tokenizer | None) -> Rendered:
    """`kind` is "completions", "chat" or "responses" (rendered as the chat completion
    that serves it, without the stored conversation of a `previous_response_id`, which the
    router does not have). Raises pydantic.ValidationError / ValueError on a malformed body,
    APIError for a Responses API body (the caller answers 400), as the worker would."""
    if kind == "responses":
        body, kind = as_chat(body), "chat"
    prompt_logits, add_special, ids = False, True, None
    if kind == "chat":
        req = ChatCompletionRequest.model_validate(body)
        messages, extra = req.template_messages(), req.template_kwargs()
        if tokenizer is not None:  # as the worker renders it (serving/routes.py `chat_prompt`)
            text = tokenizer.apply_chat_template(
                messages, add_generation_prompt=req.add_generation_prompt, **extra)
            add_special = False
        else:
            text = json.dumps([messages, extra] if extra else messages, sort_keys=True)
    else:
        req = CompletionRequest.model_validate(body)
        prompt_logits = req.echo and req.logprobs is not None
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a batch goes to one worker; route on its first prompt
        if isinstance(prompt, list):
            text, ids = "", prompt  # validated: a fresh list of ints >= 0 (TokenIds)
            if ids and max(ids) > MAX_TOKEN_ID:  # beyond any vocabulary: nothing to hash;
                ids = None  # the worker refuses it (400, naming its vocabulary's bound)
            tokenizer = None
        else:
            text = prompt or ""
    return Rendered(req.model or "", text, ids, tokenizer is not None, add_special,
                    req.cache_salt or "", bool(req.stream), prompt_logits)


def parse(kind: str, body: Mapping[str, Any], tokenizer: Tokenizer | None) -> ParsedPrompt:
    """The body's prompt (`render`), tokenized as the worker tokenizes it."""
    r = render(kind, body, tokenizer)
    if not r.tokenize:
        return r.parsed(r.ids)
    return r.parsed(tokenizer.encode(r.text, add_special_tokens=r.add_special_tokens))


async def parse_async(kind: str, body: Mapping[str, Any], tokenizer: Tokenizer | None,
                      render_off_loop: bool = False) -> ParsedPrompt:
    """`parse` for an event loop: a long uncached text is tokenized off the loop
    (`Tokenizer.encode_async`: a helper process or a worker thread) while the loop serves
    others; `render_off_loop` (a long body) validates and renders on a worker thread too."""
    r = (await asyncio.to_thread(render, kind, body, tokenizer) if render_off_loop
         else render(kind, body, tokenizer))
    if not r.tokenize:
        return r.parsed(r.ids)
    return r.parsed(await tokenizer.encode_async(r.text,
                                                 add_special_tokens=r.add_special_tokens))


def block_hashes(prompt: ParsedPrompt, model: str, block_size: int,
                 adapter_digest: str = "") -> list[BlockHash]:
    """The worker's hash chain over the prompt's full blocks: `model` is the base model,
    `adapter_digest` the weight digest of the adapter the request names as the worker
    reports it (`Worker.adapter_digest`; "": the base model), as the worker keys them."""
    if prompt.token_ids is None:
        return text_hashes(prompt.text, f"{model}\0lora:{adapter_digest}" if adapter_digest
                           else model, prompt.cache_salt)
    keys = request_hash_keys(model, adapter_digest or None, prompt.cache_salt)
    ids = prompt.token_ids
    if len(ids) < SEGMENT_BLOCKS * block_size or block_size <= 0:
        return hash_block_chain(ids, block_size, keys)
    whole = len(ids) // block_size * block_size
    data = token_bytes(ids if whole == len(ids) else ids[:whole])
    return MEMO.chain(data, block_size, root_hash(keys))


def text_hashes(text: str, model: str, cache_salt: str = "") -> list[BlockHash]:
    """Approximate mode: a SHA-256 chain over full TEXT_CHUNK_CHARS-character chunks."""
    parent = hashlib.sha256(f"tandem-text-v1\0{model}\0{cache_salt}".encode()).digest()
    out = []
    for i in range(len(text) // TEXT_CHUNK_CHARS):
        chunk = text[i * TEXT_CHUNK_CHARS:(i + 1) * TEXT_CHUNK_CHARS].encode()
        parent = hashlib.sha256(parent + chunk).digest()
        out.append(parent)
    return out
