"""Output guardrails over streamed text, on seeded random traces: whatever the chunking, a
stream is redacted exactly as its whole text (and as an independent reference built on
Python's `re`), no planted secret survives, a stop emits exactly the redacted text before
the first stop match and nothing after, and the text a stream holds back stays bounded."""

from __future__ import annotations

import json
import random
import re

import pytest

from tandem.router.guardrails.config import GuardrailsConfig
from tandem.router.guardrails.guard import Guardrails
from tandem.router.guardrails.output import OutputFilter
from tandem.router.guardrails.scan import TextScanner, scan_all

SSN = r"\b\d{3}-\d{2}-\d{4}\b"
TERMS = ["forbidden fruit", "zebra", "opal"]
WORDS = ["the", "a", "river", "flows", "123", "45", "x", "zebras", "Zebra", "opalescent",
         "forbidden", "fruit", "ok", "-", "7", "\n", "é", "日本"]


def _guard(output: list[dict]) -> Guardrails:
    return Guardrails(GuardrailsConfig.model_validate({"output": output}))


def _rules(guard: Guardrails) -> list:
    return guard.applied(None).rules


REDACTORS = [
    {"name": "ssn", "type": "regex", "pattern": SSN, "action": "redact",
     "replacement": "[ssn]"},
    {"name": "words", "type": "blocklist", "terms": TERMS, "action": "redact",
     "replacement": "[word]"},
]


def _secret(rng: random.Random) -> str:
    return rng.choice([f"{rng.randrange(100, 999)}-{rng.randrange(10, 99)}-"
                       f"{rng.randrange(1000, 9999)}", "zebra", "ZEBRA", "Opal",
                       "forbidden  fruit", "forbidden\nfruit"])


def _text(rng: random.Random, n: int) -> str:
    parts = []
    for _ in range(n):
        parts.append(_secret(rng) if rng.random() < 0.15 else rng.choice(WORDS))
        parts.append(rng.choice([" ", " ", "", ", ", "\n"]))
    return "".join(parts)


def _chunks(rng: random.Random, text: str) -> list[str]:
    out, i = [], 0
    while i < len(text):
        n = rng.choice([1, 1, 2, 3, 5, 8, 13, 40])
        out.append(text[i:i + n])
        i += n
    return out


def _spans(text: str) -> list[list]:
    """Independent whole-text matching with Python's `re`: merged [start, end, replacement]
    (leftmost match of either rule, overlaps merged, the first-starting one's replacement)."""
    spans = [(m.start(), m.end(), "[ssn]") for m in re.finditer(SSN, text, re.ASCII)]
    words = "|".join(r"\b" + r"\s{1,8}".join(map(re.escape, t.split())) + r"\b"
                     for t in sorted(TERMS, key=len, reverse=True))
    spans += [(m.start(), m.end(), "[word]")
              for m in re.finditer(words, text, re.IGNORECASE | re.ASCII)]
    merged: list[list] = []
    for s, e, r in sorted(spans, key=lambda s: (s[0], -s[1])):
        if merged and s < merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e, r])
    return merged


def _reference(text: str, cut: int | None = None) -> str:
    """`text` redacted by `_spans`; with `cut`, only what precedes it (a redaction crossing
    `cut` moves the cut to its start)."""
    merged = _spans(text)
    end = len(text) if cut is None else cut
    for s, e, _ in merged:
        if s < end < e:
            end = s
    out, at = [], 0
    for s, e, r in merged:
        if e <= end:
            out += [text[at:s], r]
            at = e
    return "".join(out) + text[at:end]


@pytest.mark.parametrize("prefiltered", [False, True])
def test_streamed_redaction_equals_whole_text_and_reference_on_random_traces(
        prefiltered: bool) -> None:
    """With the prefilter, text before a character that may begin a match is emitted at
    once, unscanned: the same text must come out."""
    applied = _guard(REDACTORS).applied(None)
    rules, pf = applied.rules, applied.output_prefilter if prefiltered else None
    assert not prefiltered or (pf is not None and pf.starts is not None)
    rng = random.Random(1234 + prefiltered)
    hold = max(r.hold for r in rules)
    for trace in range(2000):
        text = _text(rng, rng.randrange(1, 40))
        whole, _ = scan_all(rules, text, pf)
        assert whole == _reference(text), (trace, text)
        s = TextScanner(rules, pf)
        got, added = [], 0
        for piece in _chunks(rng, text):
            if rng.random() < 0.3:  # held unscanned (a burst's events), scanned later
                s.add(piece)
                added += len(piece)
                continue
            got.append(s.feed(piece))
            assert len(s.pending) < 2 * hold + len(piece) + added, trace  # bounded
            added = 0
        got.append(s.flush())
        assert "".join(got) == whole, (trace, text)


@pytest.mark.parametrize("prefiltered", [False, True])
def test_stop_emits_exactly_the_text_before_the_first_stop_match(prefiltered: bool) -> None:
    applied = _guard([*REDACTORS, {"name": "halt", "type": "regex",
                                   "pattern": "(?i)stop here", "action": "stop"}]).applied(None)
    rules, pf = applied.rules, applied.output_prefilter if prefiltered else None
    rng = random.Random(99 + prefiltered)
    for trace in range(1500):
        text = _text(rng, rng.randrange(0, 20)) + rng.choice(["stop here", "STOP HERE"]) \
            + _text(rng, rng.randrange(0, 10))
        cut = re.search("(?i)stop here", text).start()
        s = TextScanner(rules, pf)
        got = "".join(s.feed(p) for p in _chunks(rng, text)) + s.flush()
        assert s.stopped is not None and s.stopped.rule.name == "halt"
        assert got == _reference(text, cut), (trace, text)
        assert "stop here" not in got.lower()
        assert s.feed("more text") == "" and s.flush() == ""


def _sse(doc: dict) -> bytes:
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


def _split_bytes(rng: random.Random, data: bytes, burst: bool = False) -> list[bytes]:
    """`data` in random pieces: of 1 to 89 bytes, or with `burst` up to 2,000 (several
    events at once, as a worker's burst or a router behind reads them)."""
    out, i = [], 0
    while i < len(data):
        n = rng.randrange(1, 2000 if burst else 90)
        out.append(data[i:i + n])
        i += n
    return out


def _events(raw: bytes) -> list:
    out = []
    for block in raw.split(b"\n\n"):
        for line in block.split(b"\n"):
            if line.startswith(b"data: "):
                payload = line[6:]
                out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return out


@pytest.mark.parametrize("kind,choices,burst", [("chat", 2, False), ("completions", 2, False),
                                                ("chat", 2, True), ("chat", 1, True)])
def test_sse_streams_are_redacted_per_choice(kind: str, choices: int, burst: bool) -> None:
    guard = _guard(REDACTORS)
    rng = random.Random(f"{kind}-{choices}-{burst}")
    for trace in range(300):
        texts = [_text(rng, rng.randrange(1, 25)) for _ in range(choices)]
        pieces = [_chunks(rng, t) for t in texts]
        stream = b""
        order = [i for i in range(choices) for _ in pieces[i]]
        rng.shuffle(order)
        at = [0] * choices
        for i in order:
            piece = pieces[i][at[i]]
            at[i] += 1
            end = at[i] == len(pieces[i])
            if kind == "chat":
                delta = {"role": "assistant", "content": piece} if at[i] == 1 else {
                    "content": piece}
                if end and rng.random() < 0.5:  # the finish in an event of its own
                    stream += _sse({"id": "x", "choices": [
                        {"index": i, "delta": delta, "finish_reason": None}]})
                    delta = {}
                choice = {"index": i, "delta": delta, "finish_reason": "stop" if end else None}
            else:
                choice = {"index": i, "text": piece, "finish_reason": "length" if end else None}
            stream += _sse({"id": "x", "choices": [choice]})
        stream += _sse({"id": "x", "choices": [], "usage": {"total_tokens": 3}}) + \
            b"data: [DONE]\n\n"
        f = guard.output_filter(None, kind)
        assert isinstance(f, OutputFilter)
        out = b"".join(f.feed(c) for c in _split_bytes(rng, stream, burst)) + f.finish()
        events = _events(out)
        assert events[-1] == "[DONE]" and events[-2]["usage"] == {"total_tokens": 3}
        got = [""] * choices
        for e in events[:-2]:
            for c in e["choices"]:
                got[c["index"]] += c["delta"].get("content") or "" if kind == "chat" \
                    else c["text"]
        assert got == [scan_all(_rules(guard), t)[0] for t in texts], trace


def test_tool_call_arguments_and_reasoning_are_scanned_too() -> None:
    guard = _guard(REDACTORS)
    f = guard.output_filter(None, "chat")
    args = '{"ssn": "123-45-6789", "pet": "zebra"}'
    stream = b"".join(_sse({"choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "function": {"arguments": args[i:i + 4]}}]}, "finish_reason": None}]})
        for i in range(0, len(args), 4))
    stream += _sse({"choices": [{"index": 0, "delta": {"reasoning_content": "zeb"},
                                 "finish_reason": None}]})
    stream += _sse({"choices": [{"index": 0, "delta": {"reasoning_content": "ra!"},
                                 "finish_reason": "tool_calls"}]}) + b"data: [DONE]\n\n"
    events = _events(f.feed(stream) + f.finish())
    got_args = "".join(tc["function"]["arguments"] for e in events[:-1]
                       for c in e["choices"] for tc in c["delta"].get("tool_calls") or ())
    reasoning = "".join(c["delta"].get("reasoning_content") or "" for e in events[:-1]
                        for c in e["choices"])
    assert got_args == '{"ssn": "[ssn]", "pet": "[word]"}'
    assert reasoning == "[word]!"
    assert {k: (a.verdict, a.labels, a.match) for k, a in f.acted.items()} == {
        "ssn": ("redact", set(), "123-45-6789"), "words": ("redact", set(), "zebra")}


def test_a_stopped_stream_ends_with_one_error_event_and_done() -> None:
    guard = _guard([{"name": "halt", "type": "blocklist", "terms": ["zebra"],
                     "action": "stop"}])
    f = guard.output_filter(None, "chat")
    text = "one two zeb" + "ra three four five six seven eight"  # a batch past the stop
    stream = b"".join(_sse({"choices": [{"index": 0, "delta": {"content": text[i:i + 3]},
                                         "finish_reason": None}]})
                      for i in range(0, len(text), 3))
    out = f.feed(stream)
    assert f.stopped is not None and f.feed(b"data: [DONE]\n\n") == b"" and f.finish() == b""
    events = _events(out)
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "guardrail" and '"halt"' in events[-2]["error"][
        "message"]
    content = "".join(c["delta"].get("content") or "" for e in events[:-2]
                      for c in e["choices"])
    assert content == "one two "
    assert events[-3]["choices"][0]["finish_reason"] == "content_filter"


def test_responses_api_events_deltas_and_whole_texts() -> None:
    guard = _guard(REDACTORS)
    f = guard.output_filter(None, "responses")
    text = "call 123-45-6789 about the zebra"
    events = [{"type": "response.output_text.delta", "item_id": "m", "content_index": 0,
               "delta": text[i:i + 5]} for i in range(0, len(text), 5)]
    events += [{"type": "response.output_text.done", "item_id": "m", "content_index": 0,
                "text": text},
               {"type": "response.completed", "response": {"output": [
                   {"type": "message", "content": [{"type": "output_text", "text": text}]}]}}]
    raw = b"".join(b"event: " + e["type"].encode() + b"\n" + _sse(e) for e in events)
    out = _events(f.feed(raw) + f.finish())
    deltas = "".join(e["delta"] for e in out if e["type"].endswith(".delta"))
    expect = "call [ssn] about the [word]"
    done = [e for e in out if e["type"] == "response.output_text.done"][0]
    assert done["text"] == expect
    assert deltas == expect  # the held tail goes out in a delta before the done event
    completed = [e for e in out if e["type"] == "response.completed"][0]
    assert completed["response"]["output"][0]["content"][0]["text"] == expect


def test_whole_answers_redact_and_stop() -> None:
    guard = _guard([*REDACTORS, {"name": "halt", "type": "regex", "pattern": "STOP",
                                 "action": "stop"}])
    f = guard.output_filter(None, "completions")
    body = f.body(json.dumps({"choices": [{"index": 0, "text": "a zebra 123-45-6789"}]})
                  .encode())
    assert json.loads(body)["choices"][0]["text"] == "a [word] [ssn]" and f.stopped is None
    f = guard.output_filter(None, "chat")
    f.body(json.dumps({"choices": [{"message": {"content": "fine then STOP"}}]}).encode())
    assert f.stopped is not None and f.stopped.rule.name == "halt"


def test_an_event_too_large_to_read_fails_closed() -> None:
    f = _guard(REDACTORS).output_filter(None, "chat")
    out = f.feed(b"data: " + b"x" * (8 << 20))  # no event end within MAX_EVENT_BYTES
    assert f.cut and not f.tail  # nothing of it relayed, nothing kept
    events = _events(out)
    assert events[-1] == "[DONE]" and events[0]["error"]["code"] == "guardrail"
    assert f.feed(b"\n\ndata: [DONE]\n\n") == b"" and f.finish() == b""


def test_text_that_cannot_begin_a_match_is_not_held() -> None:
    applied = _guard(REDACTORS[:1]).applied(None)  # the SSN pattern: matches begin with a digit
    s = TextScanner(applied.rules, applied.output_prefilter)
    assert s.feed("The river flows ") == "The river flows "  # at once, nothing held
    assert s.feed("past 12") == "past " and s.pending == "12"  # held from the digit on
    assert s.feed("3-45-6789 and on") == "" and s.flush() == "123-45-6789 and on".replace(
        "123-45-6789", "[ssn]")
    s = TextScanner(applied.rules, applied.output_prefilter)
    text = "pin 1234567890 then words, many more words than the hold is long"
    assert s.feed(text) == text and s.pending == ""  # scanned (a batch), nothing to hold


@pytest.mark.parametrize("burst", [False, True])
def test_a_stop_in_the_last_event_ends_the_stream_there(burst: bool) -> None:
    guard = _guard([{"name": "halt", "type": "blocklist", "terms": ["zebra"],
                     "action": "stop"}])
    f = guard.output_filter(None, "chat")
    events = [_sse({"id": "x", "choices": [{"index": 0, "delta": {"content": piece},
                                            "finish_reason": reason}]})
              for piece, reason in (("one two ze", None), ("bra three", "stop"))]
    events.append(b"data: [DONE]\n\n")
    out = (f.feed(b"".join(events)) if burst else b"".join(f.feed(e) for e in events)) \
        + f.finish()
    got = _events(out)
    assert got[-1] == "[DONE]" and got[-2]["error"]["code"] == "guardrail"
    assert "".join(c["delta"].get("content") or "" for e in got[:-2]
                   for c in e["choices"]) == "one two "
    assert got[-3]["choices"][0]["finish_reason"] == "stop" and f.cut


PII_PIECES = ["bob", ".", "smith", "@", "example", ".com", "a@b.io", "x_y+z@mail.example.org",
              "4111 1111 1111 1111", "078-05-1120", "+1 (555) 010-9999", "10.0.0.1", "GB82",
              "WEST", "1234", "5698", "7654", "32", "ok", "-", "é", "日本", "Zebra"]


def _pii_text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(PII_PIECES) + rng.choice([" ", "", "", ", ", "\n"])
                   for _ in range(n))


@pytest.mark.parametrize("prefiltered", [False, True])
def test_pii_streams_equal_their_whole_text_and_hold_little(prefiltered: bool) -> None:
    """`pii` (an e-mail may span 345 characters and begin with almost any) with the other
    redactors: streamed as whole, and text is held only from where a match may still be
    in progress (a word of e-mail characters, a run of digits), not the longest match."""
    applied = _guard([*REDACTORS, {"name": "pii", "type": "pii", "action": "redact",
                                   "replacement": "[{kind}]"}]).applied(None)
    rules, pf = applied.rules, applied.output_prefilter if prefiltered else None
    rng = random.Random(4321 + prefiltered)
    held_most = redacted = 0
    for trace in range(1500):
        text = _pii_text(rng, rng.randrange(1, 60))
        whole, _ = scan_all(rules, text, pf)
        redacted += "[email]" in whole
        s = TextScanner(rules, pf)
        got = []
        for piece in _chunks(rng, text):
            if rng.random() < 0.2:
                s.add(piece)
                continue
            got.append(s.feed(piece))
            held_most = max(held_most, len(s.pending))
        got.append(s.flush())
        assert "".join(got) == whole, (trace, text)
    assert redacted > 700  # the traces do hold e-mail addresses
    assert held_most < 2 * max(r.hold for r in rules) // 4  # far from the longest match
    s = TextScanner(rules, pf)
    prose = "The river flows past the old mill and on to the sea, " * 3
    assert len(s.feed(prose)) > len(prose) - 40  # all but the last batch's words


def test_a_blocklist_holds_only_a_term_in_progress() -> None:
    applied = _guard([REDACTORS[1]]).applied(None)  # "forbidden fruit", "zebra", "opal"
    s = TextScanner(applied.rules, applied.output_prefilter)
    prose = "the river flows past the old mill and on to the sea and then the forbi"
    assert s.feed(prose) == prose[:-len("forbi")] and s.pending == "forbi"
    assert s.feed("dden  fr") == "" and s.pending == "forbidden  fr"  # a phrase in progress
    assert s.feed("uit!") + s.flush() == "[word]!"
    s = TextScanner(applied.rules, applied.output_prefilter)
    text = "some words that are not any term at all, none of them, to the end"
    assert s.feed(text) == text and s.pending == ""  # nothing could still become a term
