"""KV offload tiers: how KV records compress and how fast, and TTFT of a prompt whose
prefix the device pool evicted: recomputed vs loaded from the host tier vs from disk.

Codec: the bundled model's real KV pages (a prompt's blocks, every layer), encoded with
each compression (`engine/kv_tiers/codec.py`): bytes ratio, encode and decode+verify MB/s.
TTFT: one engine per mode with a device pool too small to keep the prefix across a filler
prompt; the timed request is the prefix + a new question.

    .venv/bin/python bench/kv_tiers.py [--prefix-tokens 1024] [--repeats 3] [--out F]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path


def _codec(core, block_ids: list[int], repeats: int) -> dict:
    import torch

    from tandem.engine.kv_tiers.codec import BlockMeta, decode, encode

    layers = core.export_kv(block_ids)
    blocks = [torch.stack([p[:, j:j + 1] for p in layers]) for j in range(len(block_ids))]
    raw = sum(b.numel() * b.element_size() for b in blocks)
    out = {"blocks": len(blocks), "raw_bytes": raw, "dtype": str(blocks[0].dtype)}
    for comp in ("none", "zlib"):
        t0 = time.perf_counter()
        for _ in range(repeats):
            records = [encode(b, BlockMeta(bytes([i]) * 8), comp) for i, b in enumerate(blocks)]
        enc = (time.perf_counter() - t0) / repeats
        t0 = time.perf_counter()
        for _ in range(repeats):
            for i, (r, b) in enumerate(zip(records, blocks, strict=True)):
                decode(r, bytes([i]) * 8, tuple(b.shape), b.dtype, "")
        dec = (time.perf_counter() - t0) / repeats
        stored = sum(len(r) for r in records)
        out[comp] = {"stored_bytes": stored, "ratio": round(raw / stored, 3),
                     "encode_MBps": round(raw / enc / 1e6, 1),
                     "decode_verify_MBps": round(raw / dec / 1e6, 1)}
    return out


def _ttft(mode: str, prefix: list[int], filler: list[int], question: list[int],
          blocks: int, block_bytes_hint: int, repeats: int, codec: bool) -> dict:
    from tandem import SamplingParams
    from tandem.engine.async_engine import AddRequest, AsyncLLMEngine
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm import resolve_config

    disk = tempfile.mkdtemp(prefix="tandem-kv-bench-")
    tiers = {"recompute": {}, "host": {"kv_offload_host_bytes": 2 << 30},
             "disk": {"kv_offload_host_bytes": 4 * block_bytes_hint,
                      "kv_offload_disk_path": disk, "kv_offload_disk_bytes": 4 << 30}}[mode]
    eng = AsyncLLMEngine.from_config(resolve_config(EngineConfig(
        dtype="float32", num_kv_blocks=blocks, block_size=16, **tiers)))
    one = SamplingParams(max_tokens=1, temperature=0.0)

    async def run(tag: str, prompt: list[int]) -> float:
        t0 = time.perf_counter()
        ((_, stream),) = await eng.add_many([AddRequest(tag, prompt, one)])
        while not (await stream.get()).finished:
            pass
        return time.perf_counter() - t0

    try:
        out: dict = {}
        if codec:
            asyncio.run(run("c", prefix + question))
            ids = asyncio.run(eng._call(lambda e: [
                e.kv.pool.get_cached_block(h).block_id
                for h in e.kv.pool.cached_hashes()[: len(prefix) // 16]]))
            out["codec"] = asyncio.run(eng._call(lambda e: _codec(e, ids, repeats)))
        times = []
        for i in range(repeats):
            asyncio.run(run(f"w{i}", prefix + question[:3]))  # computed (or loaded)
            asyncio.run(run(f"f{i}", filler))  # evicts the prefix from the device pool
            tiers_ = eng.engine.kv_tiers
            if tiers_ is not None:
                tiers_.flush()
            times.append(asyncio.run(run(f"q{i}", prefix + question)))
        s = eng.engine.stats()
        out.update(mode=mode, ttft_s=[round(t, 4) for t in times],
                   ttft_p50_s=round(statistics.median(times), 4),
                   loaded_tokens=s.kv_connector_loaded_tokens,
                   host_load_s_per_block=s.host_load_s_per_block,
                   disk_load_s_per_block=s.disk_load_s_per_block,
                   kv_block_bytes=s.kv_block_bytes)
        return out
    finally:
        eng.shutdown()
        shutil.rmtree(disk, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefix-tokens", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    n = args.prefix_tokens
    prefix = [1000 + (i * 7919) % 40000 for i in range(n)]
    filler = [2000 + (i * 104729) % 40000 for i in range(n + 64)]
    question = [500 + i for i in range(24)]
    blocks = (n + 64) // 16 + 8  # the filler (or the prefix) fits; not both
    # SmolLM2-135M: 30 layers x (K, V) x 3 KV heads x 16 tokens x 64 x float32
    block_bytes = 30 * 2 * 3 * 16 * 64 * 4
    results = {"machine": platform.processor() or platform.machine(),
               "date": time.strftime("%Y-%m-%d"), "prefix_tokens": n,
               "model": "bundled SmolLM2-135M (float32, CPU)", "device_blocks": blocks}
    for i, mode in enumerate(("recompute", "host", "disk")):
        results[mode] = _ttft(mode, prefix, filler, question, blocks, block_bytes,
                              args.repeats, codec=i == 0)
        print(mode, json.dumps(results[mode]), flush=True)
    text = json.dumps(results, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
