"""Hugging Face transformers ``generate`` baseline for the offline throughput benchmark.

    .venv/bin/python bench/runners/hf_runner.py WORKLOAD_JSON [--batch-size 16] [--threads 2]

Loads the bundled SmolLM2 GGUF with transformers (dequantized to float32) and processes the
requests in submission order (nothing is sorted) in static batches of 16, left-padded.  A
static batch decodes until its longest member is done: ``max_new_tokens`` (and
``min_new_tokens``) is the batch's largest ``max_tokens``; only each request's own
``max_tokens`` count as useful output.  EOS never stops generation (``ignore_eos``): the
generation config's ``eos_token_id`` is cleared, so greedy picks stay comparable with the
other engines (suppressing EOS via ``min_new_tokens`` alone would change the argmax whenever
EOS wins).
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))

from _common import Timer, emit, load_requests, loadavg, log, make_result  # noqa: E402


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("workload")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = all cores)")
    args = ap.parse_args(argv[1:])

    import os

    import torch
    import transformers

    from export_hf import bundled_gguf_path, load_gguf_model

    threads = args.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    meta, requests = load_requests(args.workload)

    with Timer() as load:
        model = load_gguf_model(bundled_gguf_path(), dtype=torch.float32)
        model.eval()
        gen_cfg = copy.deepcopy(model.generation_config)
        pad_id = gen_cfg.pad_token_id
        if pad_id is None:
            pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
        gen_cfg.pad_token_id = pad_id
        gen_cfg.eos_token_id = None  # ignore_eos: nothing stops a sequence early
        gen_cfg.do_sample = False
        for attr in ("temperature", "top_p", "top_k"):
            setattr(gen_cfg, attr, None)

        def run_batch(batch: list[tuple[list[int], int]]) -> tuple[list[list[int]], int]:
            width = max(len(p) for p, _ in batch)
            ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, (p, _) in enumerate(batch):
                ids[row, width - len(p):] = torch.tensor(p, dtype=torch.long)
                mask[row, width - len(p):] = 1
            new = max(mt for _, mt in batch)
            with torch.inference_mode():
                out = model.generate(input_ids=ids, attention_mask=mask,
                                     generation_config=gen_cfg,
                                     max_new_tokens=new, min_new_tokens=new)
            gen = out[:, width:].tolist()
            return [row[:mt] for row, (_, mt) in zip(gen, batch, strict=True)], out.shape[1] - width

        run_batch([([100, 200, 300, 400], 2)])  # warm-up, excluded
    log(f"[hf] loaded in {load.elapsed:.1f}s, torch threads={torch.get_num_threads()}")

    token_ids: list[list[int]] = []
    decoded_steps = 0
    before = loadavg()
    with Timer() as gen:
        for start in range(0, len(requests), args.batch_size):
            batch = requests[start:start + args.batch_size]
            outs, steps = run_batch(batch)
            decoded_steps += steps * len(batch)
            token_ids.extend(outs)
            log(f"[hf] batch {start // args.batch_size}: {len(batch)} reqs, {steps} steps")
    log(f"[hf] generated in {gen.elapsed:.1f}s")

    result = make_result(
        "hf", requests, token_ids, gen.elapsed, load.elapsed,
        threads=torch.get_num_threads(),
        loadavg_before=before,
        timer=gen,
        engine_version=transformers.__version__,
        torch_version=torch.__version__,
        config={"batch_size": args.batch_size, "padding": "left", "dtype": "float32",
                "decoded_tokens_incl_padding_steps": decoded_steps},
        workload=meta.get("name"),
    )
    emit(result)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
