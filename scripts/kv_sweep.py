"""The KV-cache kernel matrices the suite trimmed to covering sets (every value of every axis,
every interacting pair), each build at the knobs the suite used before the trim, against the
float64 reference (``validate_built``: every validation case of the layout, appending kernels
through the reference's append):

* ``kvcache``: tests/test_kvcache.py's configs (GQA, MQA, MHA; split-KV on kvcache GQA and on
  the paged per-head build at 2 kv heads), the unsplit MQA build, the bhsd and varlen lse builds,
  and the page order's paged builds (4 kv heads, one and two heads per task);
* ``kv8``: tests/test_kv8.py's 8-bit caches one spec per feature (sinks beside split-KV and bf16
  queries, every appending kernel on its own, QK_INT8's variants and the AVX2 form with
  split-KV, the six decode_dot kernels and the bf16 cache's preset on its kvcache form);
* ``kv_scales``: tests/test_kv_scales.py's finer scales (the variants without qk_int8, the
  kvcache per-token kernel with split-KV, the appending kernels on their own, the AVX2 group
  form with split-KV, the accuracy report's kernels at their preset);
* ``head_dim_v``: tests/test_head_dim_v.py's value head size in every cache kernel with split-KV
  (the preset), the per-group kernels of both float8 and int8, a score_mod alone.

    python scripts/kv_sweep.py [kvcache|kv8|kv_scales|head_dim_v|all]

Prints one line per case and exits 1 if any case fails. The decode_dot kernels need a CPU with
AVX512-BF16 (skipped elsewhere, as the suite skips them); the AVX2 forms run on every x86-64-v3
host. The decode benchmark's and the serving simulation's kernels at their preset (split-KV),
which their tests build without it, run with ``tvm-attention bench --decode --tiny`` and
``python scripts/sim_serving.py --tiny``.
"""
from __future__ import annotations

import sys

from tvm_attention.artifact import validate_built
from tvm_attention.build import build_kernel
from tvm_attention.spec import AttentionSpec
from tvm_attention.target import resolve_target, target_features

AVX2 = {"kind": "llvm", "mcpu": "x86-64-v3"}
GQA = dict(batch=2, heads=8, kv_heads=2, seq_q=1, seq_kv=300, head_dim=64, causal=True)
B1 = dict(batch=1, heads=8, kv_heads=2, seq_q=1, seq_kv=300, head_dim=64, causal=True)
UNSPLIT = {"split_tasks": 0}
MOD = "def score_mod(s, b, h, q, k):\n    return s - 0.1 * abs(q - k)\n"


def _kvcache():
    def spec(layout, heads, kv_heads, causal=True, **kw):
        fields = dict(batch=2, heads=heads, kv_heads=kv_heads, seq_q=1, seq_kv=256, head_dim=64, causal=causal,
                      layout=layout, return_lse=True)
        return {**fields, **kw}

    yield "kvcache_gqa_causal", spec("kvcache", 8, 2), None, None
    yield "paged_gqa_causal", spec("paged", 8, 2), None, None
    yield "kvcache_mqa_full", spec("kvcache", 4, 1, causal=False), None, None
    yield "kvcache_mqa_full_nosplit", spec("kvcache", 4, 1, causal=False), UNSPLIT, None
    yield "paged_mha_causal_nosplit", spec("paged", 4, 4), UNSPLIT, None
    yield "paged_gqa_per_head_prefetch", spec("paged", 8, 2), {"decode_heads": 1, "prefetch": 2}, None
    yield "bhsd_lse", dict(batch=2, heads=4, kv_heads=2, seq_q=40, seq_kv=70, head_dim=64, causal=True,
                           return_lse=True), None, None
    yield "varlen_lse", dict(batch=2, heads=4, kv_heads=2, seq_q=40, head_dim=64, causal=True, layout="varlen",
                             return_lse=True), None, None
    page_order = dict(batch=1, heads=8, kv_heads=4, seq_q=1, seq_kv=300, head_dim=64, layout="paged", page_size=16)
    yield "paged_page_order_per_head", page_order, {"decode_heads": 1}, None
    yield "paged_page_order_2_heads_prefetch", page_order, {"decode_heads": 2, "prefetch": 1}, None
    yield "paged_page_order_d12", dict(page_order, head_dim=12), None, None


def _kv8(dots: bool):
    yield "kvcache_e4m3_fp32", dict(B1, layout="kvcache", kv_dtype="float8_e4m3fn", return_lse=True), None, None
    yield "paged_e5m2_bf16_sinks", dict(GQA, layout="paged", dtype="bfloat16", kv_dtype="float8_e5m2",
                                        sinks=True), None, None
    yield "paged_int8_fp16_window", dict(batch=1, heads=4, kv_heads=4, seq_q=1, seq_kv=200, head_dim=32,
                                         layout="paged", page_size=64, dtype="float16", kv_dtype="int8",
                                         window=(100, 0)), UNSPLIT, None
    yield "bhsd_e4m3_static", dict(batch=1, heads=2, seq_q=70, seq_kv=45, head_dim=64, kv_dtype="float8_e4m3fn",
                                   causal=True), None, None
    yield "varlen_int8", dict(batch=2, heads=4, kv_heads=2, seq_q=40, seq_kv=40, head_dim=32, layout="varlen",
                              kv_dtype="int8"), None, None
    yield "kvcache_append_bf16", dict(B1, layout="kvcache", dtype="bfloat16", append=True), UNSPLIT, None
    yield "kvcache_append_int8", dict(B1, layout="kvcache", kv_dtype="int8", append=True, return_lse=True), None, None
    yield "paged_append_e4m3", dict(B1, layout="paged", kv_dtype="float8_e4m3fn", append=True), None, None
    yield "paged_append_e5m2_fp16", dict(batch=2, heads=4, kv_heads=4, seq_q=1, seq_kv=100, head_dim=32,
                                         layout="paged", causal=True, dtype="float16", kv_dtype="float8_e5m2",
                                         append=True), UNSPLIT, None
    qk8 = dict(kv_dtype="int8", qk_int8=True)
    yield "qk8_kvcache_f32_split", dict(GQA, layout="kvcache", return_lse=True, **qk8), None, None
    yield "qk8_paged_bf16_append", dict(B1, layout="paged", dtype="bfloat16", append=True, **qk8), UNSPLIT, None
    yield "qk8_kvcache_f16_fma", dict(GQA, heads=4, kv_heads=4, seq_kv=200, layout="kvcache", dtype="float16",
                                      **qk8), {"decode_dot": 0}, None
    yield "qk8_paged_f32_variants_split", dict(GQA, layout="paged", window=(100, 0), softcap=30.0, alibi=True,
                                               sinks=True, return_lse=True, **qk8), None, None
    yield "qk8_paged_f32_avx2_split", dict(GQA, layout="paged", return_lse=True, **qk8), None, AVX2
    if not dots:
        return
    bf16 = dict(dtype="bfloat16")
    yield "dot1_kvcache_int8_split", dict(GQA, layout="kvcache", kv_dtype="int8", return_lse=True, **bf16), \
        {"decode_dot": 1}, None
    yield "dot1_paged_e4m3", dict(GQA, layout="paged", kv_dtype="float8_e4m3fn", return_lse=True, **bf16), \
        {"decode_dot": 1, "split_tasks": 0}, None
    yield "dot1_kvcache_e5m2_append", dict(B1, layout="kvcache", kv_dtype="float8_e5m2", append=True, **bf16), \
        {"decode_dot": 1, "split_tasks": 0}, None
    yield "dot1_paged_int8_mha", dict(GQA, heads=4, kv_heads=4, seq_kv=200, layout="paged", kv_dtype="int8", **bf16), \
        {"decode_dot": 1}, None
    yield "dot2_paged_bf16_split", dict(GQA, layout="paged", return_lse=True, **bf16), {"decode_dot": 2}, None
    yield "dot2_kvcache_e4m3_append", dict(B1, layout="kvcache", kv_dtype="float8_e4m3fn", append=True, **bf16), \
        {"decode_dot": 2, "split_tasks": 0}, None
    yield "dot2_kvcache_bf16_preset", dict(GQA, layout="kvcache", return_lse=True, **bf16), None, None
    yield "dot0_kvcache_bf16", dict(GQA, layout="kvcache", return_lse=True, **bf16), {"decode_dot": 0}, None


def _kv_scales(dots: bool):
    pv_dots = {"decode_dot": 2} if dots else None
    yield "kvcache_token_bf16_pv_dots_split", dict(GQA, layout="kvcache", dtype="bfloat16", kv_dtype="float8_e5m2",
                                                   kv_scale="token"), pv_dots, None
    yield "paged_token_qk8_lse_split", dict(GQA, layout="paged", kv_dtype="int8", kv_scale="token", qk_int8=True,
                                            return_lse=True), None, None
    yield "paged_token_variants", dict(GQA, layout="paged", kv_dtype="int8", kv_scale="token", window=(100, 0),
                                       softcap=30.0, alibi=True, sinks=True), UNSPLIT, None
    yield "kvcache_group_f16_qk8_mha", dict(GQA, heads=4, kv_heads=4, layout="kvcache", dtype="float16",
                                            kv_dtype="int8", kv_scale="group", qk_int8=True), None, None
    yield "paged_group_qk8_append", dict(GQA, layout="paged", dtype="bfloat16", kv_dtype="int8", kv_scale="group",
                                         qk_int8=True, append=True, return_lse=True), UNSPLIT, None
    yield "paged_group_e4m3_bf16", dict(GQA, layout="paged", dtype="bfloat16", kv_dtype="float8_e4m3fn",
                                        kv_scale="group"), UNSPLIT, None
    yield "bhsd_token_e4m3", dict(batch=1, heads=2, seq_q=70, seq_kv=45, head_dim=64, kv_dtype="float8_e4m3fn",
                                  causal=True, kv_scale="token"), None, None
    yield "varlen_group_e5m2", dict(batch=2, heads=4, kv_heads=2, seq_q=40, seq_kv=40, head_dim=64, layout="varlen",
                                    kv_dtype="float8_e5m2", kv_scale="group"), None, None
    yield "append_kvcache_int8_token_split", dict(GQA, layout="kvcache", kv_dtype="int8", kv_scale="token",
                                                  return_lse=True, append=True), None, None
    yield "append_paged_e4m3_group_bf16", dict(GQA, layout="paged", dtype="bfloat16", kv_dtype="float8_e4m3fn",
                                               kv_scale="group", append=True), UNSPLIT, None
    yield "group_dots_avx2_split", dict(GQA, layout="kvcache", dtype="bfloat16", kv_dtype="int8", kv_scale="group",
                                        qk_int8=True), None, AVX2
    # the accuracy report's kernels (bench.kv_accuracy.quick_config, int8), at the preset
    for g in ("head", "token", "group"):
        yield f"accuracy_int8_{g}", dict(B1, seq_kv=256, layout="kvcache", kv_dtype="int8", kv_scale=g), None, None


def _head_dim_v():
    yield "bhsd_192_128", dict(batch=1, heads=2, seq_q=70, seq_kv=45, head_dim=192, head_dim_v=128,
                               causal=True), None, None
    yield "bhsd_variants_f16", dict(batch=1, heads=4, kv_heads=2, seq_q=70, seq_kv=90, head_dim=64, head_dim_v=32,
                                    causal=True, dtype="float16", window=(30, 0), softcap=30.0, alibi=True,
                                    sinks=True), None, None
    yield "bhsd_score_mod", dict(batch=1, heads=4, seq_q=33, seq_kv=40, head_dim=48, head_dim_v=16, causal=True,
                                 kv_start=True, score_mod=MOD), None, None
    dv = dict(batch=2, heads=8, kv_heads=2, seq_q=1, seq_kv=300, causal=True)
    yield "kvcache_bf16", dict(dv, head_dim=128, head_dim_v=64, layout="kvcache", dtype="bfloat16"), None, None
    yield "kvcache_f32", dict(dv, head_dim=128, head_dim_v=64, layout="kvcache"), None, None
    yield "kvcache_int8_qk8_append", dict(dv, head_dim=96, head_dim_v=64, layout="kvcache", kv_dtype="int8",
                                          qk_int8=True, append=True), None, None
    yield "kvcache_e4m3_group", dict(dv, head_dim=128, head_dim_v=64, layout="kvcache", kv_dtype="float8_e4m3fn",
                                     kv_scale="group", dtype="bfloat16"), None, None
    yield "paged_lse", dict(dv, head_dim=96, head_dim_v=64, layout="paged", return_lse=True), None, None
    yield "paged_lse_wider", dict(dv, head_dim=64, head_dim_v=128, layout="paged", return_lse=True), None, None
    yield "paged_token_append", dict(dv, head_dim=64, head_dim_v=32, layout="paged", kv_dtype="int8",
                                     kv_scale="token", append=True), None, None
    yield "paged_group_qk8_append", dict(dv, head_dim=64, head_dim_v=128, layout="paged", kv_dtype="int8",
                                         kv_scale="group", qk_int8=True, append=True, dtype="bfloat16"), None, None
    yield "paged_group_e4m3_append", dict(dv, head_dim=64, head_dim_v=128, layout="paged",
                                          kv_dtype="float8_e4m3fn", kv_scale="group", append=True,
                                          dtype="bfloat16"), None, None


SWEEPS = {"kvcache": lambda dots: _kvcache(), "kv8": _kv8, "kv_scales": _kv_scales,
          "head_dim_v": lambda dots: _head_dim_v()}


def run_case(fields: dict, knobs: dict | None, target) -> tuple[bool, str]:
    b = build_kernel(AttentionSpec(**fields), knobs=knobs, target=resolve_target(target or "llvm"))
    r = validate_built(b)
    ok = bool(b.audit.fused and r.passed and r.finite)
    return ok, (r.format() if b.audit.fused else b.audit.format())


def main(argv: list[str]) -> int:
    which = argv[0] if argv else "all"
    if which not in (*SWEEPS, "all"):
        print(__doc__)
        return 2
    dots = "avx512bf16" in target_features(resolve_target("llvm"))
    failed = 0
    for sweep in SWEEPS if which == "all" else (which,):
        for name, fields, knobs, target in SWEEPS[sweep](dots):
            ok, what = run_case(fields, knobs, target)
            failed += not ok
            print(f"{'PASS' if ok else 'FAIL'}  {sweep} {name}: {what}", flush=True)
    print(f"{failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
