#!/usr/bin/env python3
"""A decode step's product forms side by side: each cache's preset against the vector forms the
AMX preset replaced (issue 63), GQA 32:8 D128, bf16 queries, one new token per sequence.

    python scripts/decode_forms.py [BATCHxCACHE ...]     (default 60x4096 15x16384 4x4096 1x16384)

Builds (once) a bf16 and an int8 ``qk_int8`` cache, kvcache and paged (pages of 16), at the
preset and at the forms named in :data:`FORMS`; then per point times every build alternately
(``ROUNDS`` rounds, best of each) between two streaming-read measurements, and prints the step,
its GB/s and its fraction of the larger roof, then the ratios the issue judges: int8 over bf16
(step time), paged over kvcache (speed) and each preset over its vector form. A form this CPU
cannot build (no AMX, no VNNI) is said and left out. Measured figures: docs/results/decode.md.
"""
from __future__ import annotations

import json
import sys

import ml_dtypes
import numpy as np
import tvm
from tvm_attention.schedules._knobs import KnobError

from tvm_attention.bench.bandwidth import stream_read_gbps
from tvm_attention.bench.decode import _tvm_timer, kv_bytes
from tvm_attention.build import build_kernel
from tvm_attention.layouts import paged_from_contiguous
from tvm_attention.quant import quantize_kv
from tvm_attention.spec import AttentionSpec
from tvm_attention.threads import set_num_threads

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
ROUNDS = 6
#: the vector forms the AMX preset replaced: float32 products (bf16), VNNI's QKᵀ (int8)
VECTOR = {"bf16": {"decode_dot": 0, "decode_heads": 2, "decode_block_n": 0},
          "int8": {"decode_dot": 3, "decode_heads": 8, "decode_block_n": 0}}
PAGED_VECTOR = {"decode_dot": 0, "decode_heads": 8, "decode_block_n": 0}
#: (cache, layout, knobs: None for the preset)
FORMS = [("bf16", "kvcache", None), ("bf16", "kvcache", VECTOR["bf16"]), ("bf16", "paged", None),
         ("bf16", "paged", PAGED_VECTOR), ("int8", "kvcache", None), ("int8", "kvcache", VECTOR["int8"]),
         ("int8", "paged", None)]
DEFAULT_POINTS = ("60x4096", "15x16384", "4x4096", "1x16384")


def _spec(cache: str, layout: str) -> AttentionSpec:
    int8 = cache == "int8"
    return AttentionSpec(batch=1, heads=HEADS, kv_heads=KV_HEADS, seq_q=1, seq_kv=1024, head_dim=HEAD_DIM,
                         layout=layout, causal=True, dtype="bfloat16", page_size=PAGE if layout == "paged" else None,
                         kv_dtype="int8" if int8 else None, qk_int8=int8)


def _name(form) -> str:
    return f"{form[0]} {form[1]} {'preset' if form[2] is None else json.dumps(form[2])}"


def build_forms(say=print) -> dict:
    """Every form of :data:`FORMS` this CPU can build, by name."""
    built = {}
    for form in FORMS:
        try:
            b = build_kernel(_spec(form[0], form[1]), knobs=form[2], cache=True)
        except KnobError as e:
            say(f"{_name(form)}: not built here: {e}")
            continue
        k = b.knobs
        say(f"{_name(form)}: decode_dot={k.decode_dot}, {k.decode_heads} kv heads a task, {k.decode_tile}-key tiles")
        built[_name(form)] = (form, b)
    return built


def _args(form, b, q, caches, lens, o):
    (k, v), scales = caches[form[0]]
    if form[1] == "paged":
        k, table = paged_from_contiguous(k, PAGE, np.random.default_rng(1))
        v, _ = paged_from_contiguous(v, PAGE, np.random.default_rng(1))
        return [tvm.runtime.tensor(x) for x in (q, k, v, table, lens, *scales, o)]
    return [tvm.runtime.tensor(x) for x in (q, k, v, lens, *scales, o)]


def point(built: dict, batch: int, cache: int, rounds: int = ROUNDS, min_repeat_ms: int = 300, say=print) -> dict:
    """One (batch, cache) point: every build's best step (s), alternated, and the roof (GB/s)."""
    rng = np.random.default_rng(0)
    bf = ml_dtypes.bfloat16
    q = rng.standard_normal((batch, HEADS, 1, HEAD_DIM), dtype=np.float32).astype(bf)
    k, v = (rng.standard_normal((batch, KV_HEADS, cache, HEAD_DIM), dtype=np.float32) for _ in range(2))
    (k8, ks), (v8, vs) = (quantize_kv(x, "int8") for x in (k, v))
    caches = {"bf16": ((k.astype(bf), v.astype(bf)), []), "int8": ((k8, v8), [ks, vs])}
    del k, v
    lens, o = np.full(batch, cache, np.int32), np.empty((batch, HEADS, 1, HEAD_DIM), bf)
    timers = {n: _tvm_timer(b, _args(form, b, q, caches, lens, o), min_repeat_ms) for n, (form, b) in built.items()}
    roof = [stream_read_gbps()]
    best = {n: float("inf") for n in timers}
    for r in range(rounds):
        for n in (list(timers) if r % 2 == 0 else list(reversed(timers))):
            best[n] = min(best[n], timers[n]())
    roof.append(stream_read_gbps())
    top = max(roof)
    say(f"== B{batch} x {cache}: stream read {roof[0]:.1f} / {roof[1]:.1f} GB/s")
    for n, t in best.items():
        nbytes = kv_bytes(batch, KV_HEADS, cache, HEAD_DIM, 1 if n.startswith("int8") else 2)
        say(f"  {n:70s} {t * 1e3:8.3f} ms {nbytes / t / 1e9:6.1f} GB/s {nbytes / t / 1e9 / top * 100:5.1f} %")
    ratios = {}

    def ratio(label, a, b):
        if a in best and b in best:
            ratios[label] = best[a] / best[b]

    pre = {(c, lay): _name((c, lay, None)) for c in ("bf16", "int8") for lay in ("kvcache", "paged")}
    ratio("int8 / bf16 step", pre["int8", "kvcache"], pre["bf16", "kvcache"])
    ratio("paged / kvcache speed, bf16", pre["bf16", "kvcache"], pre["bf16", "paged"])
    ratio("paged / kvcache speed, int8", pre["int8", "kvcache"], pre["int8", "paged"])
    ratio("bf16 kvcache preset over vectors", _name(("bf16", "kvcache", VECTOR["bf16"])), pre["bf16", "kvcache"])
    ratio("bf16 paged preset over vectors", _name(("bf16", "paged", PAGED_VECTOR)), pre["bf16", "paged"])
    ratio("int8 kvcache preset over VNNI", _name(("int8", "kvcache", VECTOR["int8"])), pre["int8", "kvcache"])
    say("  " + "; ".join(f"{k} {v:.2f}" for k, v in ratios.items()))
    return {"best_s": best, "roof_gbps": roof, "ratios": ratios}


def main(argv: list[str]) -> int:
    set_num_threads(2)
    points = [tuple(int(x) for x in p.split("x")) for p in (argv or DEFAULT_POINTS)]
    built = build_forms()
    for batch, cache in points:
        point(built, batch, cache)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
