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
unbounded), which sets how much of a stream the output layer holds back (`scan`).
"""

from __future__ import annotations

import functools
import re
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

try:  # the linear-time engine; `re` with a static backtracking check where it is missing
    import re2 as _re2
except ImportError:  # pragma: no cover - google-re2 has wheels for every supported platform
    _re2 = None

ENGINE = "re2" if _re2 is not None else "re"
MAX_PATTERN_CHARS = 4096
UNBOUNDED = None


class PatternError(ValueError):
    """A pattern that cannot be compiled, or that could backtrack (`re` only)."""


@dataclass(frozen=True)
class Span:
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


def pattern_width(pattern: str) -> int | None:
    """The most characters one match of `pattern` can span (None: unbounded, or a syntax
    Python's parser does not read, such as RE2's POSIX classes); one more character of
    context is held for `\\b` and `$`."""
    try:
        from re import _parser  # the stdlib's own parser: the widths `re` computes
    except ImportError:  # pragma: no cover - Python < 3.11
        import sre_parse as _parser  # type: ignore[no-redef]
    try:
        with warnings.catch_warnings():  # RE2-only syntax (`[[:alpha:]]`) warns in `re`
            warnings.simplefilter("ignore")
            lo, hi = _parser.parse(pattern).getwidth()
    except Exception:
        return UNBOUNDED
    return None if hi >= 1 << 16 else int(hi)


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


class Matcher:
    """Spans of a text (`spans`), each labelled; `width` bounds a span (None: unbounded)."""

    width: int | None = UNBOUNDED

    def spans(self, text: str, pos: int = 0) -> Iterator[Span]:
        """Non-overlapping spans of `text` from `pos` on (characters before `pos` are context
        for `\\b` and `^` only), leftmost first."""
        raise NotImplementedError


class PatternMatcher(Matcher):
    """One compiled pattern; `accept` (optional) keeps only the matches it approves (a
    checksum, such as a card number's Luhn digit)."""

    def __init__(self, compiled: Any, width: int | None, label: str = "",
                 accept: Callable[[str], bool] | None = None) -> None:
        self.compiled, self.width, self.label, self.accept = compiled, width, label, accept

    def spans(self, text: str, pos: int = 0) -> Iterator[Span]:
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


class AnyOf(Matcher):
    """The union of several matchers (PII kinds): spans sorted, overlaps merged."""

    def __init__(self, parts: list[Matcher]) -> None:
        self.parts = parts
        widths = [p.width for p in parts]
        self.width = None if any(w is None for w in widths) else max(widths, default=0)

    def spans(self, text: str, pos: int = 0) -> Iterator[Span]:
        found = sorted((s for p in self.parts for s in p.spans(text, pos)),
                       key=lambda s: (s.start, -s.end))
        end = -1
        for s in found:
            if s.start >= end:
                end = s.end
                yield s
