"""Grammar backends (xgrammar, llguidance) behind one interface, the compile cache and the
bitmask helpers, on the bundled model's real tokenizer (SmolLM2, 49,152 ids; stop tokens
<|im_end|> = 2 and <|endoftext|> = 0), with the logits 64 ids wider than the tokenizer."""

from __future__ import annotations

import random
import subprocess
import sys
import threading
import time

import pytest
import torch

from tandem.engine.structured import (
    CompileQueueFull,
    GrammarBackend,
    GrammarCompiler,
    allocate_bitmask,
    apply_bitmask,
    available_backends,
    default_backend,
    get_backend,
    register_backend,
)
from tandem.engine.structured.bitmask import unpack_bitmask
from tandem.protocol.structured_outputs import (
    MAX_SCHEMA_CHARS,
    StructuredOutputs,
    StructuredOutputsError,
)
from tandem.protocol.tokenizer import Tokenizer
from tests.structured_schemas import compact, is_valid, random_instance, random_schema

BACKENDS = ("xgrammar", "llguidance")
PAD = 64  # padded logits rows past the tokenizer's vocabulary
S = StructuredOutputs


@pytest.fixture(scope="module")
def tok(bundled_gguf) -> Tokenizer:
    return Tokenizer.from_gguf(bundled_gguf)


@pytest.fixture(scope="module")
def backends(tok) -> dict[str, GrammarBackend]:
    return {name: get_backend(name)(tok, tok.vocab_size + PAD) for name in BACKENDS}


@pytest.fixture(params=BACKENDS)
def backend(request, backends) -> GrammarBackend:
    return backends[request.param]


def allowed(backend: GrammarBackend, matcher) -> torch.Tensor:
    bitmask = allocate_bitmask(2, backend.vocab_size)
    matcher.fill_bitmask(bitmask, 1)
    assert (bitmask[0] == -1).all()  # only the given row is written
    return unpack_bitmask(bitmask[1:], backend.vocab_size)[0]


def ids(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def specials(tok: Tokenizer) -> list[int]:
    return [i for i in tok.all_special_ids if i not in tok.eos_token_ids]


@pytest.mark.parametrize("seed", range(8))
def test_a_valid_instance_walks_through_and_terminates(backend, tok, seed) -> None:
    schema = random_schema(seed)
    value = random_instance(schema, random.Random(seed), plain_bounded=backend.name == "xgrammar")
    assert is_valid(value, schema)
    spec = S.from_json_schema(schema, disable_any_whitespace=seed % 2 == 1)
    matcher = backend.compile(spec).matcher()
    stops, never = list(tok.eos_token_ids), specials(tok)
    for i, token in enumerate(ids(tok, compact(value))):
        mask = allowed(backend, matcher)
        assert mask[token], (i, compact(value))
        assert not mask[tok.vocab_size:].any() and not mask[never].any()
        assert not mask[stops].any() and not matcher.can_terminate()  # the object is open
        assert matcher.accept_tokens([token])
    assert matcher.can_terminate() and not matcher.is_terminated()
    assert allowed(backend, matcher)[stops].all()
    assert matcher.accept_tokens([stops[seed % 2]]) and matcher.is_terminated()
    assert allowed(backend, matcher).nonzero().flatten().tolist() == sorted(stops)
    assert not matcher.accept_tokens(ids(tok, " "))  # nothing after the stop token


@pytest.mark.parametrize("seed", [3, 11])
def test_the_bitmask_is_exactly_what_the_matcher_accepts(backend, tok, seed) -> None:
    schema = random_schema(seed)
    text = compact(random_instance(schema, random.Random(seed), plain_bounded=True))
    matcher = backend.compile(S.from_json_schema(schema)).matcher()
    rng = random.Random(seed)
    tokens = ids(tok, text)
    for step in sorted(rng.sample(range(len(tokens)), 4)):
        assert matcher.accept_tokens(tokens[matcher.num_accepted:step])
        mask = allowed(backend, matcher)
        yes = mask.nonzero().flatten().tolist()
        no = (~mask).nonzero().flatten().tolist()
        for token in rng.sample(yes, min(24, len(yes))) + rng.sample(no, 24):
            before = matcher.num_accepted
            ok = matcher.accept_tokens([token])
            assert ok == bool(mask[token]), (step, token, tok.convert_ids_to_tokens([token]))
            if ok:
                matcher.rollback(1)
            assert matcher.num_accepted == before
        assert torch.equal(allowed(backend, matcher), mask)


def test_rollback_restores_the_state(backend, tok) -> None:
    text = '{"name":"Ada","age":36}'
    schema = {"type": "object", "properties": {"name": {"type": "string"},
              "age": {"type": "integer"}}, "required": ["name", "age"]}
    matcher = backend.compile(S.from_json_schema(schema)).matcher()
    tokens = ids(tok, text)
    assert matcher.accept_tokens(tokens[:3])
    at_three = allowed(backend, matcher)
    assert matcher.accept_tokens([*tokens[3:], tok.eos_token_ids[0]])
    assert matcher.is_terminated() and matcher.num_accepted == len(tokens) + 1
    matcher.rollback(1)  # the stop token: alive again, at the end of the object
    assert not matcher.is_terminated() and matcher.can_terminate()
    matcher.rollback(len(tokens) - 3)
    assert matcher.num_accepted == 3 and torch.equal(allowed(backend, matcher), at_three)
    with pytest.raises(ValueError, match="cannot roll back 4 of 3"):
        matcher.rollback(4)
    assert matcher.accept_tokens([*tokens[3:], tok.eos_token_ids[1]])


def test_validate_tokens_does_not_advance(backend, tok) -> None:
    matcher = backend.compile(S(regex=r"[a-z]+-[0-9]{2}")).matcher()
    good = ids(tok, "pi-31")
    assert matcher.accept_tokens(good[:1])
    before = allowed(backend, matcher)
    assert matcher.validate_tokens([*good[1:], tok.eos_token_ids[0]]) == len(good)
    assert matcher.validate_tokens([*good[1:], *ids(tok, "x")]) == len(good) - 1
    assert matcher.validate_tokens(ids(tok, "!")) == 0
    assert matcher.num_accepted == 1 and torch.equal(allowed(backend, matcher), before)
    assert not matcher.is_terminated()


def test_accept_tokens_is_all_or_nothing(backend, tok) -> None:
    matcher = backend.compile(S(choice=("alpha", "beta"))).matcher()
    assert not matcher.accept_tokens([*ids(tok, "alp"), *ids(tok, "x")])
    assert matcher.num_accepted == 0
    assert not matcher.accept_tokens([*ids(tok, "beta"), tok.eos_token_ids[0], 5])
    assert not matcher.accept_tokens([tok.vocab_size + 3])  # a padded id
    assert not matcher.accept_tokens(specials(tok)[:1])
    assert matcher.num_accepted == 0
    assert matcher.accept_tokens([*ids(tok, "beta"), tok.eos_token_ids[0]])
    assert matcher.is_terminated()


@pytest.mark.parametrize("spec, good, bad, unfinished", [
    (S(choice=("yes", "no", 'say "hi"\n')), 'say "hi"\n', "maybe", "ye"),
    (S(regex=r"\d{3}"), "123", "1234", "12"),
    (S(json_object=True), '{ "a": [1, 2.5, null] }', "[1]", '{"a":'),
    (S(json_object=True, disable_any_whitespace=True), '{"a":[1]}', '{ "a":1}', "{"),
    (S(grammar='root ::= "a" ("," "a")*'), "a,a,a", "a,,a", "a,"),
    (S(grammar='start: "a" ("," "a")*'), "a,a", "aa", "a,"),
    (S(grammar='root ::= item+\nitem ::= [0-9] | "x"'), "12x3", "12y", ""),
], ids=["choice", "regex", "json_object", "compact_object", "gbnf", "lark", "gbnf_classes"])
def test_each_kind_constrains(backend, tok, spec, good, bad, unfinished) -> None:
    compiled = backend.compile(spec)
    m = compiled.matcher()
    assert m.accept_tokens(ids(tok, good)) and m.can_terminate()
    assert m.accept_tokens([tok.eos_token_ids[0]])
    # byte by byte (one token per character): the bad text fails at some token
    chars = [ids(tok, c) for c in bad]
    m = compiled.matcher()
    assert not all(m.accept_tokens(c) for c in chars)
    m = compiled.matcher()
    assert m.accept_tokens(ids(tok, unfinished) if unfinished else [])
    assert not m.can_terminate() and not m.accept_tokens([tok.eos_token_ids[0]])
    assert not allowed(backend, m)[list(tok.eos_token_ids)].any()


def test_listed_properties_are_the_only_ones_unless_the_schema_says(backend, tok) -> None:
    """As xgrammar's strict mode and OpenAI's strict schemas: both backends agree."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"},
              "b": {"type": "object"}}, "required": ["a"]}
    spec = S.from_json_schema(schema)
    for text, ok in (('{"a":1,"z":2}', False), ('{"a":1,"b":{"z":1}}', True), ('{"a":1}', True),
                     ('{"b":{},"a":1}', False)):  # the schema's order, too
        m = backend.compile(spec).matcher()
        assert (m.accept_tokens(ids(tok, text)) and m.can_terminate()) is ok, text
    m = backend.compile(S.from_json_schema({**schema, "additionalProperties": True})).matcher()
    assert m.accept_tokens(ids(tok, '{"a":1,"z":2}')) and m.can_terminate()


@pytest.mark.parametrize("spec, words", [
    (S(regex="[a-"), ["unclosed"]),
    (S(json='{"type":"foo"}'), ["foo"]),
    (S(json='{"type":"object","properties":{"a":{"$ref":"#/$defs/missing"}}}'), ["missing"]),
    (S(grammar="root ::= foo"), ["foo"]),
    (S(grammar="start: foo"), ["foo"]),
    (S(grammar="root ::= \"a"), ["grammar"]),
    (S(json='{"$ref":"http://example.com/s.json"}'), ["not local"]),
    (S(json="[1,2]"), ["must be a JSON object"]),
    (S(regex="a" * 9000), ["regex has 9000 characters"]),
    (S(json='{"description":"' + "x" * MAX_SCHEMA_CHARS + '"}'), ["limit"]),
    (S(regex="a", choice=("a",)), ["exactly one"]),
    (S(), ["exactly one"]),
])
def test_what_cannot_compile_is_a_structured_outputs_error(backend, spec, words) -> None:
    with pytest.raises(StructuredOutputsError) as info:
        backend.compile(spec)
    message = str(info.value).lower()
    assert all(w.lower() in message for w in words), message


def test_apply_bitmask_masks_exactly_the_disallowed_logits() -> None:
    vocab = 70  # not a multiple of 32; the bitmask covers 96 ids
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, vocab, generator=gen)
    before = logits.clone()
    bitmask = allocate_bitmask(2, vocab)
    allow = torch.rand(2, 96, generator=gen) < 0.3
    for r in range(2):
        for word in range(3):
            bits = sum(1 << j for j in range(32) if allow[r, 32 * word + j])
            bitmask[r, word] = bits - (1 << 32) if bits >= 1 << 31 else bits
    apply_bitmask(logits, bitmask, [3, 1])
    for row, r in ((3, 0), (1, 1)):
        expect = torch.where(allow[r, :vocab], before[row], torch.tensor(float("-inf")))
        assert torch.equal(logits[row], expect)
    for row in (0, 2, 4):
        assert torch.equal(logits[row], before[row])
    block = before.clone()  # rows in one contiguous block take the batched path
    apply_bitmask(block, bitmask, [1, 2])
    for row, r in ((1, 0), (2, 1)):
        assert torch.equal(block[row], torch.where(allow[r, :vocab], before[row],
                                                   torch.tensor(float("-inf"))))
    assert torch.equal(block[[0, 3, 4]], before[[0, 3, 4]])
    wide = torch.zeros(1, 100)  # logits wider than the bitmask: the excess ids are masked
    apply_bitmask(wide, allocate_bitmask(1, 64), torch.tensor([0]))
    assert torch.isinf(wide[0, 64:]).all() and (wide[0, :64] == 0).all()
    # the unpacking off the CPU (torch's shifts on the logits' device) agrees with numpy's
    from tandem.engine.structured.bitmask import _unpack

    words = torch.randint(-2**31, 2**31 - 1, (3, 5), dtype=torch.int32, generator=gen)
    for vocab, invert in ((150, False), (150, True), (170, True)):
        assert torch.equal(_unpack(words, vocab, invert, use_numpy=False),
                           _unpack(words, vocab, invert, use_numpy=True))


class Counting(GrammarBackend):
    """A real backend behind a gate: counts compiles, each waits for `gate`."""

    name = "counting"

    def __init__(self, inner: GrammarBackend) -> None:
        self.inner, self.compiles, self.gate = inner, 0, threading.Event()
        self.lock = threading.Lock()

    def compile(self, spec):
        with self.lock:
            self.compiles += 1
        assert self.gate.wait(10)
        return self.inner.compile(spec)


def test_the_compiler_caches_shares_and_never_blocks(backends, tok) -> None:
    gated = Counting(backends[default_backend()])
    compiler = GrammarCompiler(gated, max_workers=2, cache_size=2)
    try:
        spec = S.from_json_schema({"type": "object"})
        t0 = time.perf_counter()
        first = compiler.submit(spec)
        again = compiler.submit(S.from_json_schema('{ "type" : "object" }'))
        assert time.perf_counter() - t0 < 0.5 and not first.done()  # the caller goes on
        assert again is first  # one compile for concurrent submits of one key
        gated.gate.set()
        compiled = first.result(10)
        assert compiler.submit(spec).result() is compiled and compiler.cached(spec) is compiled
        assert compiler.compile_now(spec) is compiled and gated.compiles == 1
        failed = compiler.submit(S(regex="(")).exception(10)
        assert isinstance(failed, StructuredOutputsError)
        assert compiler.submit(S(regex="(")).exception() is failed and gated.compiles == 2
        with pytest.raises(StructuredOutputsError):
            compiler.compile_now(S(regex="("))
        compiler.compile_now(S(regex="a"))  # a third entry: the LRU drops the oldest (spec)
        assert len(compiler) == 2 and compiler.cached(spec) is None
        assert compiler.compile_now(spec) is not compiled and gated.compiles == 4
    finally:
        gated.gate.set()
        compiler.shutdown()


def test_the_compile_queue_is_bounded(backends) -> None:
    gated = Counting(backends[default_backend()])
    compiler = GrammarCompiler(gated, max_workers=1, max_pending=2)
    try:
        futures = [compiler.submit(S(regex=f"a{i}")) for i in range(2)]
        with pytest.raises(CompileQueueFull, match="2 grammars are already compiling"):
            compiler.submit(S(regex="b"))
        assert compiler.submit(S(regex="a1")) is futures[1]  # a pending key still shares
        gated.gate.set()
        assert all(f.result(10) for f in futures)
        assert compiler.submit(S(regex="b")).result(10)
    finally:
        gated.gate.set()
        compiler.shutdown()


def spin_rate(stop: threading.Event | None = None, seconds: float = 0.2) -> float:
    """Iterations per second of a pure-Python loop, until `stop` is set (or for `seconds`)."""
    n, t0 = 0, time.perf_counter()
    while not stop.is_set() if stop else time.perf_counter() - t0 < seconds:
        n += 1
    return n / (time.perf_counter() - t0)


@pytest.mark.parametrize("name", BACKENDS)
def test_compiles_release_the_gil(backends, name) -> None:
    """A Python loop keeps its pace while another thread compiles (a compile that held the
    GIL, as a backtracking `re.match` does, leaves it under 1 %)."""
    backend = backends[name]
    specs = [S.from_json_schema(random_schema(s)) for s in range(40, 56)]
    done = threading.Event()

    def work() -> None:
        for spec in specs:
            backend.compile(spec)
        done.set()

    alone = spin_rate()
    thread = threading.Thread(target=work)
    thread.start()
    during = spin_rate(done)
    thread.join()
    assert during > 0.25 * alone, (during, alone)


def test_the_registry(backends) -> None:
    assert default_backend() == "llguidance"
    assert set(BACKENDS) <= set(available_backends())
    with pytest.raises(ValueError, match="unknown structured outputs backend 'outlines'"):
        get_backend("outlines")
    register_backend("counting", Counting)
    assert get_backend("counting") is Counting and "counting" in available_backends()


@pytest.mark.parametrize("name", BACKENDS)
def test_unusable_tokenizers_are_structured_outputs_errors(tok, name) -> None:
    with pytest.raises(StructuredOutputsError, match="unavailable: the tokenizer has no EOS"):
        get_backend(name)(tok.backend, tok.vocab_size)  # a bare `tokenizers.Tokenizer`
    with pytest.raises(StructuredOutputsError, match="vocab_size 49151 is smaller than its"):
        get_backend(name)(tok, tok.vocab_size - 1)


@pytest.mark.parametrize("name", BACKENDS)
def test_a_tandem_and_an_hf_tokenizer_of_one_vocabulary(tmp_path, name) -> None:
    from transformers import PreTrainedTokenizerFast

    from tests.engine.utils import write_tiny_tokenizer

    write_tiny_tokenizer(tmp_path)
    tandem_tok = Tokenizer.load(tmp_path)
    hf_tok = PreTrainedTokenizerFast.from_pretrained(tmp_path)
    spec = S.from_json_schema({"type": "object", "properties": {"n": {"type": "integer"}},
                               "required": ["n"]})
    text = ids(tandem_tok, '{"n":12}')
    for t, stops in ((tandem_tok, (2, 0)), (hf_tok, (2,))):
        backend = get_backend(name)(t, 512 + 32)
        assert backend.stop_token_ids == stops and backend.tokenizer_vocab_size == 512
        m = backend.compile(spec).matcher()
        assert m.accept_tokens(text) and m.can_terminate()
        assert allowed(backend, m).nonzero().flatten().tolist() == sorted(stops)


def test_a_missing_library_names_the_package(monkeypatch) -> None:
    from tandem.engine.structured import base

    monkeypatch.setattr(base, "_REGISTRY", {})
    monkeypatch.setitem(sys.modules, "xgrammar", None)
    monkeypatch.delitem(sys.modules, "tandem.engine.structured.xgrammar_backend", raising=False)
    with pytest.raises(StructuredOutputsError, match=r"backend 'xgrammar' is not installed "
                       r"\(.*\): pip install 'xgrammar>=0.2.9,<0.3'"):
        get_backend("xgrammar")


def test_the_default_backend_needs_no_test_extra(bundled_gguf) -> None:
    """llguidance works where transformers is absent (a `make serve` venv)."""
    code = ("import sys\nsys.modules['transformers'] = None\n"
            "from tandem.engine.structured import *\n"
            "from tandem.protocol.tokenizer import Tokenizer\n"
            "tok = Tokenizer.from_gguf(sys.argv[1])\n"
            "m = get_backend(default_backend())(tok, tok.vocab_size).compile(\n"
            "    StructuredOutputs(choice=('yes', 'no'))).matcher()\n"
            "assert m.accept_tokens(tok.encode('no', add_special_tokens=False) + [2])\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code, str(bundled_gguf)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and out.stdout == "ok\n", out.stderr


def test_the_package_imports_no_torch_and_no_library() -> None:
    """The engine's configuration (read by the torch-free CLI parsers) names the backends."""
    code = ("import sys, tandem.engine.structured as s\n"
            "assert s.default_backend() in s.available_backends()\n"
            "bad = [m for m in ('torch', 'xgrammar', 'llguidance') if m in sys.modules]\n"
            "assert not bad, bad\n"
            "assert s.allocate_bitmask and 'torch' in sys.modules  # loaded on first use\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
