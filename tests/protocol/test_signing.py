"""Worker-plane signing (`protocol.signing`) and watched files (`protocol.watched`): the
signature binds body, target and time; every tamper is refused with its reason; key files
are checked, reloaded on content changes (a Kubernetes symlink swap included) and rotated
with an overlap."""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import pytest

from tandem.protocol import signing
from tandem.protocol.signing import (
    MAX_SKEW_S,
    SIGNATURE_HEADER,
    SignatureError,
    WorkerKey,
    sign,
    signed_headers,
    verify,
)
from tandem.protocol.watched import WatchedFile, WatchedFileError
from tandem.protocol.web import PREFILL_HEADER
from tandem.router.auth import ApiKeys

KEY = b"k" * 32
OTHER = b"o" * 32
BODY = json.dumps({"model": "m", "prompt": "hello", "cache_salt": "tenant=a"}).encode()
NOW = 1_750_000_000.0


def reason(keys, header, body=BODY, target=None, now=NOW) -> str | None:
    try:
        verify(keys, header, body, target, now=now)
    except SignatureError as exc:
        return exc.reason
    return None


def test_round_trip_with_and_without_a_target():
    for target in (None, "10.0.0.7:50051"):
        header = sign(KEY, BODY, target, now=NOW)
        assert reason([KEY], header, target=target) is None
        assert reason([OTHER, KEY], header, target=target) is None  # any accepted key
    n = "0" * 32
    assert sign(KEY, BODY, None, now=NOW, nonce=n) == sign(KEY, BODY, "", now=NOW, nonce=n)
    assert sign(KEY, BODY, now=NOW, nonce=n).startswith(f"t={int(NOW)},n={n},v1=")
    # a fresh nonce per signature: the same body in the same second signs differently
    assert len({sign(KEY, BODY, now=NOW) for _ in range(100)}) == 100


def test_every_tamper_is_refused_with_its_reason():
    header = sign(KEY, BODY, "10.0.0.7:50051", now=NOW)
    assert reason([KEY], header, target="10.0.0.7:50051") is None
    assert reason([OTHER], header, target="10.0.0.7:50051") == "bad"  # wrong key
    assert reason([KEY], header, target="10.0.0.8:50051") == "bad"  # other target
    assert reason([KEY], header, target=None) == "bad"  # target dropped
    assert reason([KEY], header, BODY + b" ", "10.0.0.7:50051") == "bad"  # other body
    ts, nonce, mac = header.split(",")
    assert reason([KEY], f"t={int(NOW) + 1},{nonce},{mac}", target="10.0.0.7:50051") == "bad"
    other_nonce = f"n={'0' * 32}" if nonce != f"n={'0' * 32}" else f"n={'1' * 32}"
    assert reason([KEY], f"{ts},{other_nonce},{mac}", target="10.0.0.7:50051") == "bad"
    assert reason([KEY], None) == reason([KEY], "") == "missing"
    for bad in ("garbage", ts, f"{ts},{nonce},v1=zz", f"{ts},{nonce},v2={mac[3:]}",
                f"{ts},{nonce},{mac}0", f"{ts},{mac}",  # the old format: no nonce
                f"{ts},n={nonce[2:18]},{mac}"):  # a short nonce
        assert reason([KEY], bad, target="10.0.0.7:50051") == "malformed", bad
    assert reason([], header, target="10.0.0.7:50051") == "no_key"


def test_random_single_byte_changes_never_verify():
    rng = random.Random(7)
    for _ in range(300):
        body = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))
        target = rng.choice([None, f"h{rng.randrange(99)}:{rng.randrange(1, 65536)}"])
        header = sign(KEY, body, target, now=NOW)
        assert reason([KEY], header, body, target) is None
        i = rng.randrange(len(body))
        flipped = body[:i] + bytes([body[i] ^ (1 << rng.randrange(8))]) + body[i + 1:]
        assert reason([KEY], header, flipped, target) == "bad"
        j = header.index("v1=") + 3 + rng.randrange(64)  # inside the hex MAC
        if rng.random() < 0.5:
            j = header.index("n=") + 2 + rng.randrange(32)  # inside the nonce
        c = "0" if header[j] != "0" else "1"
        assert reason([KEY], header[:j] + c + header[j + 1:], body, target) == "bad"


def test_freshness_window():
    header = sign(KEY, BODY, now=NOW)
    assert reason([KEY], header, now=NOW + MAX_SKEW_S) is None
    assert reason([KEY], header, now=NOW - MAX_SKEW_S) is None  # a clock slightly behind
    assert reason([KEY], header, now=NOW + MAX_SKEW_S + 1) == "stale"
    assert reason([KEY], header, now=NOW - MAX_SKEW_S - 1) == "stale"
    with pytest.raises(SignatureError, match=r"\+61 s off"):
        verify([KEY], header, BODY, now=NOW + 61)


def test_signed_headers_for_direct_callers():
    h = signed_headers(KEY, BODY, "p:1", now=NOW)
    assert h[PREFILL_HEADER] == "p:1" and reason([KEY], h[SIGNATURE_HEADER], target="p:1") is None
    assert PREFILL_HEADER not in signed_headers(KEY, BODY)


def write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_key_file_errors(tmp_path):
    for data, match in ((b"", "empty"), (b" \n", "empty"), (b"short", "5 bytes; at least 16"),
                        (b"x" * (signing.MAX_KEY_BYTES + 1), "larger than 4096 bytes")):
        with pytest.raises(WatchedFileError, match=match) as err:
            WorkerKey(write(tmp_path / "key", data))
        assert str(tmp_path / "key") in str(err.value)
    with pytest.raises(WatchedFileError, match="cannot read"):
        WorkerKey(tmp_path / "absent")
    with pytest.raises(SystemExit, match="--worker-auth-key-file: .*empty"):
        signing.load_worker_key(str(write(tmp_path / "key", b"")))
    assert signing.load_worker_key(None) is None
    # surrounding whitespace is not part of the key (a hand-written file's newline)
    k = WorkerKey(write(tmp_path / "key", KEY + b"\n"))
    assert reason([KEY], k.sign(BODY), now=time.time()) is None


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_rotation_overlap(tmp_path):
    """After a change a signer keeps the previous key for `sign_previous_for_s`, a verifier
    accepts it for `accept_previous_for_s`: two processes that see the change up to
    `sign_previous_for_s` apart keep agreeing."""
    path = write(tmp_path / "key", KEY)
    clock = Clock()
    router = WorkerKey(path, reload_interval_s=1, sign_previous_for_s=120,
                       accept_previous_for_s=240, clock=clock)
    worker = WorkerKey(path, reload_interval_s=1, sign_previous_for_s=120,
                       accept_previous_for_s=240, clock=clock)
    assert router.signing_key() == KEY and worker.verifying_keys() == [KEY]
    write(path, OTHER)
    clock.t += 1
    router.signing_key()  # the router sees the new key now...
    assert router.signing_key() == KEY  # ...but signs with the old one for a while
    clock.t += 100  # the worker sees it 100 s later
    assert worker.verifying_keys() == [OTHER, KEY]
    assert router.signing_key() == KEY
    clock.t += 20  # 120 s after the router saw it: it switches
    assert router.signing_key() == OTHER
    for _ in range(2):
        header = router.sign(BODY)
        worker.verify(header, BODY)  # accepted throughout
        clock.t += 150
    assert worker.verifying_keys() == [OTHER]  # 240 s after the worker saw it: old key gone
    with pytest.raises(SignatureError) as err:
        worker.verify(sign(KEY, BODY), BODY)
    assert err.value.reason == "bad"


def test_a_broken_rewrite_keeps_the_last_good_key(tmp_path, caplog):
    path = write(tmp_path / "key", KEY)
    clock = Clock()
    k = WorkerKey(path, reload_interval_s=1, clock=clock)
    write(path, b"")
    clock.t += 1
    assert k.verifying_keys() == [KEY] and k.reload_errors == 1
    os.unlink(path)
    clock.t += 1
    assert k.verifying_keys() == [KEY] and k.reload_errors == 2
    assert "keeping the last good worker auth key" in caplog.text
    write(path, OTHER)
    clock.t += 0.5  # within the interval: not re-read yet
    assert k.verifying_keys() == [KEY]
    clock.t += 0.5
    assert k.verifying_keys() == [OTHER, KEY]


def kube_secret(d: Path, name: str, files: dict[str, bytes]) -> None:
    """Write `files` as kubelet updates a Secret volume: a new timestamped directory, then
    an atomic rename of the `..data` symlink onto it (each file links through `..data`)."""
    ts = d / f"..{name}"
    ts.mkdir()
    for f, data in files.items():
        (ts / f).write_bytes(data)
    tmp = d / "..data_tmp"
    tmp.symlink_to(ts.name)
    os.replace(tmp, d / "..data")
    for f in files:
        if not (d / f).is_symlink():
            (d / f).symlink_to(f"..data/{f}")


def test_a_kubernetes_symlink_swap_is_seen(tmp_path):
    kube_secret(tmp_path, "v1", {"api-keys": b"sk-a alpha\n"})
    clock = Clock()
    seen = []
    w = WatchedFile(tmp_path / "api-keys", bytes.decode, what="keys", max_bytes=100,
                    interval_s=2, on_change=lambda old, new: seen.append((old, new)),
                    clock=clock)
    kube_secret(tmp_path, "v2", {"api-keys": b"sk-b beta\n"})
    assert w.value() == "sk-a alpha\n"  # not yet re-read
    clock.t += 2
    assert w.value() == "sk-b beta\n" and seen == [("sk-a alpha\n", "sk-b beta\n")]
    clock.t += 2
    assert w.value() == "sk-b beta\n" and w.reloads == 1 and len(seen) == 1  # unchanged


def test_api_keys_follow_their_file(tmp_path):
    path = write(tmp_path / "keys", b"sk-a alpha\nsk-b beta\n")
    keys = ApiKeys.from_file(path, reload_interval_s=0)
    assert keys.tenant("Bearer sk-a") == "alpha" and keys.configured
    write(path, b"sk-b beta\nsk-c gamma\n")
    with pytest.raises(Exception, match="invalid API key"):
        keys.tenant("Bearer sk-a")
    assert keys.tenant("Bearer sk-c") == "gamma"
    # malformed, not text, a key without tenant, emptied (auth must not turn off)
    for bad in (b"sk-x al;pha\n", b"\xff\xfe\n", b"sk-x\n", b"", b"# all gone\n"):
        write(path, bad)
        assert keys.tenant("Bearer sk-c") == "gamma"  # the last good keys stay
        with pytest.raises(Exception, match="missing or malformed"):
            keys.tenant(None)
    assert keys.reload_errors == 10  # every re-read of a bad file counts (two per case)
    with pytest.raises(WatchedFileError, match="line 2: expected 'KEY TENANT'"):
        ApiKeys.from_file(write(tmp_path / "bad", b"sk-a alpha\nsk-b\n"))


def test_refusal_log_lines_are_throttled_per_reason():
    """A flood of forged requests gets one log line per reason every LOG_INTERVAL_S, each
    saying how many it stood for; every refusal still counts (the metric, not the log)."""
    from tandem.serving.worker_auth import LOG_INTERVAL_S, _Throttle

    t = _Throttle()
    rng = random.Random(7)
    now, logged = 0.0, {"bad": [], "stale": []}
    total = {"bad": 0, "stale": 0}
    for _ in range(5000):
        now += rng.expovariate(200.0)
        reason = rng.choice(("bad", "stale"))
        total[reason] += 1
        got = t.allow(reason, now)
        if got is not None:
            logged[reason].append((now, got))
    for reason, lines in logged.items():
        gaps = [b[0] - a[0] for a, b in zip(lines, lines[1:], strict=False)]
        assert all(g >= LOG_INTERVAL_S for g in gaps), reason
        assert len(lines) <= now / LOG_INTERVAL_S + 1
        assert len(lines) + sum(n for _, n in lines) <= total[reason]  # none counted twice
        assert lines[0][1] == 0  # the first refusal is logged at once


# -- replay: each signature is accepted once ------------------------------------------------
def admit(cache: signing.ReplayCache, ts: int, mac: bytes, now: float) -> str | None:
    try:
        cache.admit(ts, mac, now)
    except SignatureError as exc:
        return exc.reason
    return None


def test_replay_cache_against_a_reference_over_random_traces():
    """3,000 seeded traces of fresh, replayed and reordered signatures, the verifier's clock
    sometimes stepping back: nothing accepted is ever accepted again, the cache never holds
    more than its capacity, a cache that never overflowed (on a clock that never stepped
    back) accepts every fresh new signature, and one newer than anything admitted so far is
    accepted even after overflows (forgetting only ever refuses the old)."""
    rng = random.Random(20240613)
    window = 10
    for trace in range(3000):
        capacity = rng.choice((1, 2, 3, 5, 8, 50))
        cache = signing.ReplayCache(capacity, window_s=window)
        accepted: set[bytes] = set()  # the reference: every signature ever accepted
        issued: list[tuple[int, bytes]] = []
        newest, stepped_back = -1, False
        now = 1000.0
        for _ in range(rng.randrange(20, 60)):
            step = rng.choice((0, 0, 0.3, 1, 2, 7, 7, -8 if trace % 3 == 0 else 1))
            stepped_back |= step < 0  # an NTP correction on the verifier
            now += step
            if issued and rng.random() < 0.35:
                ts, mac = rng.choice(issued)  # a replay (or a retry of a refused one)
            else:
                ts = int(now) - rng.randrange(0, window)  # fresh, possibly reordered
                mac = rng.randbytes(32)
                issued.append((ts, mac))
            if now - ts > window:
                continue  # `verify` refuses it by the clock before the cache is asked
            got = admit(cache, ts, mac, now)
            assert len(cache) <= capacity, trace
            if mac in accepted:
                assert got in ("replayed", "stale"), (trace, got)
                continue
            if got is None:
                accepted.add(mac)
                newest = max(newest, ts)
                continue
            assert got == "stale", (trace, got)
            assert cache.evictions or stepped_back, (trace, "refused a fresh new signature")
            assert ts <= newest, (trace, "refused a signature newer than any admitted")


def test_replay_cache_is_safe_across_threads():
    import threading

    cache = signing.ReplayCache(1000, window_s=60)
    macs = [random.Random(i).randbytes(32) for i in range(200)]
    results: list[str | None] = []
    lock = threading.Lock()

    def hammer() -> None:
        for mac in macs:
            got = admit(cache, 1000, mac, 1000.0)
            with lock:
                results.append(got)

    threads = [threading.Thread(target=hammer) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results.count(None) == len(macs)  # each accepted by exactly one thread
    assert results.count("replayed") == 7 * len(macs)


def test_a_worker_key_accepts_each_signature_once(tmp_path):
    k = WorkerKey(write(tmp_path / "key", KEY), replay_capacity=16)
    header = k.sign(BODY, "p:1")
    k.verify(header, BODY, "p:1")
    with pytest.raises(SignatureError, match="already used") as err:
        k.verify(header, BODY, "p:1")
    assert err.value.reason == "replayed"
    for _ in range(10):  # fresh signatures of the same body in the same second: all pass
        k.verify(k.sign(BODY, "p:1"), BODY, "p:1")
    assert len(k.replay) == 11
    # a forgery is not remembered (it cannot fill the cache), the signed one still works
    with pytest.raises(SignatureError):
        k.verify(sign(OTHER, BODY), BODY)
    assert len(k.replay) == 11
