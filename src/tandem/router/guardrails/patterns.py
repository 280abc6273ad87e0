"""Regular expressions for guardrails: compiled once, at start-up, by a linear-time engine.

Patterns are RE2 syntax, compiled by `google-re2` (`re2`): matching time is linear in the
text, whatever the pattern, so no pattern or prompt can make a guardrail backtrack for
seconds. RE2 refuses what it cannot run in linear time (backreferences, look-around): such
a pattern is a configuration error naming the guardrail. Where `re2` cannot be imported,
Python's `re` runs them instead, and a pattern whose repeats nest (`(a+)+`, `(\\w*\\s?)*`,
the shape of catastrophic backtracking) or that uses backreferences or look-around is
refused at start-up.

`Matcher` is what every text guardrail type builds (`regex`, `blocklist`, `pii`): spans of a
text, each with the name of what matched, and `width`, the longest span it can match (None:
unbounded), which bounds how much of a stream the output layer holds back (`scan`); and
`pending_from`, where in a stream's tail a match may still be in progress: a pattern's
possible first characters come from RE2 (`start_range`), the characters a match may
contain from its parse tree (`pattern_alphabet`; where Python's parser reads a pattern
otherwise than RE2, nothing is assumed).

Two things keep the common case cheap. A `Prefilter` runs the patterns of several matchers
as one RE2 alternation, one pass over a text: a text it clears has no span of any of them
(every span is a match of one of their patterns), so a request or answer that trips no
guardrail is read once, not once per guardrail. And on ASCII text (most of it) each pattern
runs as its UTF-8 bytes twin, where byte offsets are character offsets: the same matches,
without the `re2` module's offset mapping for `str`.
"""

from __future__ import annotations

import functools
import re
import string
import warnings
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

try:  # the linear-time engine; `re` with a static backtracking check where it is missing
    import re2 as _re2
except ImportError:  # pragma: no cover - google-re2 has wheels for every supported platform
    _re2 = None

ENGINE = "re2" if _re2 is not None else "re"
MAX_PATTERN_CHARS = 4096
UNBOUNDED = None


class PatternError(ValueError):
    """A pattern that cannot be compiled, or that could backtrack (`re` only)."""


class Span(NamedTuple):  # a tuple: made for every match, ~3x cheaper than a dataclass
    """`text[start:end]` matched `label` (a PII kind, a blocklist term, the pattern)."""

    start: int
    end: int
    label: str = ""


@functools.lru_cache(maxsize=256)
def compile_pattern(pattern: str, where: str, max_chars: int | None = MAX_PATTERN_CHARS
                    ) -> Any:
    """`pattern` compiled by RE2 (or checked and compiled by `re`); `PatternError` naming
    `where` (the guardrail) when it is invalid or unsafe. `max_chars` None: a pattern made
    from bounded parts (a blocklist's terms). Memoized: router.yaml's check and the router's
    build compile each pattern once (compiled patterns are immutable)."""
    if not pattern or (max_chars is not None and len(pattern) > max_chars):
        raise PatternError(f"{where}: a pattern of 1 to {MAX_PATTERN_CHARS} characters")
    if _re2 is not None:
        try:
            return _re2.compile(pattern)
        except Exception as exc:  # re2.error: the message says what RE2 does not support
            raise PatternError(f"{where}: RE2 cannot compile {pattern!r} ({exc}); guardrail "
                               "patterns run in linear time, so backreferences and "
                               "look-around are not available") from None
    _check_backtracking(pattern, where)
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise PatternError(f"{where}: invalid pattern {pattern!r} ({exc})") from None


def _python_parse(pattern: str) -> Any:
    """`pattern` as the stdlib's parser reads it, where RE2 reads it the same way; None for
    what RE2 reads otherwise: syntax Python refuses or warns about (RE2's POSIX classes,
    `\\pL`, `\\C`) and `{,n}` (a repeat in Python, literal text in RE2)."""
    try:
        from re import _parser  # the stdlib's own parser
    except ImportError:  # pragma: no cover - Python < 3.11
        import sre_parse as _parser  # type: ignore[no-redef]
    if "{," in pattern:
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            return _parser.parse(pattern)
    except Exception:  # re.error, or a warning (RE2-only syntax such as `[[:alpha:]]`)
        return None


def pattern_width(pattern: str) -> int | None:
    """The most characters one match of `pattern` can span (None: unbounded, or a syntax
    Python's parser does not read as RE2 does, `_python_parse`); one more character of
    context is held for `\\b` and `$`."""
    parsed = _python_parse(pattern)
    if parsed is None:
        return UNBOUNDED
    hi = parsed.getwidth()[1]
    return None if hi >= 1 << 16 else int(hi)


def pattern_alphabet(pattern: str) -> frozenset[int] | None:
    """The ASCII characters (code points) a match of `pattern` can contain: from its parse
    tree (`_python_parse`), case-folded under `(?i)`; None when any may (`.`, a negated
    class, a category RE2 reads wider) or it cannot be read. Non-ASCII characters are never
    ruled out (their case folding and classes are RE2's to decide)."""
    from re import _constants as c

    parsed = _python_parse(pattern)
    if parsed is None:
        return None
    cats = {c.CATEGORY_DIGIT: "0123456789",
            c.CATEGORY_WORD: string.ascii_letters + string.digits + "_",
            c.CATEGORY_SPACE: " \t\n\v\f\r"}
    out: set[int] = set()

    def add(codes: set[int], fold: bool) -> None:
        for code in codes:
            if code < 128:
                out.add(code)
                if fold:
                    out.add(ord(chr(code).swapcase()))

    def walk(items: Any, fold: bool) -> bool:
        for op, av in items:
            if op is c.LITERAL:
                add({av}, fold)
            elif op is c.IN:
                for kind, v in av:
                    if kind is c.LITERAL:
                        add({v}, fold)
                    elif kind is c.RANGE:
                        add(set(range(v[0], min(v[1], 127) + 1)), fold)
                    elif kind is c.CATEGORY and v in cats:
                        add({ord(x) for x in cats[v]}, fold)
                    else:  # a negation, a negated category
                        return False
            elif op is c.BRANCH:
                if not all(walk(b, fold) for b in av[1]):
                    return False
            elif op is c.SUBPATTERN:
                _, on, off, body = av
                inner = (fold or bool(on & c.SRE_FLAG_IGNORECASE)) and not (
                    off & c.SRE_FLAG_IGNORECASE)
                if not walk(body, inner):
                    return False
            elif op in (c.MAX_REPEAT, c.MIN_REPEAT):
                if not walk(av[2], fold):
                    return False
            elif op is not c.AT:  # `.`, a negated literal, anything else: any character
                return False
        return True

    fold = bool(parsed.state.flags & c.SRE_FLAG_IGNORECASE)
    return frozenset(out) if walk(parsed, fold) else None


def _check_backtracking(pattern: str, where: str) -> None:
    """`PatternError` when a repeat holds another repeat of more than one (the shape of
    catastrophic backtracking), or the pattern uses backreferences or look-around."""
    from re import _constants as c
    from re import _parser

    try:
        parsed = _parser.parse(pattern)
    except re.error as exc:
        raise PatternError(f"{where}: invalid pattern {pattern!r} ({exc})") from None

    def walk(items: Any, in_repeat: bool) -> None:
        for op, av in items:
            if op in (c.GROUPREF, c.GROUPREF_EXISTS, c.ASSERT, c.ASSERT_NOT):
                raise PatternError(f"{where}: backreferences and look-around are not allowed")
            if op in (c.MAX_REPEAT, c.MIN_REPEAT, getattr(c, "POSSESSIVE_REPEAT", None)):
                lo, hi, body = av
                if hi > 1 and in_repeat:
                    raise PatternError(f"{where}: nested repeats in {pattern!r} can "
                                       "backtrack for exponential time")
                walk(body, in_repeat or hi > 1)
            elif op == c.SUBPATTERN:
                walk(av[-1], in_repeat)
            elif op == c.BRANCH:
                for branch in av[1]:
                    walk(branch, in_repeat)
            elif op == getattr(c, "ATOMIC_GROUP", None):
                walk(av, in_repeat)

    walk(parsed, False)


class BytesSearch:
    """A pattern over UTF-8 bytes: `search(data, pos)`, the leftmost match starting at `pos`
    or after, as (start, end) byte offsets, or None. It calls RE2's matcher directly where
    the `re2` module exposes it (`_regexp.Match`, checked against the public `search` once
    per process): the public path builds a generator and a match object per call, several
    times the cost of the match itself on short texts."""

    def __init__(self, compiled: Any) -> None:
        self.compiled = compiled
        raw = getattr(compiled, "_regexp", None)
        self.raw = raw if raw is not None and _direct_ok() else None

    def search(self, data: bytes, pos: int = 0) -> tuple[int, int] | None:
        if self.raw is not None:
            span = self.raw.Match(_UNANCHORED, data, pos, len(data))[0]
            return None if span[0] < 0 else span
        m = self.compiled.search(data, pos)
        return None if m is None else m.span()


_UNANCHORED = _re2._Anchor.UNANCHORED if _re2 is not None else None


@functools.cache
def _direct_ok() -> bool:
    """RE2's matcher called directly agrees with the module's public `search` (both the
    private names exist and give the same spans on a few probes)."""
    try:
        rx = _re2.compile(rb"(?i)\bab+c\b|x*")
        for data, pos in ((b"zz ABBC abc", 0), (b"zz ABBC abc", 4), (b"", 0), (b"qq", 1)):
            m = rx.search(data, pos)
            want = None if m is None else m.span()
            span = tuple(rx._regexp.Match(_UNANCHORED, data, pos, len(data))[0])
            if (None if span[0] < 0 else span) != want:
                return False
        return True
    except Exception:  # a future re2 module without these names: the public path
        return False


def _bytes_twin(compiled: Any) -> BytesSearch | None:
    """`compiled`'s pattern compiled again over UTF-8 bytes (same options, same matches); None
    without RE2 or where it will not compile."""
    if _re2 is None:
        return None
    try:
        return BytesSearch(_re2.compile(compiled.pattern.encode()))
    except Exception:  # re2.error
        return None


class TextSearch:
    """A compiled RE2 pattern over `str`: `first(text, pos)`, where its leftmost match from
    `pos` on begins (None: none), through its bytes twin on ASCII text (module doc)."""

    def __init__(self, compiled: Any, ascii: BytesSearch) -> None:
        self.compiled, self.ascii = compiled, ascii

    @classmethod
    def of(cls, pattern: str) -> TextSearch | None:
        """None without RE2, or for a pattern over RE2's memory bound."""
        if _re2 is None:
            return None
        try:
            compiled = _re2.compile(pattern)
        except Exception:  # re2.error
            return None
        ascii = _bytes_twin(compiled)
        return cls(compiled, ascii) if ascii is not None else None

    def first(self, text: str, pos: int = 0) -> int | None:
        if text.isascii():  # O(1) for str
            span = self.ascii.search(text.encode(), pos)
            return None if span is None else span[0]
        m = self.compiled.search(text, pos)
        return None if m is None else m.start()


class Matcher:
    """Spans of a text (`spans`), each labelled; `width` bounds a span (None: unbounded)."""

    width: int | None = UNBOUNDED

    def spans(self, text: str, pos: int = 0) -> Iterator[Span]:
        """Non-overlapping spans of `text` from `pos` on (characters before `pos` are context
        for `\\b` and `^` only), leftmost first."""
        raise NotImplementedError

    def patterns(self) -> list[str] | None:
        """RE2 patterns one of which matches wherever a span is (what a `Prefilter` runs);
        None: not known (a matcher that is not pattern-based)."""
        return None

    def pending_from(self, text: str, lo: int) -> int:
        """The first position from `lo` on where a span may begin that text still to come
        could complete (`len(text)`: none): a stream holds its text back from there. The
        default: `lo`, anywhere may."""
        return lo


class PatternMatcher(Matcher):
    """One compiled pattern; `accept` (optional) keeps only the matches it approves (a
    checksum, such as a card number's Luhn digit)."""

    def __init__(self, compiled: Any, width: int | None, label: str = "",
                 accept: Callable[[str], bool] | None = None,
                 pending: TextSearch | None = None) -> None:
        """`pending` (optional): an RE2 pattern matching, at the end of a text (`\\z`), every
        prefix of a match, and nothing that starts where no match may: where a match in
        progress begins, exactly (`pending_from`)."""
        self.compiled, self.width, self.label, self.accept = compiled, width, label, accept
        self.ascii = _bytes_twin(compiled)  # for ASCII text (module doc)
        self.pending = pending

    def patterns(self) -> list[str] | None:
        return [self.compiled.pattern] if self.ascii is not None else None

    @functools.cached_property
    def _viable(self) -> tuple[re.Pattern[str] | None, re.Pattern[str] | None]:
        """(the characters a span may begin with, the last character a span cannot
        contain, followed by only ones it can): `pending_from`'s two searches; None parts
        where any character may."""
        if self.ascii is None:
            return None, None
        pattern = self.compiled.pattern
        first = start_range(pattern)
        starts = starts_class([first]) if first is not None else None
        alphabet = pattern_alphabet(pattern)
        tail = None
        if alphabet is not None:
            cls = "".join(f"\\x{b:02x}" for b in sorted(alphabet)) + "\\x80-\\U0010ffff"
            tail = re.compile(f"[^{cls}][{cls}]*\\Z")  # linear: the runs it tries are disjoint
        return starts, tail

    def pending_from(self, text: str, lo: int) -> int:
        """A span still to be completed begins with a character it may begin with, and
        holds only characters it may contain: so not before the last one it cannot. With
        `pending`, exactly: the leftmost prefix of a match that ends the text."""
        if self.pending is not None:
            at = self.pending.first(text, lo)
            return len(text) if at is None else at
        starts, tail = self._viable
        if tail is not None:
            m = tail.search(text, lo)
            if m is not None:
                lo = m.start() + 1
        if starts is not None:
            m = starts.search(text, lo)
            return len(text) if m is None else m.start()
        return lo

    def spans(self, text: str, pos: int = 0) -> Iterator[Span]:
        if self.ascii is not None and text.isascii():  # isascii: O(1) for str
            yield from self._ascii_spans(text, pos)
            return
        if self.accept is None:
            for m in self.compiled.finditer(text, pos):
                start, end = m.span()
                if end > start:
                    yield Span(start, end, self.label)
            return
        # a candidate that fails its checksum may hide a valid one starting inside it (a
        # number written after another): search again from its next character
        while (m := self.compiled.search(text, pos)) is not None:
            start, end = m.span()
            if end > start and self.accept(text[start:end]):
                yield Span(start, end, self.label)
                pos = end
            else:
                pos = start + 1

    def _ascii_spans(self, text: str, pos: int) -> Iterator[Span]:
        """`spans` of an ASCII text, through its bytes (byte offsets are character offsets):
        leftmost matches, non-overlapping; an empty match or one its checksum refuses moves
        the search on by one character."""
        assert self.ascii is not None
        search, data, n = self.ascii.search, text.encode(), len(text)
        while pos <= n and (span := search(data, pos)) is not None:
            start, end = span
            if end > start and (self.accept is None or self.accept(text[start:end])):
                yield Span(start, end, self.label)
                pos = end
            else:
                pos = start + 1


class AnyOf(Matcher):
    """The union of several matchers (PII kinds): spans sorted, overlaps merged."""

    def __init__(self, parts: list[Matcher]) -> None:
        self.parts = parts
        widths = [p.width for p in parts]
        self.width = None if any(w is None for w in widths) else max(widths, default=0)

    def patterns(self) -> list[str] | None:
        out: list[str] = []
        for p in self.parts:
            got = p.patterns()
            if got is None:
                return None
            out += got
        return out

    def pending_from(self, text: str, lo: int) -> int:
        """The earliest of the parts', each from its own hold (its width + 1: a span of
        it that began before that has ended)."""
        n = len(text)
        return min((p.pending_from(text, lo if p.width is None else max(lo, n - p.width - 1))
                    for p in self.parts), default=n)

    def spans(self, text: str, pos: int = 0) -> Iterator[Span]:
        found = sorted((s for p in self.parts for s in p.spans(text, pos)),
                       key=lambda s: (s.start, -s.end))
        end = -1
        for s in found:
            if s.start >= end:
                end = s.end
                yield s


# left contexts that decide RE2's empty-width assertions at a match's start (\b, \B, ^, \A):
# the start of the text, a word character, a space, a newline
CONTEXTS = ("", "a", " ", "\n")


@functools.lru_cache(maxsize=1024)
def start_range(pattern: str) -> tuple[int, int] | None:
    """(lo, hi): the first byte of any non-empty match of `pattern`, whatever precedes it,
    lies in [lo, hi] (UTF-8; hi >= 0x80: non-ASCII characters too); () as a range that holds
    none: it has no non-empty match. From RE2's `PossibleMatchRange` over the pattern behind
    each kind of left context (`CONTEXTS`); None where RE2 cannot bound it. Memoized: a
    scanner's prefilter and each of its patterns ask for the same ranges."""
    lo, hi = 0x100, -1
    for ctx in CONTEXTS:
        head = ctx.encode()
        try:  # the binding's method, beside `Match` (`BytesSearch`)
            rx = _re2.compile(_re2_escape(ctx) + "(?:" + pattern + ")")
            ok, low, high = rx._regexp.PossibleMatchRange(len(head) + 8)
        except Exception:
            return None
        if not ok:
            return None
        k = len(head)
        if high[:k] == head and len(high) == k or high < head:
            continue  # no non-empty match after this context
        lo = min(lo, low[k] if low[:k] == head and len(low) > k else 0)
        hi = max(hi, high[k] if high[:k] == head and len(high) > k else 0xFF)
    return (lo, hi) if hi >= 0 else (0x100, -1)


def _re2_escape(text: str) -> str:
    return "".join(f"\\x{{{ord(c):x}}}" for c in text)


def starts_class(ranges: list[tuple[int, int]]) -> re.Pattern[str] | None:
    """A pattern finding the characters a match may begin with: the ASCII ones in `ranges`
    (`start_range`'s), and every non-ASCII character; None when that is every character."""
    ascii = [False] * 128
    for lo, hi in ranges:
        for b in range(max(lo, 0), min(hi, 127) + 1):
            ascii[b] = True
    if all(ascii):
        return None
    parts = [f"\\x{b:02x}" for b in range(128) if ascii[b]]
    return re.compile("[" + "".join(parts) + "\\x80-\\U0010ffff]")


class Prefilter:
    """Whether any of several matchers may have a span in a text, in one pass (module doc):
    their patterns as one RE2 alternation, each in a group of its own (its inline flags stay
    its own). `clear(text)` True: none of them has a span there. `starts` (None: any
    character may): finds the characters a span may begin with, from each pattern's
    `start_range`; text before the first of them cannot hold the start of a span (`scan`
    emits it at once). Computed when first asked for: only the output layer does."""

    def __init__(self, union: TextSearch, parts: list[str]) -> None:
        self.union, self.parts = union, parts

    @classmethod
    def of(cls, matchers: list[Matcher]) -> Prefilter | None:
        """None: nothing to gain (no matcher, no RE2, a matcher that is not pattern-based, or
        an alternation over RE2's memory bound); then every matcher runs."""
        parts = AnyOf(matchers).patterns() if matchers else None
        if not parts:
            return None
        union = TextSearch.of("|".join(f"(?:{p})" for p in parts))
        return cls(union, parts) if union is not None else None

    @functools.cached_property
    def starts(self) -> re.Pattern[str] | None:
        ranges = []
        for p in self.parts:
            r = start_range(p)
            if r is None:  # RE2 cannot bound it: any character may begin a span
                return None
            ranges.append(r)
        return starts_class(ranges)

    def clear(self, text: str, pos: int = 0) -> bool:
        """No match of any pattern starts at `pos` or after (before it: context only)."""
        return self.union.first(text, pos) is None
