"""Seeded synthetic workloads for the offline throughput benchmark.

Prompts are random token ids drawn (with a fixed numpy ``Generator`` seed) from the
real SmolLM2 tokenizer's normal, non-special token ids, so every engine receives
exactly the same token-id prompts and no tokenizer round trip is involved.

A workload is serialised to JSON for the per-engine runner subprocesses:
``{"name": ..., "params": {...}, "requests": [{"prompt_token_ids": [...],
"max_tokens": N}, ...]}``.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

BENCH_DIR = Path(__file__).resolve().parent
# SmolLM2's 17 control tokens occupy ids 0..16 (<|endoftext|>, <|im_start|>, ...).  Used only
# when neither the bundled GGUF nor an exported tokenizer can be read.
_FALLBACK_SPECIAL_IDS = tuple(range(17))

SHARED_PREFIX_TOKENS = 512


@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int


def _bundled_gguf() -> Path | None:
    env = os.environ.get("TANDEM_BENCH_GGUF")
    if env:
        return Path(env)
    from tandem.protocol.bundled import find_bundled_gguf

    return find_bundled_gguf()


@functools.lru_cache(maxsize=1)
def special_token_ids() -> tuple[int, ...]:
    """Ids of the real tokenizer's special (non-normal) tokens.

    Read from the bundled GGUF's ``tokenizer.ggml.token_type`` (1 = normal), else from an
    exported ``tokenizer.json``'s added tokens, else SmolLM2's known control-token range.
    """
    gguf_path = _bundled_gguf()
    if gguf_path is not None:
        try:
            from gguf import GGUFReader

            field = GGUFReader(str(gguf_path)).fields["tokenizer.ggml.token_type"]
            types = np.array([field.parts[i][0] for i in field.data])
            return tuple(int(i) for i in np.nonzero(types != 1)[0])
        except Exception:  # noqa: BLE001 - fall through to the next source
            pass
    tok_json = BENCH_DIR / ".cache" / "smollm2-hf" / "tokenizer.json"
    if tok_json.exists():
        added = json.loads(tok_json.read_text())["added_tokens"]
        return tuple(sorted(int(t["id"]) for t in added if t.get("special", True)))
    return _FALLBACK_SPECIAL_IDS


def normal_token_ids(vocab_size: int, special_ids: Sequence[int] | None = None) -> np.ndarray:
    special = set(special_token_ids() if special_ids is None else special_ids)
    return np.array([i for i in range(vocab_size) if i not in special], dtype=np.int64)


def make_workload(
    num_requests: int = 96,
    seed: int = 0,
    shared_prefix_tokens: int = 0,
    vocab_size: int = 49152,
    prompt_len: tuple[int, int] = (32, 768),
    output_len: tuple[int, int] = (16, 256),
    special_ids: Sequence[int] | None = None,
    num_prefix_groups: int = 1,
) -> list[BenchRequest]:
    """Deterministic list of requests.

    ``prompt_len`` and ``output_len`` are inclusive uniform ranges.  With
    ``shared_prefix_tokens > 0`` a random prefix of that many tokens is prepended to every
    prompt (``prompt_len`` then counts only the per-request suffix): one prefix shared by all,
    or with ``num_prefix_groups = G > 1``, G different prefixes ("system prompts"), each
    request drawing its group uniformly.
    """
    if num_prefix_groups < 1:
        raise ValueError("num_prefix_groups must be >= 1")
    if num_requests < 0:
        raise ValueError("num_requests must be >= 0")
    if not 1 <= prompt_len[0] <= prompt_len[1]:
        raise ValueError(f"bad prompt_len range {prompt_len}")
    if not 1 <= output_len[0] <= output_len[1]:
        raise ValueError(f"bad output_len range {output_len}")
    vocab = normal_token_ids(vocab_size, special_ids)
    rng = np.random.default_rng(seed)
    prefixes = [rng.choice(vocab, size=shared_prefix_tokens).tolist() if shared_prefix_tokens
                else [] for _ in range(num_prefix_groups)]
    requests = []
    for _ in range(num_requests):
        group = int(rng.integers(num_prefix_groups)) if num_prefix_groups > 1 else 0
        plen = int(rng.integers(prompt_len[0], prompt_len[1] + 1))
        olen = int(rng.integers(output_len[0], output_len[1] + 1))
        suffix = rng.choice(vocab, size=plen).tolist()
        requests.append(BenchRequest(prompt_token_ids=prefixes[group] + suffix,
                                     max_tokens=olen))
    return requests


# Named workloads used by offline_throughput.py: (full, --quick) keyword arguments.
WORKLOADS: dict[str, tuple[dict, dict]] = {
    "mixed": (
        dict(num_requests=96, prompt_len=(32, 768), output_len=(16, 256)),
        dict(num_requests=24, prompt_len=(32, 256), output_len=(16, 64)),
    ),
    "shared-prefix": (
        dict(num_requests=96, prompt_len=(32, 768), output_len=(16, 256),
             shared_prefix_tokens=SHARED_PREFIX_TOKENS),
        dict(num_requests=24, prompt_len=(32, 256), output_len=(16, 64),
             shared_prefix_tokens=SHARED_PREFIX_TOKENS),
    ),
}


def workload_params(name: str, quick: bool = False, seed: int = 0) -> dict:
    full, short = WORKLOADS[name]
    params = dict(short if quick else full)
    params["seed"] = seed
    return params


def save_workload(path: Path, name: str, params: dict, requests: list[BenchRequest]) -> None:
    data = {
        "name": name,
        "params": {k: list(v) if isinstance(v, tuple) else v for k, v in params.items()},
        "requests": [asdict(r) for r in requests],
    }
    Path(path).write_text(json.dumps(data))


def load_workload(path: str | Path) -> tuple[dict, list[BenchRequest]]:
    """Return (the workload JSON without its requests, the requests)."""
    data = json.loads(Path(path).read_text())
    reqs = [BenchRequest(list(r["prompt_token_ids"]), int(r["max_tokens"]))
            for r in data.pop("requests")]
    return data, reqs
