"""The built-in detectors: personal data (`pii_matcher`) and prompt-injection heuristics
(`injection_score`). Every pattern is RE2 syntax with a bounded width, compiled once.

PII kinds: `email`, `phone` (NANP and international forms with separators), `ssn` (US,
area / group / serial ranges checked), `credit_card` (13-19 digits, Luhn-checked),
`ipv4`, `iban` (mod-97-checked). They favour precision: a number that fails its checksum is
not reported.

Injection heuristics, each with a weight (a request is flagged when the weights of those
that fire reach the guardrail's `threshold`, 1.0 by default): an instruction to ignore or
override the earlier ones (1.0), a request for the system prompt (0.6), a role-play
jailbreak ("you are now DAN", 1.0), a "developer mode" request (0.5), chat-template role
markers typed into text (1.0), "from now on" / "new instructions" (0.4), invisible Unicode
tag characters (1.0) or runs of zero-width characters (0.5), a long base64 blob (0.3).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from tandem.router.guardrails.patterns import AnyOf, Matcher, PatternMatcher, compile_pattern


def _luhn(text: str) -> bool:
    digits = [int(c) for c in text if c.isdigit()]
    if not 13 <= len(digits) <= 19:
        return False
    total = 0
    for i, d in enumerate(reversed(digits)):
        if i % 2:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


def _iban(text: str) -> bool:
    s = text.replace(" ", "")
    if not 15 <= len(s) <= 34:
        return False
    moved = s[4:] + s[:4]
    return int("".join(str(int(c, 36)) for c in moved)) % 97 == 1


def _ssn(text: str) -> bool:
    area, group, serial = text.split("-")
    return area not in ("000", "666") and area[0] != "9" and group != "00" and serial != "0000"


_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
# kind -> (pattern, width, checksum); widths are exact upper bounds of each pattern
PII: dict[str, tuple[str, int, object]] = {
    "email": (r"\b[A-Za-z0-9._%+-]{1,64}@(?:[A-Za-z0-9-]{1,63}\.){1,4}[A-Za-z]{2,24}\b",
              64 + 1 + 4 * 64 + 24, None),
    "phone": (r"(?:\+[0-9]{1,3}[ .-]?)?(?:\([0-9]{3}\)|\b[0-9]{3})[ .-]?[0-9]{3}[ .-][0-9]{4}\b",
              5 + 5 + 1 + 3 + 1 + 4, None),
    "ssn": (r"\b[0-9]{3}-[0-9]{2}-[0-9]{4}\b", 11, _ssn),
    "credit_card": (r"\b(?:[0-9][ -]?){12,18}[0-9]\b", 37, _luhn),
    "ipv4": (rf"\b{_OCTET}(?:\.{_OCTET}){{3}}\b", 15, None),
    "iban": (r"\b[A-Z]{2}[0-9]{2}(?: ?[A-Z0-9]{4}){2,7}(?: ?[A-Z0-9]{1,4})?\b", 4 + 35 + 5,
             _iban),
}


@functools.lru_cache(maxsize=64)
def pii_matcher(kinds: tuple[str, ...]) -> Matcher:
    """The union of `kinds`' detectors, each span labelled with its kind."""
    return AnyOf([PatternMatcher(compile_pattern(PII[k][0], f"pii {k}"), PII[k][1], k,
                                 PII[k][2])  # type: ignore[arg-type]
                  for k in kinds])


@dataclass(frozen=True)
class Heuristic:
    name: str
    pattern: str
    weight: float


INJECTION: tuple[Heuristic, ...] = (
    Heuristic("ignore_instructions",
              r"(?i)\b(?:ignore|disregard|forget|override|bypass|skip)\s+(?:all\s+|any\s+|"
              r"the\s+|your\s+|my\s+|these\s+|those\s+)*(?:previous|prior|above|earlier|"
              r"preceding|original|system|initial)?\s*(?:instructions?|rules|prompts?|"
              r"directions|guidelines|constraints)\b", 1.0),
    Heuristic("reveal_system_prompt",
              r"(?i)\b(?:reveal|print|show|repeat|output|display|leak|tell\s+me)\s+(?:me\s+)?"
              r"(?:your|the)\s+(?:system\s+prompt|initial\s+instructions|hidden\s+"
              r"instructions|original\s+prompt|instructions\s+above)", 0.6),
    Heuristic("role_play_jailbreak",
              r"(?i)\b(?:you\s+are\s+now|act\s+as|pretend\s+to\s+be|roleplay\s+as)\s+"
              r"(?:an?\s+)?(?:dan|unrestricted|unfiltered|jailbroken|evil|uncensored)\b|"
              r"\bdo\s+anything\s+now\b", 1.0),
    Heuristic("special_mode", r"(?i)\b(?:developer|god|jailbreak|dan)\s+mode\b", 0.5),
    Heuristic("role_markers",
              r"<\|(?:im_start|im_end|system|user|assistant|start_header_id|end_header_id|"
              r"eot_id|begin_of_text)\|>|\[/?INST\]|<</?SYS>>|(?m)^\s*#{2,}\s*(?:system|"
              r"instruction)s?\s*:?\s*$", 1.0),
    Heuristic("new_instructions",
              r"(?i)\b(?:from\s+now\s+on,?\s+you|new\s+instructions\s*:|your\s+new\s+"
              r"(?:task|role|instructions)\s+(?:is|are))", 0.4),
    Heuristic("unicode_tags", "[\U000E0000-\U000E007F]", 1.0),
    Heuristic("zero_width_run", "[\u200b-\u200f\u2060-\u2064\ufeff]{3,}", 0.5),
    Heuristic("base64_blob", r"[A-Za-z0-9+/]{200,}={0,2}", 0.3),
)


@functools.lru_cache(maxsize=1)
def _injection_compiled() -> tuple[tuple[Heuristic, object], ...]:
    return tuple((h, compile_pattern(h.pattern, f"injection {h.name}")) for h in INJECTION)


def injection_score(texts: list[str]) -> tuple[float, list[str]]:
    """(the summed weight of the heuristics that fire in any of `texts`, their names)."""
    fired: list[str] = []
    score = 0.0
    for h, compiled in _injection_compiled():
        if any(compiled.search(t) for t in texts):  # type: ignore[attr-defined]
            fired.append(h.name)
            score += h.weight
    return score, fired
