"""Output guardrails over text that arrives in pieces: `TextScanner` redacts and stops one text
stream (a choice's content, a tool call's arguments) with a bounded look-behind.

Each rule holds back `hold` characters (its longest match + 1 for `\\b` / `$` context, or its
`look_behind` when the pattern is unbounded): text is emitted only once no match of any rule
can still start in it and end in text not yet seen. A match that began before that point is
final (every character that decides it has arrived) and is emitted redacted; a match that
could still grow stays held. So a stream is redacted exactly as its whole text would be,
whatever its chunking, for every pattern no longer than its hold (`scan_all` is the whole-text
form, used for answers that are not streamed). A `stop` rule ends the stream at the first
character of its first match: what precedes it is emitted (redacted), nothing after.

Scans are batched: a stream is scanned once it holds twice the largest hold (or at its end),
so each character is scanned about twice, not once per delta (a stream of 4-character deltas
would otherwise re-scan the whole held text on every delta). The output is the same: nothing
is emitted unscanned, and where a batch boundary falls does not change what a scan finds.

Memory per stream is bounded: the held text stays under twice the largest hold plus one
delta (plus matches that chain across the boundary, cut at `MAX_HELD`).
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.router.guardrails.patterns import Matcher, Span

CONTEXT = 16  # characters of emitted text kept as context (for \b at the boundary)
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


@dataclass(frozen=True)
class Hit:
    """A rule matched (audit: the rule, the span's label, and the text if asked for)."""

    rule: OutputRule
    label: str
    text: str


class TextScanner:
    """One text stream: `feed(delta)` returns what may be emitted now, `flush()` the rest at
    the stream's end; after a stop match, `stopped` is its hit and nothing more is emitted.
    `hits` collects every match emitted (redacted or flagged) or stopped at."""

    def __init__(self, rules: list[OutputRule]) -> None:
        self.rules = rules
        self.hold = max((r.hold for r in rules), default=0)
        self.scan_at = min(2 * self.hold, MAX_HELD)  # held characters that start a scan
        self.context = ""
        self.pending = ""
        self.stopped: Hit | None = None
        self.hits: list[Hit] = []

    def feed(self, delta: str) -> str:
        if self.stopped is not None:
            return ""
        self.pending += delta
        if len(self.pending) < self.scan_at:  # held until a batch is in (module doc)
            return ""
        return self._emit(final=False)

    def flush(self) -> str:
        if self.stopped is not None:
            return ""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        text = self.context + self.pending
        base, n = len(self.context), len(text)
        found: list[tuple[Span, OutputRule, bool]] = []
        for rule in self.rules:
            for span in rule.matcher.spans(text, base):
                found.append((span, rule, final or span.start < n - rule.hold))
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
        bound = n if final else max(base, n - self.hold)
        if not final and n - base > MAX_HELD:  # chained matches: emit what is final so far
            bound = max(bound, n - MAX_HELD)
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


def scan_all(rules: list[OutputRule], text: str) -> tuple[str, TextScanner]:
    """`text` as a whole (an answer not streamed): (what the client gets, the scanner, with
    its `hits` and `stopped`)."""
    s = TextScanner(rules)
    s.pending = text
    return s.flush(), s
