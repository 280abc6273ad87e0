"""Random guardrail configurations (seeded): the CRD (its openAPIV3Schema and CEL rules),
the operator's spec parsing and the router's own checker agree. A valid one passes all
three, its router.yaml keys are the CRD's snake_cased one for one (back again: the CRD's
object as the API server stores it), and what the router's checker makes of it is what the
operator renders; a broken one (a field of another type, a bound, an action the layer or
type does not take, an unknown key) is refused by the CRD and by the operator alike."""

from __future__ import annotations

import copy
import random
import re
from typing import Any

import pytest

from tandem.operator import crd_schema
from tandem.operator.spec import SpecError
from tandem.operator.spec_guardrails import KEYS_DIR, parse_guardrails, to_router_yaml
from tandem.router.config import check_config
from tests.operator.crd_validate import schema_errors
from tests.operator.samples import apply_defaults, schema

SEED, COUNT = 20240611, 300
PII = ["email", "phone", "ssn", "credit_card", "ipv4", "iban"]
PATTERNS = [r"\bpassword\b", "(?i)ignore (all )?previous instructions", r"\d{3}-\d{2}-\d{4}",
            "a+b*c?", "x|y|z", r"(?s)BEGIN.*END", r"[a-z]{4,8}", "^secret$", "é+"]
WORDS = ["alpha", "beta gamma", "Delta", "x", "naïve", "two words here", "42"]
TEXT = ("regex", "blocklist", "pii")
INPUT = ("refuse", "redact", "flag")


def _guardrails_schema() -> dict[str, Any]:
    return schema()["properties"]["spec"]["properties"]["router"]["properties"]["guardrails"]


def _some(rng: random.Random, fields: dict[str, Any]) -> dict[str, Any]:
    """A random subset of `fields` (values: thunks)."""
    return {k: make() for k, make in fields.items() if rng.random() < 0.5}


def _entry(rng: random.Random, name: str, layer: str) -> dict[str, Any]:
    kinds = TEXT if layer == "output" else (*TEXT, "injection", "limits", "classifier")
    kind = rng.choice(kinds)
    actions = (("redact", "stop", "flag") if layer == "output"
               else INPUT if kind in TEXT else ("refuse", "flag"))
    e: dict[str, Any] = {"name": name, "type": kind, "action": rng.choice(actions)}
    e |= _some(rng, {"replacement": lambda: rng.choice(["", "***", "[x]", "[{kind}]"])})
    if kind == "regex":
        e["pattern"] = rng.choice(PATTERNS)
        e |= _some(rng, {"lookBehind": lambda: rng.choice([1, 4096, rng.randint(1, 4096)])})
    elif kind == "blocklist":
        e["terms"] = rng.sample(WORDS, rng.randint(1, 4))
        e |= _some(rng, {"caseSensitive": lambda: rng.random() < 0.5,
                         "wholeWords": lambda: rng.random() < 0.5})
    elif kind == "pii":
        e |= _some(rng, {"kinds": lambda: rng.sample(PII, rng.randint(1, len(PII)))})
    elif kind == "injection":
        e |= _some(rng, {"threshold": lambda: rng.choice([100, 0.5, round(
            rng.uniform(0.01, 100), 3)])})
    elif kind == "limits":
        e |= _some(rng, {"maxChars": lambda: rng.randint(1, 10**6),
                         "maxMessageChars": lambda: rng.randint(1, 10**5),
                         "maxMessages": lambda: rng.randint(1, 500),
                         "maxTools": lambda: rng.randint(0, 64)})
    else:
        e["url"] = rng.choice(["http://moderation:8080/v1/moderations",
                               "https://api.example.com/v1/moderations?x=1"])
        e |= _some(rng, {
            "timeoutSeconds": lambda: rng.choice([30, 0.001, round(rng.uniform(0.01, 30), 3)]),
            "onError": lambda: rng.choice(["allow", "refuse"]),
            "model": lambda: rng.choice(["omni-moderation-latest", "shield"]),
            "threshold": lambda: rng.choice([0, 1, round(rng.random(), 3)]),
            "categories": lambda: rng.sample(["violence", "hate", "self-harm"], 2),
            "maxChars": lambda: rng.choice([1, 1 << 20, rng.randint(1, 1 << 20)]),
            "apiKeySecretRef": lambda: {"name": f"key-{name.replace('_', '-')}"} | (
                {"key": "token"} if rng.random() < 0.5 else {})})
    return e


def _policy(rng: random.Random, names: list[str]) -> dict[str, Any]:
    return _some(rng, {"models": lambda: rng.sample(["llama", "Acme/m:v2", "qwen"], 2),
                       "adapters": lambda: ["sql"],
                       "maxContext": lambda: rng.randint(1, 1 << 17),
                       "maxTokens": lambda: rng.randint(1, 1 << 14),
                       "guardrails": lambda: rng.sample(names, rng.randint(0, len(names)))})


def _config(rng: random.Random) -> dict[str, Any]:
    names = [f"{rng.choice(['g', 'rule', 'no.pii', 'a_b', '0x'])}-{i}"
             for i in range(rng.randint(0, 8))]
    cut = rng.randint(0, len(names))
    cfg: dict[str, Any] = {}
    if cut or rng.random() < 0.3:
        cfg["input"] = [_entry(rng, n, "input") for n in names[:cut]]
    if names[cut:] or rng.random() < 0.3:
        cfg["output"] = [_entry(rng, n, "output") for n in names[cut:]]
    if rng.random() < 0.6:
        cfg["policies"] = _some(rng, {"default": lambda: _policy(rng, names), "tenants": lambda: {
            t: _policy(rng, names) for t in rng.sample(["acme", "acme_corp.eu", "T-1"], 2)}})
    if rng.random() < 0.5:
        cfg["audit"] = _some(rng, {"includeMatch": lambda: rng.random() < 0.5,
                                   "logPasses": lambda: rng.random() < 0.5})
    return cfg


def _to_crd(value: Any, secrets: dict[str, dict[str, str]], path: tuple[Any, ...] = ()
            ) -> Any:
    """router.yaml -> the CRD's keys (the test's own inverse: camelCase but tenant names;
    `api_key_file` -> the Secret key mounted there, from `secrets` by guardrail)."""
    if isinstance(value, list):
        return [_to_crd(v, secrets, (*path, i)) for i, v in enumerate(value)]
    if not isinstance(value, dict):
        return value
    out = {}
    for k, v in value.items():
        if path == ("policies", "tenants"):
            out[k] = _to_crd(v, secrets, (*path, k))
        elif k == "api_key_file":
            guardrail, key_file = v.removeprefix(f"{KEYS_DIR}/").split("/")
            assert key_file == "api-key" and guardrail == value["name"]
            out["apiKeySecretRef"] = secrets[guardrail]
        else:
            camel = re.sub(r"_([a-z])", lambda m: m.group(1).upper(), k)
            out[camel] = _to_crd(v, secrets, (*path, k))
    return out


def _within(small: Any, big: Any) -> bool:
    """Every key of `small` is in `big` with the same value (`big` adds defaults)."""
    if isinstance(small, dict):
        return isinstance(big, dict) and all(k in big and _within(v, big[k])
                                             for k, v in small.items())
    if isinstance(small, list):
        return (isinstance(big, list) and len(small) == len(big)
                and all(_within(a, b) for a, b in zip(small, big, strict=True)))
    return small == big and type(small) is type(big) or (
        isinstance(small, int) and isinstance(big, float) and float(small) == big)


def test_random_valid_configs_pass_the_crd_the_operator_and_the_router() -> None:
    rng, node = random.Random(SEED), _guardrails_schema()
    seen: set[str] = set()
    for _ in range(COUNT):
        cfg = _config(rng)
        assert schema_errors(node, copy.deepcopy(cfg)) == [], cfg
        stored = apply_defaults(node, copy.deepcopy(cfg))  # the key Secrets' default key
        assert crd_schema.validate(node, stored) == [], cfg  # `tandem render`'s API server
        parsed = parse_guardrails(copy.deepcopy(cfg))
        assert parsed is not None, cfg
        converted, keys = to_router_yaml(copy.deepcopy(cfg))
        secrets = {k.guardrail: {"name": k.secret.name, "key": k.secret.key} for k in keys}
        assert _to_crd(converted, secrets) == stored, cfg
        assert check_config({"guardrails": converted}).get("guardrails", {}) == parsed.config
        assert _within(converted, parsed.config), (converted, parsed.config)
        assert check_config({"guardrails": parsed.config}).get("guardrails", {}) == (
            parsed.config)  # the rendered dict is a fixed point of the router's checker
        assert [k.guardrail for k in keys] == [e["name"] for e in cfg.get("input", ())
                                               if "apiKeySecretRef" in e]
        seen |= {e["type"] for layer in ("input", "output") for e in cfg.get(layer, ())}
    assert seen == {"regex", "blocklist", "pii", "injection", "limits", "classifier"}


OTHER_FIELDS = {"pattern": "x", "lookBehind": 8, "terms": ["x"], "caseSensitive": True,
                "kinds": ["email"], "threshold": 0.5, "maxMessages": 3, "url": "http://m",
                "onError": "allow", "apiKeySecretRef": {"name": "k"}}
OWN = {"regex": {"pattern", "lookBehind"}, "blocklist": {"terms", "caseSensitive"},
       "pii": {"kinds"}, "injection": {"threshold"}, "limits": {"maxMessages"},
       "classifier": {"threshold", "url", "onError", "apiKeySecretRef"}}
BOUNDS = {"regex": ("lookBehind", [0, 4097]), "blocklist": ("terms", [[], [""]]),
          "pii": ("kinds", [[], ["dna"]]), "injection": ("threshold", [0, 100.5]),
          "limits": ("maxTools", [-1]), "classifier": ("timeoutSeconds", [0, 31])}


def _break(rng: random.Random, cfg: dict[str, Any]) -> str:
    """Break one entry of `cfg` in place, as the CRD refuses too; what was done."""
    layer = rng.choice([k for k in ("input", "output") if cfg.get(k)])
    e = rng.choice(cfg[layer])
    how = rng.choice(["other type's field", "bound", "action", "unknown key", "name"])
    if how == "other type's field":
        key = rng.choice(sorted(set(OTHER_FIELDS) - OWN[e["type"]]))
        e[key] = OTHER_FIELDS[key]
    elif how == "bound":
        key, values = BOUNDS[e["type"]]
        e[key] = rng.choice(values)
    elif how == "action":
        allowed = ({"redact", "stop", "flag"} if layer == "output"
                   else set(INPUT) if e["type"] in TEXT else {"refuse", "flag"})
        e["action"] = rng.choice(sorted({"refuse", "redact", "stop", "flag"} - allowed))
    elif how == "unknown key":
        e[rng.choice(["look_behind", "maxchars", "Pattern", "extra"])] = 1
    else:
        e["name"] = rng.choice(["Bad", "-x", "a" * 64, "a b"])
    return f"{how}: {e}"


@pytest.mark.parametrize("seed", range(3))
def test_random_broken_configs_are_refused_by_the_crd_and_the_operator(seed: int) -> None:
    rng, node = random.Random(SEED + seed), _guardrails_schema()
    broken = 0
    while broken < 60:
        cfg = _config(rng)
        if not (cfg.get("input") or cfg.get("output")):
            continue
        what = _break(rng, cfg)
        broken += 1
        assert schema_errors(node, copy.deepcopy(cfg)), what
        with pytest.raises(SpecError, match=r"^router\.guardrails[.\[]"):
            parse_guardrails(copy.deepcopy(cfg))
