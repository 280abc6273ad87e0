"""The output guardrails' fast paths give what the slow ones give, on seeded random inputs:
a plain-event template reads an event's content exactly as parsing it does (or declines),
a prefilter never clears a text that one of its matchers matches, and a pattern's bytes
twin finds the same spans on ASCII text as the `re2` module's `str` path."""

from __future__ import annotations

import json
import random

from tandem.router.guardrails.detectors import pii_matcher
from tandem.router.guardrails.patterns import (
    BytesSearch,
    PatternMatcher,
    Prefilter,
    _direct_ok,
    compile_pattern,
    pattern_width,
    start_range,
    starts_class,
)
from tandem.router.guardrails.plain import Template, template_of

PIECES = ["a", "b", " ", '"', "\\", "\\\"", '"content":', "},{", '","x":"', "é", "日本",
          "\n", "\u2028", "\x00", "\\u0041", "null", "0"]


def _string(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(PIECES) for _ in range(n))


def _event(rng: random.Random, content: object, ident: str, sep: tuple[str, str],
           ascii_: bool, order: int, role: bool = False) -> tuple[bytes, dict]:
    delta: dict = {"role": "assistant", "content": content} if role else {"content": content}
    fields = [("index", 0), ("delta", delta), ("logprobs", None), ("finish_reason", None)]
    choice = dict(fields[order:] + fields[:order])  # the worker's key order varies
    doc = {"id": ident, "object": "chat.completion.chunk", "created": 7, "model": "m",
           "choices": [choice]}
    raw = b"data: " + json.dumps(doc, separators=sep, ensure_ascii=ascii_).encode()
    return raw, json.loads(raw[6:])


def _mutate(rng: random.Random, raw: bytes) -> bytes:
    """Bytes near a valid event: cut, extended, a byte changed, or a field injected."""
    kind = rng.randrange(4)
    if kind == 0:
        return raw[:rng.randrange(len(raw))]
    if kind == 1:
        return raw + rng.choice([b"}", b" ", b",", b'"'])
    if kind == 2:
        i = rng.randrange(len(raw))
        return raw[:i] + bytes([rng.randrange(32, 127)]) + raw[i + 1:]
    at = raw.find(b'"content":') + len(b'"content":')
    return raw[:at] + b'"x","y":"z' + raw[at + 1:] if at > 9 else raw



def text_of(t: Template, raw: bytes) -> str | None:
    """One event's content through `t` (a run of one), None where `t` does not read it."""
    got = t.run([raw], 0, 1)
    return got[0] if got is not None else None

def test_a_template_reads_exactly_what_parsing_reads() -> None:
    rng = random.Random(20261206)
    built = read = declined = 0
    for trace in range(3000):
        ident = rng.choice(["chatcmpl-1", _string(rng, rng.randrange(0, 6))])
        sep = rng.choice([(",", ":"), (", ", ": ")])
        ascii_, order = rng.random() < 0.5, rng.randrange(4)
        text = _string(rng, rng.randrange(0, 8))
        raw, doc = _event(rng, text, ident, sep, ascii_, order)
        t = template_of(raw, doc, text, (0, "content"))
        if t is None:
            continue
        built += 1
        raws = []
        for _ in range(8):
            other = (_string(rng, rng.randrange(0, 10)) if rng.random() < 0.7
                     else rng.choice([5, None, ["x"], {"a": "b"}]))
            same_shape = rng.random() < 0.7
            raw2, doc2 = _event(rng, other, ident if same_shape else ident + "2", sep,
                                ascii_, order if same_shape else (order + 1) % 4,
                                role=rng.random() < 0.1)
            if rng.random() < 0.3:
                raw2 = _mutate(rng, raw2)
            raws.append(raw2)
            got = text_of(t, raw2)
            if got is None:
                declined += 1
                continue
            read += 1
            parsed = json.loads(raw2[6:])  # what the slow path reads: the same event
            expect = json.loads(json.dumps(doc))
            expect["choices"][0]["delta"]["content"] = got
            assert parsed == expect, (trace, raw, raw2)
        # a run of events read in one loop: the longest readable prefix, texts joined
        run = t.run(raws, 0, len(raws))
        n = 0 if run is None else run[1]
        assert all(text_of(t, r) is not None for r in raws[:n]) and (
            n == len(raws) or text_of(t, raws[n]) is None), trace
        if run is not None:
            assert run[0] == "".join(text_of(t, r) or "" for r in raws[:n])
    assert built > 2000 and read > 5000 and declined > 5000, (built, read, declined)
    # two "content" keys (logprobs carry one): which string is the text is not shown by the
    # bytes alone, so no template
    raw = (b'data: {"choices":[{"index":0,"delta":{"content":"a"},"logprobs":{"content":'
           b'[]},"finish_reason":null}]}')
    assert template_of(raw, json.loads(raw[6:]), "a", (0, "content")) is None


PATTERNS = [r"\b\d{3}-\d{2}-\d{4}\b", r"(?i)ignore (all )?previous instructions", r"^abc",
            r"xyz$", r"(?i)\bzebra\b", r"\bAKIA[0-9A-Z]{4}\b", r"a+b", r"[[:digit:]]{4}",
            r"(?m)^foo", r"é+", r"\pL{3}\d", r"\b-x", r"\B\.y", r"(?m)^#", r"(?i)k",
            r"a*b?c", r"(?:\+[0-9]{1,3}[ .-]?)?(?:\([0-9]{3}\)|\b[0-9]{3})"]
TEXTS = ["abc", "xyz", "zebra", "ZEBRA!", "123-45-6789", "AKIAABCD", "aaab", "2026",
         "a-x", "-x", ".y", "a.y", "#", "\n#", "K", "\u212a", "c", "+1 (555)", "(555)",
         "foo", "\nfoo", "Ignore previous instructions", "ignore all previous instructions",
         "ééé", "abc1", " ", "-", "\n", "x"]


def _matchers(rng: random.Random) -> list[PatternMatcher]:
    out = []
    for p in rng.sample(PATTERNS, rng.randrange(1, 5)):
        out.append(PatternMatcher(compile_pattern(p, "test"), pattern_width(p)))
    if rng.random() < 0.3:
        out.append(pii_matcher(("ssn", "credit_card", "email")))
    return out


def test_a_prefilter_never_clears_a_text_a_matcher_matches() -> None:
    rng = random.Random(77)
    cleared = matched = 0
    for trace in range(3000):
        matchers = _matchers(rng)
        pf = Prefilter.of(matchers)
        assert pf is not None
        text = "".join(rng.choice(TEXTS + [" "] * 6) for _ in range(rng.randrange(0, 12)))
        if rng.random() < 0.2:
            text += "4111 1111 1111 1111 a@b.io"
        pos = rng.randrange(len(text) + 1)
        found = [s for m in matchers for s in m.spans(text, pos)]
        if pf.clear(text, pos):
            cleared += 1
            assert not found, (trace, text, pos)
        elif found:
            matched += 1
    assert cleared > 500 and matched > 500, (cleared, matched)


def test_the_bytes_twin_finds_what_the_str_path_finds() -> None:
    rng = random.Random(5)
    assert _direct_ok()
    for trace in range(3000):
        p = rng.choice(PATTERNS)
        m = PatternMatcher(compile_pattern(p, "test"), pattern_width(p))
        text = "".join(rng.choice(TEXTS) for _ in range(rng.randrange(0, 10)))
        if not text.isascii():
            continue
        pos = rng.randrange(len(text) + 1)
        want = [(x.start(), x.end()) for x in m.compiled.finditer(text, pos) if x.end() > x.start()]
        assert [(s.start, s.end) for s in m.spans(text, pos)] == want, (trace, p, text, pos)
        twin = BytesSearch(m.ascii.compiled)
        public = m.ascii.compiled.search(text.encode(), pos)
        assert twin.search(text.encode(), pos) == (None if public is None else public.span())


def test_a_match_begins_with_a_character_its_start_range_allows() -> None:
    """`start_range` (RE2's PossibleMatchRange behind each kind of left context) never
    leaves out the first character of a match, whatever precedes it."""
    rng = random.Random(11)
    starts = {p: starts_class([start_range(p)]) for p in PATTERNS}
    assert starts[r"\b\d{3}-\d{2}-\d{4}\b"] is not None and starts[r"\b-x"] is not None
    seen = 0
    for trace in range(4000):
        p = rng.choice(PATTERNS)
        m = PatternMatcher(compile_pattern(p, "test"), pattern_width(p))
        text = "".join(rng.choice(TEXTS + [" ", "\n", "q"]) for _ in range(rng.randrange(0, 16)))
        for span in m.spans(text):
            seen += 1
            cls = starts[p]
            assert cls is None or cls.match(text[span.start]), (trace, p, text, span)
    assert seen > 1000
