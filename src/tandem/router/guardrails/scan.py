"""Output guardrails over text that arrives in pieces: `TextScanner` redacts and stops one text
stream (a choice's content, a tool call's arguments) with a bounded look-behind.

A rule looks back at most `hold` characters (its longest match + 1 for `\\b` / `$` context,
or its `look_behind` when the pattern is unbounded), and within that holds back only where
a match may still be in progress (`Matcher.pending_from`): from a character a match may
begin with, followed only by characters a match may contain (each pattern's, from RE2 and
its parse). Text is emitted only once no match of any rule can start in it and end in text
not yet seen. A match that began before that point is final (every character that decides
it has arrived) and is emitted redacted; a match that could still grow stays held. So a
stream is redacted exactly as its whole text would be, whatever its chunking, for every
pattern no longer than its hold (`scan_all` is the whole-text form, used for answers that
are not streamed). A `stop` rule ends the stream at the first character of its first
match: what precedes it is emitted (redacted), nothing after. Prose under an SSN pattern
streams without delay (held from a digit on); under a blocklist, only a prefix of one of
its terms; under `pii`, whose e-mail pattern may span 345 characters, only the word being
written (and from an `@` on, the address).

Scans are batched: a stream is scanned once `SCAN_BATCH` more characters are in than it
held after its last scan, or it holds twice the largest hold (or at its end), so each
character is scanned a few times at most, not once per delta. The output is the same:
nothing is emitted unscanned, and where a batch boundary falls does not change what a scan
finds. Between scans, text before the first character that may begin a match of any rule
(the `Prefilter`'s `starts`) goes at once, unscanned.

`add` holds text without scanning it at all (the output filter, for the events of one burst
but its last: a chunk of many events is scanned once); the next `feed` or `flush` scans it.

Memory per stream is bounded: the held text stays under twice the largest hold plus one
delta, or plus what was `add`ed since the last scan, one upstream read's text at most (plus
matches that chain across the boundary, cut at `MAX_HELD`). A batch the rules' `Prefilter`
clears (no rule can match it) is emitted without running the rules one by one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from tandem.router.guardrails.patterns import Matcher, Prefilter, Span

CONTEXT = 16  # characters of emitted text kept as context (for \b at the boundary)
SCAN_BATCH = 32  # new characters that start the next scan (at most twice the hold)
MAX_HELD = 1 << 16  # characters a stream may hold back at most, however matches chain


@dataclass(frozen=True)
class OutputRule:
    """An output guardrail as a scanner runs it: `action` "redact", "stop" or "flag"."""

    name: str
    action: str
    matcher: Matcher
    replacement: str
    hold: int  # characters held back (module doc)

    def replace(self, span: Span) -> str:
        return self.replacement.replace("{kind}", span.label)


class Hit(NamedTuple):
    """A rule matched (audit: the rule, the span's label, and the text if asked for)."""

    rule: OutputRule
    label: str
    text: str


class TextScanner:
    """One text stream: `feed(delta)` returns what may be emitted now, `flush()` the rest at
    the stream's end; after a stop match, `stopped` is its hit and nothing more is emitted.
    `hits` collects every match emitted (redacted or flagged) or stopped at. `prefilter`
    (the rules' `patterns.Prefilter`, optional): a batch it clears is not scanned rule by
    rule."""

    def __init__(self, rules: list[OutputRule], prefilter: Prefilter | None = None) -> None:
        self.rules = rules
        self.prefilter = prefilter
        self.starts = prefilter.starts if prefilter is not None else None
        self.hold = max((r.hold for r in rules), default=0)
        self.scan_at = min(2 * self.hold, MAX_HELD)  # held characters that start a scan
        self.next_scan = min(SCAN_BATCH, self.scan_at)  # ... or this many, after a scan
        self.context = ""
        self.pending = ""
        self.added: list[str] = []  # `add`ed text, not yet joined to `pending`
        self.stopped: Hit | None = None
        self.hits: list[Hit] = []

    @property
    def held(self) -> bool:
        """Text is held (to be emitted by `feed` or `flush`)."""
        return bool(self.pending or self.added)

    def feed(self, delta: str) -> str:
        if self.stopped is not None:
            return ""
        if self.added:
            self._join()
        self.pending += delta
        held = len(self.pending)
        if self.starts is not None:  # what precedes the first possible start goes at once
            m = self.starts.search(self.pending)
            cut = held if m is None else m.start()
            if cut and (m is None or held < self.next_scan):
                return self._release(cut)
        if held < self.next_scan:  # held until a batch is in (module doc)
            return ""
        return self._emit(final=False)

    def _release(self, cut: int) -> str:
        """Emit `pending[:cut]` unscanned: no span can begin in it (`starts`), and a span
        that began before it was final when that text was emitted."""
        out, self.pending = self.pending[:cut], self.pending[cut:]
        self.context = (self.context + out)[-CONTEXT:]
        self._rearm()
        return out

    def _rearm(self) -> None:
        """The next scan: once `SCAN_BATCH` more characters are in, or twice the hold."""
        self.next_scan = min(len(self.pending) + SCAN_BATCH, self.scan_at)

    def add(self, delta: str) -> None:
        """Held unscanned: what `feed` does below a batch, whatever the held length (the
        caller scans it with its next `feed` or `flush`)."""
        if self.stopped is None:
            self.added.append(delta)  # joined once, when scanned: no copy per delta

    def _join(self) -> None:
        self.pending += "".join(self.added)
        self.added.clear()

    def flush(self) -> str:
        if self.stopped is not None:
            return ""
        if self.added:
            self._join()
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        text = self.context + self.pending
        base, n = len(self.context), len(text)
        found: list[tuple[Span, OutputRule, bool]] = []
        if self.prefilter is None or not self.prefilter.clear(text, base):
            for rule in self.rules:
                for span in rule.matcher.spans(text, base):
                    found.append((span, rule, final or span.start < n - rule.hold))
        if not found:  # the common case: emit all but what is held
            return self._take(text, base, [], self._bound(text, base, n, final))
        found.sort(key=lambda f: (f[0].start, -f[0].end))
        stops = [f for f in found if f[1].action == "stop"]
        if stops:
            span, rule, _ = stops[0]
            self.stopped = Hit(rule, span.label, text[span.start:span.end])
            self.hits.append(self.stopped)
            cut = span.start
            for f in found:  # a redaction crossing the stop point goes with what follows
                if f[0].start < cut < f[0].end and f[1].action == "redact":
                    cut = f[0].start
            return self._take(text, base, [f for f in found if f[0].end <= cut], cut,
                              clip=True)
        bound = self._bound(text, base, n, final)
        for start, end, members in _merge(found):
            if end <= bound:
                continue
            if start >= bound:
                break
            if all(f[2] for f in members):  # final: its end joins the emitted text
                bound = end
            else:
                bound = start
                break
        return self._take(text, base, [f for f in found if f[0].end <= bound], bound)

    def _bound(self, text: str, base: int, n: int, final: bool) -> int:
        """Where emitting may stop, before any match is considered: all of the text at the
        end; else where the first span that text still to come could complete may begin,
        each rule looking back no further than its hold (`Matcher.pending_from`: from the
        last character such a span cannot contain, at a character it may begin with); and
        never more than `MAX_HELD` held (chained matches emit what is final so far)."""
        if final:
            return n
        bound = n
        for r in self.rules:
            bound = min(bound, r.matcher.pending_from(text, max(base, n - r.hold)))
        return max(bound, n - MAX_HELD) if n - base > MAX_HELD else bound

    def _take(self, text: str, base: int, spans: list[tuple[Span, OutputRule, bool]],
              bound: int, clip: bool = False) -> str:
        """Emit `text[base:bound]` with `spans` (all inside it) applied; keep the rest held.
        `clip`: a stop cut the stream at `bound`."""
        out, at = [], base
        for start, end, members in _merge(spans):
            if start < at:
                continue
            redact = [f for f in members if f[1].action == "redact"]
            for span, rule, _ in members:
                self.hits.append(Hit(rule, span.label, text[span.start:span.end]))
            if redact:
                out.append(text[at:start])
                out.append(redact[0][1].replace(redact[0][0]))
                at = end
        out.append(text[at:bound])
        self.context = text[max(0, bound - CONTEXT):bound]
        self.pending = "" if clip else text[bound:]
        self._rearm()
        return "".join(out)


def _merge(found: list[tuple[Span, OutputRule, bool]]
           ) -> list[tuple[int, int, list[tuple[Span, OutputRule, bool]]]]:
    """Overlapping spans (of any rules) merged: (start, end, the spans), by start."""
    merged: list[tuple[int, int, list]] = []
    for f in sorted(found, key=lambda f: (f[0].start, -f[0].end)):
        if merged and f[0].start < merged[-1][1]:
            start, end, members = merged[-1]
            merged[-1] = (start, max(end, f[0].end), [*members, f])
        else:
            merged.append((f[0].start, f[0].end, [f]))
    return merged


def scan_all(rules: list[OutputRule], text: str, prefilter: Prefilter | None = None
             ) -> tuple[str, TextScanner]:
    """`text` as a whole (an answer not streamed): (what the client gets, the scanner, with
    its `hits` and `stopped`)."""
    s = TextScanner(rules, prefilter)
    s.pending = text
    return s.flush(), s
