"""router.yaml `guardrails` (and the InferenceService's `router.guardrails`): every key, its
type and range, checked at start-up like the rest of router.yaml (`router.config`).

    guardrails:
      input:  [{name, type, action, ...}]   # before routing: refuse | redact | flag
      output: [{name, type, action, ...}]   # on the answer as it streams: redact | stop | flag
      policies:
        default: {models, adapters, max_context, max_tokens, guardrails}
        tenants: {TENANT: {...}}             # a field left out falls back to `default`'s
      audit: {include_match, log_passes}

Each entry's `type` picks its fields (`kinds.TYPES`, the registry): `regex` (`pattern`),
`blocklist` (`terms`), `pii` (`kinds`), `injection` (`threshold`), `limits` (`max_chars`,
...), `classifier` (`url`, `timeout_seconds`, `on_error`). Names are unique across both
layers; a policy's `guardrails` names existing ones.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Name = Annotated[str, Field(pattern=r"^[a-z0-9]([-a-z0-9_.]{0,61}[a-z0-9])?$")]
Text = Annotated[str, Field(min_length=1, max_length=4096)]
Replacement = Annotated[str, Field(max_length=256)]
LookBehind = Annotated[int, Field(ge=1, le=4096)]
Positive = Annotated[int, Field(ge=1)]
PII_KINDS = ("email", "phone", "ssn", "credit_card", "ipv4", "iban")
MAX_TERMS = 10000
MAX_ENTRIES = 64


class Strict(BaseModel):
    """No unknown keys, no coercion (as router.yaml)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class Entry(Strict):
    name: Name
    # the matched text is replaced by this (`redact`); "{kind}" names a PII kind
    replacement: Replacement = "[redacted]"


class RegexEntry(Entry):
    """A pattern (RE2 syntax): a match is the verdict."""

    type: Literal["regex"]
    pattern: Text
    look_behind: LookBehind | None = None  # output: held back when the match is unbounded


class BlocklistEntry(Entry):
    """Terms (words or phrases): any of them is the verdict."""

    type: Literal["blocklist"]
    terms: Annotated[list[Annotated[str, Field(min_length=1, max_length=256)]],
                     Field(min_length=1, max_length=MAX_TERMS)]
    case_sensitive: bool = False
    whole_words: bool = True


class PiiEntry(Entry):
    """Personal data: e-mail addresses, phone numbers, US SSNs, card numbers (Luhn-checked),
    IPv4 addresses, IBANs (mod-97-checked); `kinds` unset: all of them."""

    type: Literal["pii"]
    kinds: Annotated[list[Literal[PII_KINDS]], Field(min_length=1)] | None = None  # type: ignore[valid-type]
    replacement: Replacement = "[{kind}]"


class InjectionEntry(Entry):
    """Prompt-injection heuristics (`detectors.INJECTION`), each with a weight: the verdict
    when the weights of those that fire add up to `threshold`."""

    type: Literal["injection"]
    threshold: Annotated[float, Field(gt=0, le=100, allow_inf_nan=False)] = 1.0


class LimitsEntry(Entry):
    """Size and shape: characters of text in all, per message, messages, tools."""

    type: Literal["limits"]
    max_chars: Positive | None = None
    max_message_chars: Positive | None = None
    max_messages: Positive | None = None
    max_tools: Annotated[int, Field(ge=0)] | None = None


class ClassifierEntry(Entry):
    """An external classifier speaking the OpenAI moderation API (`POST url` with
    `{"input": [texts]}` -> `{"results": [{"flagged", "category_scores"}]}`)."""

    type: Literal["classifier"]
    url: Annotated[str, Field(pattern=r"^https?://[^\s]+$", max_length=2048)]
    timeout_seconds: Annotated[float, Field(gt=0, le=30, allow_inf_nan=False)] = 0.5
    on_error: Literal["allow", "refuse"] = "refuse"  # fail open or closed
    model: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    # flagged when one of these categories' score reaches `threshold` (unset: `flagged`)
    threshold: Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)] | None = None
    categories: list[Annotated[str, Field(min_length=1, max_length=128)]] | None = None
    max_chars: Annotated[int, Field(ge=1, le=1 << 20)] = 32768  # text sent, per request
    api_key_file: Annotated[str, Field(min_length=1, max_length=4096)] | None = None


def _input(model: type[Entry], actions: tuple[str, ...]) -> type[Entry]:
    return type(f"Input{model.__name__}", (model,), {
        "__annotations__": {"action": Literal[actions]}, "__module__": __name__})


def _output(model: type[Entry]) -> type[Entry]:
    return type(f"Output{model.__name__}", (model,), {
        "__annotations__": {"action": Literal["redact", "stop", "flag"]},
        "__module__": __name__})


_TEXT = ("refuse", "redact", "flag")
InputEntry = Annotated[
    _input(RegexEntry, _TEXT) | _input(BlocklistEntry, _TEXT) | _input(PiiEntry, _TEXT)
    | _input(InjectionEntry, ("refuse", "flag")) | _input(LimitsEntry, ("refuse", "flag"))
    | _input(ClassifierEntry, ("refuse", "flag")),
    Field(discriminator="type")]
OutputEntry = Annotated[
    _output(RegexEntry) | _output(BlocklistEntry) | _output(PiiEntry), Field(discriminator="type")]


class Policy(Strict):
    """What a tenant may ask for; unset fields: `default`'s (and unset there: no bound)."""

    models: list[Annotated[str, Field(min_length=1, max_length=256)]] | None = None
    adapters: list[Annotated[str, Field(min_length=1, max_length=256)]] | None = None
    max_context: Positive | None = None  # prompt tokens + max_tokens
    max_tokens: Positive | None = None
    guardrails: list[Name] | None = None  # the ones that apply (unset: all)


class Policies(Strict):
    default: Policy | None = None
    tenants: dict[Annotated[str, Field(pattern=r"^[A-Za-z0-9._-]{1,128}$")], Policy] | None = None


class Audit(Strict):
    include_match: bool = False  # the matched text in audit lines (off: never logged)
    log_passes: bool = False  # a line for passes too (off: only guardrails that acted)


class GuardrailsConfig(Strict):
    input: Annotated[list[InputEntry], Field(max_length=MAX_ENTRIES)] | None = None  # type: ignore[valid-type]
    output: Annotated[list[OutputEntry], Field(max_length=MAX_ENTRIES)] | None = None  # type: ignore[valid-type]
    policies: Policies | None = None
    audit: Audit | None = None

    @model_validator(mode="after")
    def _names(self) -> GuardrailsConfig:
        names: set[str] = set()
        for entry in [*(self.input or ()), *(self.output or ())]:
            if entry.name in names:
                raise ValueError(f'two guardrails are named "{entry.name}"')
            names.add(entry.name)
        p = self.policies
        for who, policy in [("default", p and p.default),
                            *(((f"tenants.{t}", v) for t, v in (p.tenants or {}).items())
                              if p else ())]:
            unknown = sorted(set(policy.guardrails or ()) - names) if policy else []
            if unknown:
                raise ValueError(f"policies.{who}.guardrails: no guardrail named {unknown[0]!r}")
        return self
