"""The guardrail interface (`Guardrail`), its registry (`TYPES`, `register`) and the built-in
types: `regex`, `blocklist`, `pii` (text matchers, input and output), `injection`, `limits`
(input) and `classifier` (input, `classifier.Classifier`).

An input guardrail's `check` reads a request's texts and returns a `Finding` when it acts
(None: it passes): `refuse` (the request is answered 400 and goes nowhere), `redact` (the
matched text is replaced in the body, which is then routed) or `flag` (audit only). An
output guardrail is a text matcher: `rule()` is what `scan.TextScanner` runs on the answer.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tandem.router.guardrails.config import Entry
from tandem.router.guardrails.detectors import PII, injection_score, pii_matcher
from tandem.router.guardrails.patterns import (
    Matcher,
    PatternMatcher,
    TextSearch,
    compile_pattern,
    pattern_width,
)
from tandem.router.guardrails.scan import OutputRule
from tandem.router.guardrails.texts import RequestTexts

DEFAULT_LOOK_BEHIND = 256  # characters held back for an unbounded output pattern
MAX_PHRASE_GAP = 8  # whitespace characters between the words of a blocklist phrase


@dataclass(frozen=True)
class Finding:
    """One guardrail's decision on one request: `layer` "input", "output" or "policy";
    `verdict` "refuse", "redact", "stop", "flag" or "error" (a classifier that failed, its
    `on_error` applied); `detail` says what fired (a PII kind, heuristics), never the text;
    `match` is the matched text, logged only with `audit.include_match`."""

    guardrail: str
    type: str
    layer: str
    verdict: str
    detail: str = ""
    match: str | None = None


@dataclass(frozen=True)
class InputContext:
    """What an input guardrail may know of the request besides its text."""

    rid: str
    tenant: str | None
    kind: str  # "completions", "chat" or "responses"
    model: str


class Guardrail:
    """A configured guardrail: `name`, `type`, `action`, `layer`."""

    def __init__(self, entry: Any, layer: str) -> None:
        self.name: str = entry.name
        self.type: str = entry.type
        self.action: str = entry.action
        self.layer = layer

    def finding(self, verdict: str, detail: str = "", match: str | None = None) -> Finding:
        return Finding(self.name, self.type, self.layer, verdict, detail, match)

    async def check(self, texts: RequestTexts, ctx: InputContext) -> Finding | None:
        """Input: this guardrail's decision on `texts` (a `redact` rewrites them)."""
        raise NotImplementedError

    def rule(self) -> OutputRule:
        """Output: the rule a scanner runs (text matchers only)."""
        raise TypeError(f"{self.type} guardrails check input only")

    async def close(self) -> None:
        """Release what it holds (a classifier's connections)."""


TYPES: dict[str, Callable[[Any, str], Guardrail]] = {}


def register(name: str) -> Callable[[type[Guardrail]], type[Guardrail]]:
    def add(cls: type[Guardrail]) -> type[Guardrail]:
        TYPES[name] = cls
        return cls
    return add


def build(entry: Entry, layer: str) -> Guardrail:
    """The guardrail `entry` configures (its `type` looked up in `TYPES`)."""
    return TYPES[entry.type](entry, layer)  # type: ignore[attr-defined]


class MatchGuardrail(Guardrail):
    """A text matcher: any span is the verdict; `redact` replaces each span."""

    matcher: Matcher

    def __init__(self, entry: Any, layer: str) -> None:
        super().__init__(entry, layer)
        self.replacement: str = entry.replacement
        self.look_behind: int = getattr(entry, "look_behind", None) or DEFAULT_LOOK_BEHIND

    @property
    def hold(self) -> int:
        width = self.matcher.width
        return (width if width is not None else self.look_behind) + 1

    def rule(self) -> OutputRule:
        return OutputRule(self.name, self.action, self.matcher, self.replacement, self.hold)

    async def check(self, texts: RequestTexts, ctx: InputContext) -> Finding | None:
        labels: list[str] = []
        first: str | None = None
        for field in texts.fields:
            spans = list(self.matcher.spans(field.text))
            if not spans:
                continue
            text = field.text
            first = first if first is not None else text[spans[0].start:spans[0].end]
            labels += [s.label for s in spans]
            if self.action == "refuse":
                return self.finding("refuse", _labels(labels), first)
            if self.action == "redact":
                if not field.editable:
                    return self.finding("refuse", "a token-id prompt cannot be redacted", first)
                out, at = [], 0
                for s in spans:
                    out += [text[at:s.start], self.replacement.replace("{kind}", s.label)]
                    at = s.end
                field.set("".join(out) + text[at:])
        return self.finding(self.action, _labels(labels), first) if labels else None


def _labels(labels: list[str]) -> str:
    return ",".join(sorted({x for x in labels if x}))


@register("regex")
class RegexGuardrail(MatchGuardrail):
    def __init__(self, entry: Any, layer: str) -> None:
        super().__init__(entry, layer)
        self.matcher = PatternMatcher(compile_pattern(entry.pattern, f"guardrail {self.name}"),
                                      pattern_width(entry.pattern))


@register("blocklist")
class BlocklistGuardrail(MatchGuardrail):
    """Terms as one alternation (RE2: one linear pass whatever their number); phrases match
    across up to `MAX_PHRASE_GAP` whitespace characters; `whole_words`: a term's word
    characters at its ends do not continue into the text around it."""

    def __init__(self, entry: Any, layer: str) -> None:
        super().__init__(entry, layer)
        alts = []
        for term in sorted(set(entry.terms), key=len, reverse=True):  # longest first
            words = [re.escape(w) for w in term.split()]
            body = rf"\s{{1,{MAX_PHRASE_GAP}}}".join(words)
            if entry.whole_words:
                body = (r"\b" if re.match(r"\w", term) else "") + body + (
                    r"\b" if re.search(r"\w$", term) else "")
            alts.append(body)
        flags = "" if entry.case_sensitive else "(?i)"
        pattern = flags + "(?:" + "|".join(alts) + ")"
        width = max(len(t) + len(t.split()) * MAX_PHRASE_GAP for t in entry.terms)
        pending = None
        if layer == "output":  # a term in progress at a stream's end: a prefix of one
            pending = TextSearch.of(flags + "(?:" + "|".join(
                _term_prefixes(t.split()) for t in set(entry.terms)) + r")\z")
        self.matcher = PatternMatcher(
            compile_pattern(pattern, f"guardrail {self.name}", max_chars=None), width,
            pending=pending)


def _word_prefixes(word: str) -> str:
    """Every non-empty prefix of `word`, as RE2: `a(?:b(?:c)?)?` for "abc"."""
    out = ""
    for ch in reversed(word):
        out = re.escape(ch) + (f"(?:{out})?" if out else "")
    return out


def _term_prefixes(words: list[str]) -> str:
    """Every non-empty prefix of a term (`words` joined by up to `MAX_PHRASE_GAP` whitespace
    characters), as RE2."""
    gap = rf"\s{{1,{MAX_PHRASE_GAP}}}"
    out = _word_prefixes(words[-1])
    for word in reversed(words[:-1]):
        out = f"(?:{re.escape(word)}(?:{gap}(?:{out})?)?|{_word_prefixes(word)})"
    return out


@register("pii")
class PiiGuardrail(MatchGuardrail):
    def __init__(self, entry: Any, layer: str) -> None:
        super().__init__(entry, layer)
        self.matcher = pii_matcher(tuple(entry.kinds or PII))


@register("injection")
class InjectionGuardrail(Guardrail):
    def __init__(self, entry: Any, layer: str) -> None:
        super().__init__(entry, layer)
        self.threshold: float = entry.threshold

    async def check(self, texts: RequestTexts, ctx: InputContext) -> Finding | None:
        score, fired = injection_score([f.text for f in texts.fields])
        if score >= self.threshold:
            return self.finding(self.action, ",".join(fired))
        return None


@register("limits")
class LimitsGuardrail(Guardrail):
    def __init__(self, entry: Any, layer: str) -> None:
        super().__init__(entry, layer)
        self.entry = entry

    async def check(self, texts: RequestTexts, ctx: InputContext) -> Finding | None:
        e = self.entry
        over = []
        if e.max_chars is not None and (n := texts.chars()) > e.max_chars:
            over.append(f"{n} characters of text, at most {e.max_chars}")
        if e.max_messages is not None and texts.messages > e.max_messages:
            over.append(f"{texts.messages} messages, at most {e.max_messages}")
        if e.max_tools is not None and texts.tools > e.max_tools:
            over.append(f"{texts.tools} tools, at most {e.max_tools}")
        if e.max_message_chars is not None:
            per: dict[int, int] = {}
            for f in texts.fields:
                per[f.message] = per.get(f.message, 0) + len(f.text)
            if per and (n := max(per.values())) > e.max_message_chars:
                over.append(f"a message of {n} characters, at most {e.max_message_chars}")
        return self.finding(self.action, "; ".join(over)) if over else None


def _classifier(entry: Any, layer: str) -> Guardrail:
    from tandem.router.guardrails.classifier import Classifier

    return Classifier(entry, layer)


TYPES["classifier"] = _classifier
