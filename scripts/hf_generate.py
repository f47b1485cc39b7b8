#!/usr/bin/env python
"""Greedy generation with transformers: attn_implementation="tvm_attention" against "sdpa".

A random-weight Llama with GQA (default hidden 512, 8 heads, 2 kv heads, head_dim 64, 4 layers,
float32) generates ``--new-tokens`` tokens greedily from a random prompt of each ``--context``
length, ``--repeat`` times per implementation, interleaved, best kept, after a warm-up generation (so tvm_attention's one-time build,
or disk load, of its dynamic artifact is excluded from the timings and reported on its own).
Both use every available core (``torch.set_num_threads`` and the kernels' TVM threads). Prints:

    context  cache  tokens  tvm s  sdpa s  tvm/sdpa  identical

``identical`` compares the generated token ids (``no @k``: the first position that differs;
float32 rounding of two different attention kernels can flip a near-tie of a random model).

    python scripts/hf_generate.py                       # contexts 32 and 2048, 32 new tokens
    python scripts/hf_generate.py --context 128 --new-tokens 64 --layers 2
    python scripts/hf_generate.py --cache dynamic static   # DynamicCache and StaticCache side by side
"""
from __future__ import annotations

import argparse
import os
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--context", type=int, nargs="+", default=[32, 2048], help="prompt lengths (default 32 2048)")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--repeat", type=int, default=3, help="timed generations per cell, interleaved (the best is kept)")
    ap.add_argument("--threads", type=int, default=None, help="torch and TVM threads (default: every available core)")
    ap.add_argument("--cache-dir", default=None, help="artifact cache (default: the tvm-attention cache)")
    ap.add_argument("--cache", nargs="+", choices=["dynamic", "static"], default=["dynamic"],
                    help="transformers cache(s): dynamic (DynamicCache: the bhsd artifact) and/or static "
                         "(cache_implementation=\"static\": the kvcache artifact reads the cache in place)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tvm_attention.integrations import transformers as hf
    from tvm_attention.target import available_cores

    threads = args.threads or available_cores()
    torch.set_num_threads(threads)
    hf.register(cache_dir=args.cache_dir, num_threads=threads)

    conf = LlamaConfig(hidden_size=args.hidden, intermediate_size=int(args.hidden * 2.75),
                       num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
                       num_hidden_layers=args.layers, vocab_size=args.vocab,
                       max_position_embeddings=max(args.context) + args.new_tokens + 16)
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(conf).to(torch.float32).eval()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"Llama: hidden {args.hidden}, {args.heads} heads / {args.kv_heads} kv heads, head_dim {args.head_dim}, "
          f"{args.layers} layers, vocab {args.vocab} ({n_params / 1e6:.1f} M params), float32, batch {args.batch}; "
          f"{threads} threads (torch and TVM; {hf.SPIN_ENV}={os.environ.get(hf.SPIN_ENV)}); "
          f"artifacts in {hf.artifact_root()}")

    gen = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)

    def generate(impl: str, ids, cache: str = "dynamic") -> tuple[float, "torch.Tensor"]:
        model.set_attn_implementation(impl)
        extra = {"cache_implementation": "static"} if cache == "static" else {}
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, **gen, **extra)
        return time.perf_counter() - t0, out

    # First use: builds the artifact (or loads it from the disk cache), outside the timings.
    hf.reset_stats()
    g = torch.Generator().manual_seed(args.seed + 1)
    warm_ids = torch.randint(3, args.vocab, (args.batch, 8), generator=g)
    model.set_attn_implementation("tvm_attention")
    t0 = time.perf_counter()
    with torch.inference_mode():
        for cache in args.cache:
            model.generate(warm_ids, max_new_tokens=2, min_new_tokens=2, do_sample=False, pad_token_id=0,
                           **({"cache_implementation": "static"} if cache == "static" else {}))
    first = time.perf_counter() - t0
    s = hf.stats()
    how = "built" if s["builds"] else "loaded from the disk cache" if s["loads"] else "already in memory"
    print(f"first use: {first:.2f} s (artifact {how}: {s['builds']} build(s), {s['loads']} load(s))")

    rows = []
    for ctx, cache in [(c, k) for c in args.context for k in args.cache]:
        ids = torch.randint(3, args.vocab, (args.batch, ctx), generator=g)
        impls = ("tvm_attention", "sdpa")
        times, outs = {impl: float("inf") for impl in impls}, {}
        for impl in impls:
            generate(impl, ids[:, : min(ctx, 16)], cache)  # warm-up: allocator, thread pools
        for _ in range(args.repeat):  # interleaved, best of --repeat: robust to a noisy machine
            for impl in impls:
                t, outs[impl] = generate(impl, ids, cache)
                times[impl] = min(times[impl], t)
        a, b = outs["tvm_attention"][:, ctx:], outs["sdpa"][:, ctx:]
        if torch.equal(a, b):
            same = "yes"
        else:
            diff = (a != b).any(dim=0).nonzero()
            same = f"no @{int(diff[0])}" if len(diff) else "no (shape)"
        rows.append((ctx, cache, a.shape[1], times["tvm_attention"], times["sdpa"], same))

    print(f"\n{'context':>8} {'cache':>8} {'tokens':>7} {'tvm s':>9} {'sdpa s':>9} {'tvm/sdpa':>9}  identical")
    for ctx, cache, n, tt, ts, same in rows:
        print(f"{ctx:>8} {cache:>8} {n:>7} {tt:>9.3f} {ts:>9.3f} {tt / ts:>9.2f}  {same}")
    s = hf.stats()
    print(f"\ntvm_attention: {s['builds']} build(s) and {s['loads']} load(s) in all, {s['calls']} attention calls")
    return 0


if __name__ == "__main__":
    sys.exit(main())
