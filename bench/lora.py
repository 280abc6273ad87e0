"""Multi-LoRA benchmark: one batch mixing 1, 4 or 16 distinct rank-16 adapters against the
base model alone, in one run.

    .venv/bin/python bench/lora.py [--batch-sizes 16,64] [--adapters 1,4,16] [--rank 16]
        [--prompt-len 128] [--max-tokens 64] [--rounds 3] [--quick] [--out FILE]

On the bundled SmolLM2-135M-Instruct (float32 on CPU), random PEFT adapters of rank `--rank`
on every decoder linear (q, k, v, o, gate, up, down: the costliest case), written to a
temporary directory. Engines, all built first and kept in this one process: `base`
(`enable_lora=False`), `lora-engine` (`enable_lora=True`, 16 slots, every request on the base
model: the cost of the wrapped linears alone) and `lora-N` (N adapters, `max_loras=N`, the
batch's requests assigned round-robin, so every step mixes all N). Each round runs every
engine once per batch size, in order, so slow drift on a noisy machine hits all alike;
the median over rounds is reported.

Per (engine, batch): output tokens/s = b * max_tokens / wall of one `generate` of the whole
batch (prefill included), decode tokens/s = b * (max_tokens - 1) / (that wall - the wall of
the same batch with max_tokens = 1), and their ratio to `base`. `lora-engine` must give
`base`'s greedy tokens exactly (reported; exit code 1 otherwise). Memory: the base weights,
each adapter in host memory, and the device slot stacks (allocated for `max_loras`
adapters up front), against N separate deployments of the base model. Writes the raw
results with machine details to one JSON file.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH / "runners"))
sys.path.insert(0, str(BENCH))

from _common import Timer, log  # noqa: E402

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(out: Path, arch, rank: int, seed: int) -> None:
    """A random PEFT adapter (PEFT's file names and tensor names) for `arch`."""
    import torch
    from safetensors.torch import save_file

    h, inter, hd = arch.hidden_size, arch.intermediate_size, arch.head_dim
    q, kv = arch.num_heads * hd, arch.num_kv_heads * hd
    shapes = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
              "gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(arch.num_layers):
        for t in TARGETS:
            n_out, n_in = shapes[t]
            group = "self_attn" if t in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{i}.{group}.{t}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=gen) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=gen) * 0.02
    out.mkdir(parents=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS),
        "bias": "none", "task_type": "CAUSAL_LM", "lora_dropout": 0.0}))


def prompts(tokenizer, n: int, length: int) -> list[list[int]]:
    """`n` distinct prompts of `length` tokens cut from a fixed text (no shared prefix)."""
    text = " ".join(f"Item {i}: the {w} of the {v} is measured in {u} units, not {x}."
                    for i, (w, v, u, x) in enumerate(zip(
                        ["weight", "length", "price", "speed", "height"] * 400,
                        ["box", "river", "house", "train", "tower", "lamp"] * 400,
                        ["metric", "imperial", "local", "old"] * 600,
                        ["guesses", "rumours", "wishes"] * 800, strict=False)))
    ids = tokenizer.encode(text)
    return [ids[i * 7: i * 7 + length] for i in range(n)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", default="16,64")
    ap.add_argument("--adapters", default="1,4,16")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="batch 4, adapters 1,4, 8 tokens")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.batch_sizes, args.adapters, args.max_tokens, args.rounds = "4", "1,4", 8, 1
        args.prompt_len = 32
    batches = [int(b) for b in args.batch_sizes.split(",") if b]
    counts = [int(n) for n in args.adapters.split(",") if n]

    import torch

    from offline_throughput import _revision, machine_info
    from tandem import LLM, LoRARequest, SamplingParams

    now = dt.datetime.now().astimezone()
    machine = {**machine_info(), "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    log(f"machine: {machine}")
    common = dict(device="cpu", kv_cache_memory=512 << 20, max_num_seqs=max(batches),
                  max_num_batched_tokens=4096)
    engines: dict[str, tuple] = {"base": (LLM(**common), [])}
    arch = engines["base"][0].engine.model.config
    tmp = Path(tempfile.mkdtemp(prefix="tandem-lora-bench-"))
    top = max(counts)
    for i in range(top):
        write_adapter(tmp / f"a{i}", arch, args.rank, seed=i)
    reqs = [LoRARequest(f"a{i}", i + 1, str(tmp / f"a{i}")) for i in range(top)]
    lora_args = dict(enable_lora=True, max_lora_rank=args.rank)
    engines["lora-engine"] = (LLM(**common, **lora_args, max_loras=top), [])
    for n in counts:
        engines[f"lora-{n}"] = (LLM(**common, **lora_args, max_loras=n), reqs[:n])
    tok = engines["base"][0].engine.tokenizer
    pool = prompts(tok, max(batches), args.prompt_len)
    full = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def run(name: str, b: int, sp: SamplingParams) -> tuple[float, list[list[int]], dict]:
        llm, adapters = engines[name]
        lora = [adapters[i % len(adapters)] for i in range(b)] if adapters else None
        with Timer() as t:
            outs = llm.generate(pool[:b], sp, lora_request=lora)
        return t.elapsed, [o.outputs[0].token_ids for o in outs], t.contention()

    for name in engines:  # warm-up: every adapter loaded, every code path run once
        run(name, min(batches), one)
    walls: dict[str, dict[int, dict[str, list[float]]]] = {
        n: {b: {"full": [], "one": []} for b in batches} for n in engines}
    tokens: dict[str, dict[int, list[list[int]]]] = {n: {} for n in engines}
    contention: list[dict] = []
    for r in range(args.rounds):
        for b in batches:
            for name in engines:
                w1, _, _ = run(name, b, one)
                wf, toks, c = run(name, b, full)
                walls[name][b]["one"].append(w1)
                walls[name][b]["full"].append(wf)
                tokens[name][b] = toks
                contention.append({"round": r, "engine": name, "batch": b, **c})
                log(f"round {r} b{b} {name}: {b * args.max_tokens / wf:.1f} tok/s "
                    f"(other CPU {c['other_cpu_share']})")
    results: dict[str, dict] = {}
    for name in engines:
        results[name] = {}
        for b in batches:
            wf = statistics.median(walls[name][b]["full"])
            w1 = statistics.median(walls[name][b]["one"])
            results[name][str(b)] = {
                "wall_s": walls[name][b], "tokens_per_s": b * args.max_tokens / wf,
                "decode_tokens_per_s": b * (args.max_tokens - 1) / max(wf - w1, 1e-9)}
    same = all(tokens["lora-engine"][b] == tokens["base"][b] for b in batches)
    llm16 = engines[f"lora-{top}"][0].engine
    manager = llm16.lora
    memory = {"base_weights_bytes": int(llm16.state.model_memory_bytes),
              "adapter_host_bytes": manager.host[reqs[0].lora_name].nbytes
              if reqs[0].lora_name in manager.host else None,
              "slot_bytes_per_adapter": manager.slot_bytes // manager.num_slots,
              "slot_bytes": {n: engines[f"lora-{n}"][0].engine.lora.slot_bytes
                             for n in counts}}
    report(results, batches, counts, memory, same)
    out = {"benchmark": "lora", "date": now.isoformat(timespec="seconds"),
           "revision": _revision(REPO), "machine": machine,
           "settings": {"batch_sizes": batches, "adapters": counts, "rank": args.rank,
                        "targets": TARGETS, "prompt_len": args.prompt_len,
                        "max_tokens": args.max_tokens, "rounds": args.rounds},
           "lora_engine_equals_base": same, "memory": memory, "results": results,
           "contention": contention}
    path = args.out or BENCH / "results" / f"lora-{now.date().isoformat()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"\nwrote {path}")
    return 0 if same else 1


def report(results: dict, batches: list[int], counts: list[int], memory: dict,
           same: bool) -> None:
    print(f"\n{'engine':<12}{'batch':>6}{'tok/s':>9}{'x base':>8}{'decode':>9}{'x base':>8}")
    for name, per in results.items():
        for b in batches:
            r, base = per[str(b)], results["base"][str(b)]
            print(f"{name:<12}{b:>6}{r['tokens_per_s']:>9.1f}"
                  f"{r['tokens_per_s'] / base['tokens_per_s']:>7.2f}x"
                  f"{r['decode_tokens_per_s']:>9.1f}"
                  f"{r['decode_tokens_per_s'] / base['decode_tokens_per_s']:>7.2f}x")
    mib = 2 ** 20
    w = memory["base_weights_bytes"]
    one = memory["slot_bytes_per_adapter"] / mib
    host = memory["adapter_host_bytes"]
    print(f"\nbase weights {w / mib:.0f} MiB; one adapter: {one:.1f} MiB in a slot"
          + (f", {host / mib:.1f} MiB on the host" if host else ""))
    for n in counts:
        slots = memory["slot_bytes"][n]
        print(f"  {n:>2} adapters: weights + slots {(w + slots) / mib:.0f} MiB vs {n} "
              f"deployments {n * w / mib:.0f} MiB ({n * w / (w + slots):.1f}x less)")
    print(f"lora-engine greedy tokens equal base: {same}")
    top = max(counts)
    for b in batches:
        x = results[f"lora-{top}"][str(b)]["tokens_per_s"] / results["base"][str(b)][
            "tokens_per_s"]
        print(f"target lora-{top} b{b} >= 0.7x base: {x:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
