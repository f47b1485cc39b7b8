"""The fused attention PrimFunc for Hopper (``sm_90a``): TMA, mbarriers, ``wgmma`` and warp
specialization — FlashAttention-3's design.

One thread block per (row tile of ``block_m`` queries, head, batch) on ``blockIdx.x/y/z`` (the
longest row tiles first under causal masking), ``128 · (1 + block_m / 64)`` threads in
warpgroups of 128:

* **the producer** (warpgroup 0; it gives its registers back, ``setmaxnreg.dec`` to 24): one
  thread moves tiles with TMA (``cp.async.bulk.tensor.3d``) into 128B-swizzled shared memory —
  the block's Q once, then K and V tile by tile, ``stages`` tiles in flight. Each landing is an
  mbarrier's transaction count (``arrive.expect_tx``); before it refills a stage it waits on that
  stage's *empty* barrier, which every consumer thread arrives on when its products have read
  it. The tensor maps are encoded on the host per call (``runtime.cuTensorMapEncodeTiled``) over
  3-D views ``(head_dim, length, batch·heads)`` with boxes of ``64 × rows × 1``: rows past a
  sequence's end are filled with zeros by TMA, not read from the next head.
* **the consumers** (one warpgroup per 64 query rows, ``setmaxnreg.inc`` to 240): per key tile,
  ``S = Q·Kᵀ`` on ``wgmma.mma_async m64n{block_n}k16`` with both operands read from shared
  memory through descriptors; the online softmax on the accumulator fragments (a row is four
  lanes: max and sum by ``shfl.xor`` 1 and 2); ``O += P·V`` on ``wgmma m64n{head_dim}k16`` with
  P from registers (the f32 accumulator's pairs, rounded to 16 bits, are the A fragment: the
  layouts coincide) and V read transposed from its ``[key][d]`` tile (``imm-trans-b``).
* **ping-pong** (``pingpong``, two consumers): the consumers take turns to *issue* their
  products through two named barriers (``bar.sync`` on its own, ``bar.arrive`` on the other's
  after issuing), so one warpgroup's softmax runs while the other's products occupy the tensor
  cores.
* **intra-warpgroup overlap** (``overlap``): tile j's ``S`` is issued with tile j − 1's ``P·V``,
  the softmax of tile j runs under that product, O is rescaled after it.

Layouts: bhsd (static or symbolic); varlen (a (tile slot, head) grid, each block's sequence
found by a binary search on ``cu_seqlens_q``, TMA boxes of one head's rows at the sequence's
offset); kvcache and paged (a KV head's query heads packed into the tile's rows, Q by a 4-D
box; paged K/V a box per page at its block-table entry). Where a tile's rows past the sequence's
keys are in bounds (the next sequence, stale cache) they are masked, and zeroed in V before
``P·V`` so a NaN there cannot meet a zero P. Split-KV of the KV-cache layouts (``split_tasks``):
a decode step's key tiles in chunks on blockIdx.z, each chunk's unnormalised state to a
workspace, merged by the ``mma.sync`` kernel's merge kernel. An 8-bit cache (e4m3, e5m2, int8,
scaled per KV head): TMA lands its bytes in a staging stage, the producer warpgroup's 128
threads convert them into the swizzled 16-bit stage (``wgmma_layout.CVT_DST``). fp8 inputs
(``spec.q_dtype``: q, K, V e4m3 scaled per head; bhsd and varlen, head_dim 64 and 128): Q and
K go to ``wgmma``'s k32 e4m3 form as they land, V lands in a staging stage and the producer
warpgroup transposes it into ``Vᵀ`` (fp8 wgmma reads no transposed operand) with its keys in
the order of P's registers (``wgmma_layout.VT_KEY``, ``p_byte``), so P is rounded to e4m3 in
place. An appending call's new keys are written into the cache by ``fused_cuda.append_grid``
first. The variants (window, softcap, ALiBi, sinks, ``kv_start``) through the variants' contract.

The addresses, descriptors and fragment layouts come from :mod:`.wgmma_layout` (one source for the
kernel and for the NumPy model that checks them, :mod:`.wgmma_model`). Inputs float16 or
bfloat16, fp32 accumulators; causal masking (bottom-right) with the key-tile loop stopping at
the block's diagonal, the key tail masked, a row that sees no key stores zeros; optional lse.
"""
from __future__ import annotations

import types

from tvm import tirx
from tvm.script import tirx as T

from ..spec import ENTRY, AttentionSpec
from ..visibility import Visibility
from ._math import guarded, lse_of, normalize_where, ssa_checked
from .fused import n_splits
from .fused_cuda import Split, append_grid, cache_tile, chunk_span, merge_grid, plus
from .knob_attrs import CUDA_SPLIT, FUSED_WGMMA, record
from .kv import dim, kv_layout
from .variants import Variants, score_scale
from .variants import transforms as transforms_scores
from .wgmma_layout import (
    CVT_DST,
    ROW_BYTES,
    VT_PERM,
    WARPGROUP,
    WG_ROWS,
    SmemPlan,
    acc_col,
    acc_row,
    empty_parity,
    full_parity,
    p_byte,
    vt_text,
    vt_texts,
    tensor_map,
    tensor_map_gqa,
    tensor_map_packed,
    tensor_map8,
    tensor_map8_paged,
    tensor_map_paged,
)

WGMMA_DTYPES = {"float16": "f16", "bfloat16": "bf16"}
#: the layouts it builds
LAYOUTS = ("bhsd", "varlen", "kvcache", "paged")
#: the layouts it builds fp8 inputs in (``spec.q_dtype``: prefill)
FP8_LAYOUTS = ("bhsd", "varlen")
#: registers a warpgroup keeps after ``setmaxnreg``: the producer's few (an address and a loop),
#: and the consumers' (score and output fragments, 64 + 64 at block_n = head_dim = 128); 24 +
#: 2 × 240 registers × 128 threads fill an SM's 64 K
PRODUCER_REGS = 24
CONSUMER_REGS = 240
#: an 8-bit cache's producer warpgroup also converts each tile to 16 bits (a chunk's 4 words in, 8
#: out, its addresses; bf16 through float): nvcc 13 spilled 8 bytes at 64 (int8 to bf16, D=64,
#: sinks and lse); one consumer and 256 threads leave 128 free (128 + 240 of 256 a thread)
CONVERTER_REGS = 128
#: fp8 inputs: the producer warpgroup transposes each V tile (4 words in, 4 out, their addresses)
#: beside two consumers, whose P is half as wide (four e4m3 a register): 56 + 2 × 224 of 512
TRANSPOSER_REGS = 56
FP8_CONSUMER_REGS = 224
#: the 8-bit caches' 16-bit conversions of 4 elements (one 32-bit word, element 0 in its low
#: byte) into two words of 16-bit pairs, exact for every value (e4m3 and e5m2 by the hardware's
#: cvt, sm_89+; int8 as 1024 + (x + 128) by its bits, less 1152)
_CVT8 = {
    "float8_e4m3fn": ('{.reg .b16 lo, hi;\\nmov.b32 {lo, hi}, %2;\\ncvt.rn.f16x2.e4m3x2 %0, lo;\\n'
                      'cvt.rn.f16x2.e4m3x2 %1, hi;\\n}\\n'),
    "float8_e5m2": ('{.reg .b16 lo, hi;\\nmov.b32 {lo, hi}, %2;\\ncvt.rn.f16x2.e5m2x2 %0, lo;\\n'
                    'cvt.rn.f16x2.e5m2x2 %1, hi;\\n}\\n'),
}


def _setmaxnreg(name: str, op: str, n: int) -> dict[str, str]:
    """The helper ``name``: a warpgroup's registers set to ``n`` (``op``: dec or inc)."""
    return {name: f"""
__device__ __forceinline__ void {name}() {{
  asm volatile("setmaxnreg.{op}.sync.aligned.u32 {n};\\n" ::: "memory");
}}"""}


def cvt_helper(plan: SmemPlan, dtype: str, kv8: str) -> tuple[str, str]:
    """(the kind's short name, the name of the conversion helper) of an 8-bit cache's tiles:
    one name for the helper's source and the producer's call."""
    kind = kv8.split("_")[-1] if kv8 != "int8" else "i8"
    return kind, f"hop_cvt8_{kind}_{WGMMA_DTYPES[dtype]}_{plan.head_dim}_{plan.block_n}"


def _helpers8(plan: SmemPlan, dtype: str, kv8: str) -> dict[str, str]:
    """The device helpers of an 8-bit cache: the producer warpgroup's conversion of a landed tile
    (one source: TVM emits a helper's once, by the name called from TIR) and its registers."""
    ab = WGMMA_DTYPES[dtype]
    BN, D = plan.block_n, plan.head_dim
    if kv8 == "int8":
        word = ("  o0 = __byte_perm(w, 0x64646464u, 0x4140u) ^ 0x00800080u;\n"
                "  o1 = __byte_perm(w, 0x64646464u, 0x4342u) ^ 0x00800080u;\n"
                '  asm("sub.f16x2 %0, %0, %2;\\nsub.f16x2 %1, %1, %2;\\n" : "+r"(o0), "+r"(o1) : "r"(0x64806480u));\n')
    else:
        word = f'  asm("{_CVT8[kv8]}" : "=r"(o0), "=r"(o1) : "r"(w));\n'
    if dtype == "bfloat16":  # exact: every 8-bit value has at most 8 significant bits
        word += ("  { __nv_bfloat162 b0 = __float22bfloat162_rn(__half22float2(*(__half2*)&o0));\n"
                 "    __nv_bfloat162 b1 = __float22bfloat162_rn(__half22float2(*(__half2*)&o1));\n"
                 "    o0 = *(unsigned*)&b0; o1 = *(unsigned*)&b1; }\n")
    kind, cvt = cvt_helper(plan, dtype, kv8)
    dst = {h: CVT_DST.format(cpr=D // 16, slab_bytes=plan.kv_slab(1)).replace("h", str(h)) for h in (0, 1)}
    return {  # the word's conversion, then the tile's loop over it
        cvt: f"""
__device__ __forceinline__ void hop_cvt4_{kind}_{ab}(unsigned w, unsigned& o0, unsigned& o1) {{
  // 4 elements of an {kv8} cache (element 0 in the low byte) as two {ab} pairs
{word}}}

__device__ __forceinline__ void {cvt}(unsigned src, unsigned dst, int t) {{
  // the {kv8} tile TMA landed at src ({BN} rows of {D} bytes) as {ab} into the 128B-swizzled
  // tile at dst, by the warpgroup's 128 threads: chunk i (16 elements) to two 16-byte halves at
  // wgmma_layout.CVT_DST; then visible to the async proxy (wgmma)
  for (unsigned i = t; i < {plan.cvt_chunks}u; i += 128u) {{
    unsigned w[4], o[8];
    asm volatile("ld.shared.v4.u32 {{%0, %1, %2, %3}}, [%4];\\n"
             : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "r"(src + i * 16u) : "memory");
    for (int k = 0; k < 4; ++k) hop_cvt4_{kind}_{ab}(w[k], o[2 * k], o[2 * k + 1]);
    asm volatile("st.shared.v4.u32 [%0], {{%1, %2, %3, %4}};\\n"
             :: "r"(dst + {dst[0]}), "r"(o[0]), "r"(o[1]), "r"(o[2]), "r"(o[3]) : "memory");
    asm volatile("st.shared.v4.u32 [%0], {{%1, %2, %3, %4}};\\n"
             :: "r"(dst + {dst[1]}), "r"(o[4]), "r"(o[5]), "r"(o[6]), "r"(o[7]) : "memory");
  }}
  asm volatile("fence.proxy.async.shared::cta;\\n" ::: "memory");
}}""",
        **_setmaxnreg("hop_regs_converter", "dec", CONVERTER_REGS),
    }


def _helpers_f8(plan: SmemPlan) -> dict[str, str]:
    """fp8 inputs' device helpers: the producer warpgroup's transpose of a V tile into ``Vᵀ``
    (``wgmma_layout.VT_*``), P's packing into e4m3 A fragments (``wgmma_layout.p_byte``) and
    the registers of both roles."""
    BN, D = plan.block_n, plan.head_dim

    def c(text):  # a transpose text as C++ over unsigned ints
        return vt_text(plan, text)

    pg_text, dg_text, key_text, src_text, dst_text = vt_texts(plan)  # head_dim 64: its staging's 64B swizzle
    lo, hi, col_lo, col_hi = (f"0x{x:04x}u" for x in VT_PERM)
    packs = []
    for kk in range(plan.pv_steps):
        for q in range(4):
            b = [p_byte(kk, q, i) for i in range(4)]
            packs.append(f'  asm("{{\\n.reg .b16 lo, hi;\\ncvt.rn.satfinite.e4m3x2.f32 lo, %2, %1;\\n'
                         f'cvt.rn.satfinite.e4m3x2.f32 hi, %4, %3;\\nmov.b32 %0, {{lo, hi}};\\n}}\\n"\n'
                         f'      : "=r"(a[{4 * kk + q}]) : "f"(p[{b[0]}]), "f"(p[{b[1]}]), "f"(p[{b[2]}]), '
                         f'"f"(p[{b[3]}]));\n')
    return {
        f"hop_vt8_{D}_{BN}": f"""
__device__ __forceinline__ void hop_vt8_{D}_{BN}(unsigned src, unsigned dst, int t, int valid) {{
  // the fp8 V tile TMA landed at src (K's layout: {BN} rows of {D} bytes, {plan.span}B-swizzled slabs)
  // as V^T at dst ({D} rows of {BN} keys, K-major 128B-swizzled slabs of 128 keys, the keys in
  // P's register order), by the warpgroup's 128 threads: a lane a 4 x 4 block of bytes an
  // instruction (wgmma_layout.VT_*); keys from `valid` on as zeros (another sequence's); then
  // visible to the async proxy (wgmma)
  unsigned lane = (unsigned)t % 32u;
  for (unsigned n = (unsigned)t / 32u; n < {plan.vt_units // 32}u; n += 4u) {{
    unsigned pg = {c(pg_text)}, dg = {c(dg_text)}, w[4];
    for (unsigned i = 0; i < 4u; ++i) {{
      unsigned key = {c(key_text)};
      asm volatile("ld.shared.u32 %0, [%1];\\n" : "=r"(w[i]) : "r"(src + {c(src_text)}) : "memory");
      if ((int)key >= valid) w[i] = 0u;
    }}
    unsigned a01 = __byte_perm(w[0], w[1], {lo}), a23 = __byte_perm(w[2], w[3], {lo});
    unsigned b01 = __byte_perm(w[0], w[1], {hi}), b23 = __byte_perm(w[2], w[3], {hi});
    unsigned out[4] = {{__byte_perm(a01, a23, {col_lo}), __byte_perm(a01, a23, {col_hi}),
                       __byte_perm(b01, b23, {col_lo}), __byte_perm(b01, b23, {col_hi})}};
    for (unsigned e = 0; e < 4u; ++e) {{
      unsigned d = 4u * dg + e;
      asm volatile("st.shared.u32 [%0], %1;\\n" :: "r"(dst + {c(dst_text)}), "r"(out[e]) : "memory");
    }}
  }}
  asm volatile("fence.proxy.async.shared::cta;\\n" ::: "memory");
}}""",
        f"hop_pack8_{BN}": f"""
__device__ __forceinline__ void hop_pack8_{BN}(unsigned* a, const float* p) {{
  // P's fp32 scores rounded to e4m3 (satfinite), four a register: byte b of register 4·kk + q is
  // score register wgmma_layout.p_byte(kk, q, b) (the A fragment's k order: V^T's keys)
{"".join(packs)}}}""",
        **_setmaxnreg("hop_regs_transposer", "dec", TRANSPOSER_REGS),
        **_setmaxnreg("hop_regs_consumer_f8", "inc", FP8_CONSUMER_REGS),
    }


def _helpers(plan: SmemPlan, dtype: str, consumers: int, kv8: str | None = None) -> dict[str, str]:
    """Device helpers by name (inline PTX), their constants from ``plan``: TVM emits each source
    once per name, so every name carries the shapes it was generated for. fp8 inputs
    (``plan.vt8``): the products on wgmma's k32 e4m3 form, both operands K-major."""
    ab = WGMMA_DTYPES[dtype]
    f8 = plan.vt8
    mma = "e4m3.e4m3" if f8 else f"{ab}.{ab}"
    kstep = "k32" if f8 else "k16"
    trans = "" if f8 else ", 0, 0"  # fp8 wgmma takes no transpose immediates (both K-major)
    BN, D = plan.block_n, plan.head_dim
    ns, no = BN // 2, D // 2  # accumulator registers a thread holds: scores, output
    pack = "__floats2half2_rn" if dtype == "float16" else "__floats2bfloat162_rn"
    ctype = "__half2" if dtype == "float16" else "__nv_bfloat162"
    nthr = consumers * WARPGROUP

    def fence_ops(name, n):
        return "".join(f'  asm volatile("" : "+f"({name}[{i}]) :: "memory");\n' for i in range(n))

    def regs(n, first=0):
        return ", ".join(f"%{first + i}" for i in range(n))

    def outs(name, n):
        return ", ".join(f'"+f"({name}[{i}])' for i in range(n))

    qk_steps = []
    for kk in range(plan.qk_steps):
        qk_steps.append(
            f"  {{ unsigned long long da = {plan.qk_desc_high}ull | ((q + {plan.q_step(kk)}u) >> 4);\n"
            f"    unsigned long long db = {plan.qk_desc_high}ull | ((k + {plan.k_step(kk)}u) >> 4);\n"
            f'    asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{ns + 2}, 0;\\n"\n'
            f'      "wgmma.mma_async.sync.aligned.m64n{BN}{kstep}.f32.{mma} {{{regs(ns)}}}, %{ns}, %{ns + 1}, p, 1, 1'
            f'{trans};\\n}}\\n"\n'
            f'      : {outs("s", ns)} : "l"(da), "l"(db), "r"({int(kk > 0)})); }}\n')
    pv_steps = []
    for kk in range(plan.pv_steps):
        pv_steps.append(
            f"  {{ unsigned long long db = {plan.pv_desc_high}ull | ((v + {plan.v_step(kk)}u) >> 4);\n"
            f'    asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{no + 5}, 0;\\n"\n'
            f'      "wgmma.mma_async.sync.aligned.m64n{D}{kstep}.f32.{mma} {{{regs(no)}}}, '
            f'{{{regs(4, no)}}}, %{no + 4}, p, 1, 1{"" if f8 else ", 1"};\\n}}\\n"\n'
            f'      : {outs("o", no)} : "r"(a[{4 * kk}]), "r"(a[{4 * kk + 1}]), "r"(a[{4 * kk + 2}]), '
            f'"r"(a[{4 * kk + 3}]), "l"(db), "r"(1)); }}\n')
    sfx = f"{'e4m3_' if f8 else ''}{ab}_{D}_{BN}_{plan.block_m}_{plan.stages}"
    extra = _helpers_f8(plan) if f8 else {} if kv8 is None else _helpers8(plan, dtype, kv8)
    return {**extra,
        "hop_smem_base": r"""
__device__ __forceinline__ unsigned hop_smem_base(void* p) {
  // dynamic shared memory is 16-byte aligned; the 128B swizzle's pattern needs 1024
  unsigned s = (unsigned)__cvta_generic_to_shared(p);
  return (s + 1023u) & ~1023u;
}""",
        "hop_mbar_init": r"""
__device__ __forceinline__ void hop_mbar_init(unsigned bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(bar), "r"(count) : "memory");
}""",
        "hop_fence_init": r"""
__device__ __forceinline__ void hop_fence_init() {
  // the barriers' initialization visible to the async proxy (TMA) before any copy names them
  asm volatile("fence.mbarrier_init.release.cluster;\nfence.proxy.async.shared::cta;\n" ::: "memory");
}""",
        "hop_expect": r"""
__device__ __forceinline__ void hop_expect(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" :: "r"(bar), "r"(bytes) : "memory");
}""",
        "hop_tma3d": r"""
__device__ __forceinline__ void hop_tma3d(unsigned dst, unsigned long long tmap, unsigned bar, int c0, int c1, int c2) {
  asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
               " [%0], [%1, {%2, %3, %4}], [%5];\n"
               :: "r"(dst), "l"(tmap), "r"(c0), "r"(c1), "r"(c2), "r"(bar) : "memory");
}""",
        "hop_tma4d": r"""
__device__ __forceinline__ void hop_tma4d(unsigned dst, unsigned long long tmap, unsigned bar, int c0, int c1, int c2,
                                          int c3) {
  asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
               " [%0], [%1, {%2, %3, %4, %5}], [%6];\n"
               :: "r"(dst), "l"(tmap), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar) : "memory");
}""",
        "hop_wait": r"""
__device__ __forceinline__ void hop_wait(unsigned bar, unsigned parity) {
  asm volatile("{\n.reg .pred done;\nHOP_WAIT:\n"
               "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
               "@!done bra HOP_WAIT;\n}\n" :: "r"(bar), "r"(parity) : "memory");
}""",
        "hop_arrive": r"""
__device__ __forceinline__ void hop_arrive(unsigned bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(bar) : "memory");
}""",
        f"hop_bar_sync{nthr}": f"""
__device__ __forceinline__ void hop_bar_sync{nthr}(int id) {{
  asm volatile("bar.sync %0, {nthr};\\n" :: "r"(id) : "memory");
}}""",
        f"hop_bar_arrive{nthr}": f"""
__device__ __forceinline__ void hop_bar_arrive{nthr}(int id) {{
  asm volatile("bar.arrive %0, {nthr};\\n" :: "r"(id) : "memory");
}}""",
        **_setmaxnreg("hop_regs_producer", "dec", PRODUCER_REGS),
        **_setmaxnreg("hop_regs_consumer", "inc", CONSUMER_REGS),
        f"hop_qk_{sfx}": f"""
__device__ __forceinline__ void hop_qk_{sfx}(float* s, unsigned q, unsigned k) {{
  // S (64 x {BN}, this warpgroup's rows) = Q·K^T: {plan.qk_steps} {kstep} steps, both from shared memory
{fence_ops("s", ns)}  asm volatile("wgmma.fence.sync.aligned;\\n" ::: "memory");
{"".join(qk_steps)}  asm volatile("wgmma.commit_group.sync.aligned;\\n" ::: "memory");
}}""",
        f"hop_pack{BN}_{ab}": f"""
__device__ __forceinline__ void hop_pack{BN}_{ab}(unsigned* a, const float* p) {{
  // P's fp32 pairs rounded to 16 bits: register 4·kk + q is the A fragment's a_q of k16 step kk
  for (int i = 0; i < {BN // 4}; ++i) {{
    {ctype} h = {pack}(p[2 * i], p[2 * i + 1]);
    memcpy(&a[i], &h, 4);
  }}
}}""",
        f"hop_pv_{sfx}": f"""
__device__ __forceinline__ void hop_pv_{sfx}(float* o, const unsigned* a, unsigned v) {{
  // O (64 x {D}) += P·V: P from registers (hop_pack), V read transposed from its [key][d] tile
  // (fp8: from V^T, K-major)
{fence_ops("o", no)}  asm volatile("wgmma.fence.sync.aligned;\\n" ::: "memory");
{"".join(pv_steps)}  asm volatile("wgmma.commit_group.sync.aligned;\\n" ::: "memory");
}}""",
        f"hop_wait1_acc{ns}": f"""
__device__ __forceinline__ void hop_wait1_acc{ns}(float* d) {{
  // all but the last committed group done: S = Q·K^T, committed before the P·V still in flight
  asm volatile("wgmma.wait_group.sync.aligned 1;\\n" ::: "memory");
{fence_ops("d", ns)}}}""",
        "hop_zero_rows": r"""
__device__ __forceinline__ void hop_zero_rows(unsigned tile, int slab_bytes, int slabs, int from, int rows, int t) {
  // rows [from, rows) of every 128-byte slab row of a tile, by a warpgroup's 128 threads, 16
  // bytes each; then visible to the async proxy (wgmma) once the warpgroup has synced
  int per_row = 8 * slabs, n = (rows - from) * per_row;
  for (int i = t; i < n; i += 128) {
    unsigned a = tile + (i % per_row) / 8 * slab_bytes + (from + i / per_row) * 128 + (i % 8) * 16;
    asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" :: "r"(a), "r"(0) : "memory");
  }
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}""",
        "hop_wg_sync": r"""
__device__ __forceinline__ void hop_wg_sync(int id) {
  asm volatile("bar.sync %0, 128;\n" :: "r"(id) : "memory");
}""",
        f"hop_wait_acc{ns}": f"""
__device__ __forceinline__ void hop_wait_acc{ns}(float* d) {{
  asm volatile("wgmma.wait_group.sync.aligned 0;\\n" ::: "memory");
{fence_ops("d", ns)}}}""",
        f"hop_wait_acc{no}": f"""
__device__ __forceinline__ void hop_wait_acc{no}(float* d) {{
  asm volatile("wgmma.wait_group.sync.aligned 0;\\n" ::: "memory");
{fence_ops("d", no)}}}""",
    }


class Seq(types.SimpleNamespace):
    """A block's sequence: ``b``, its query rows ``q0`` (first, in the packed layout; 0 in bhsd)
    and ``q_len``, its keys ``k0`` and ``k_len``; ``off``: row i sits at key position i + off
    (bottom-right)."""

    @property
    def off(self):
        return self.k_len - self.q_len


def _context(spec: AttentionSpec, block_m: int, block_n: int, stages: int, pingpong: bool, overlap: bool,
             split_tasks: int = 0):
    """Every constant, index helper and device call of one Hopper kernel, by name."""
    if spec.dtype not in WGMMA_DTYPES:
        raise ValueError(f"the Hopper kernel takes float16 or bfloat16, not {spec.dtype}")
    if spec.layout not in LAYOUTS:
        raise ValueError(f"the Hopper kernel builds the {' and '.join(LAYOUTS)} layouts so far, not {spec.layout}")
    if spec.has_modifiers:  # its masking is its own (the variants' contract hooks are the other kernels')
        raise ValueError("the Hopper kernel does not build the user's modifiers, key bounds or custom masks (yet): "
                         "--schedule fused_tc does")
    packed = spec.layout == "varlen"
    cache = spec.layout in ("kvcache", "paged")  # a KV head's query heads packed into the tile's rows
    # fp8 inputs: q, K, V e4m3 into the products as they are, V transposed by the producer warpgroup
    f8 = spec.q_dtype is not None
    if f8 and (spec.layout not in FP8_LAYOUTS or (spec.head_dim % ROW_BYTES and spec.head_dim != 64)
               or block_n % ROW_BYTES):
        raise ValueError(f"the Hopper kernel reads fp8 inputs (q_dtype) in the {' and '.join(FP8_LAYOUTS)} layouts "
                         f"with head_dim 64 or a multiple of {ROW_BYTES} (the 64B or 128B swizzle's rows) and block_n "
                         f"a multiple of {ROW_BYTES}, got {spec.layout}, head_dim={spec.head_dim}, block_n={block_n}")
    kv8 = None if f8 else spec.kv_dtype  # an 8-bit cache: TMA lands its bytes, the producer warpgroup converts them
    if kv8 is not None and (not cache or spec.kv_scale != "head" or block_m != WG_ROWS):
        raise ValueError("the Hopper kernel reads an 8-bit cache in the kvcache and paged layouts, scaled per KV "
                         "head, with one consumer warpgroup (block_m=64)")
    plan = SmemPlan(spec.head_dim, block_m, block_n, stages, 1 if f8 else spec.itemsize, kv8=kv8 is not None,
                    vt8=f8)
    paged = spec.layout == "paged"
    H, KH, G, D = spec.heads, spec.kv_heads, spec.group_size, spec.head_dim
    if cache and WG_ROWS % G:
        raise ValueError(f"a KV-cache tile packs a KV head's {G} query heads into rows: 64 % group size must be 0")
    ML = tirx.Var("max_len", "int32") if cache else None
    if paged:  # K/V (num_pages, page_size, KH, D), pages by block_table
        PS, NPG, MP = spec.page_size, tirx.Var("num_pages", "int32"), tirx.Var("max_pages", "int32")
        if PS % 8 or (PS % block_n and block_n % PS):
            raise ValueError(f"page_size={PS}: the Hopper kernel loads whole 8-row swizzle groups of pages "
                             f"(a multiple of 8) that tile block_n={block_n} or that it tiles")
        PROWS = min(PS, block_n)  # rows of one TMA box: a page, or a tile's share of one
    nboxes = block_n // PROWS if paged else 1  # TMA boxes of a key tile (per slab)
    if packed:  # lengths per sequence, read from cu_seqlens at run time
        TQ, TK, NB1 = tirx.Var("total_q", "int32"), tirx.Var("total_k", "int32"), tirx.Var("batch_plus_1", "int32")
        B, SQ, SK = NB1 - 1, None, None
    else:
        B, SQ, SK = dim(spec, "batch"), dim(spec, "seq_q"), dim(spec, "seq_kv")
    BM, BN, NS, NC = block_m, block_n, stages, plan.consumers
    if pingpong and NC != 2:
        raise ValueError(f"ping-pong takes two consumer warpgroups (block_m=128), not {NC}")
    if overlap and NS < 2:
        raise ValueError("the intra-warpgroup overlap holds tile j − 1's V while tile j's K lands: stages >= 2")
    THREADS = WARPGROUP * (1 + NC)
    NSR, NOR = BN // 2, D // 2  # a consumer thread's score and output registers
    dtype = spec.dtype
    vis = Visibility.of(spec)
    causal = vis.causal
    # the variants' arguments and hooks (window, softcap, ALiBi, sinks, kv_start); an appending kernel's k_new, v_new
    var = Variants.declare(spec, B, SQ)
    # an 8-bit cache's scales (k_scale, v_scale: per KV head) without a unit: the conversion to
    # 16 bits is exact (the hardware's cvt), not kv_to_f32's e4m3 · 2^-8
    var.unit = 1.0
    transforms = transforms_scores(spec)
    # the scores' factor: with a softcap or ALiBi the hook takes the scaled score and returns log2
    # units (the max is then of those); else the max of the raw scores is scaled once
    qscale = 1.0 if transforms else score_scale(spec)
    neg_inf = T.float32(float("-inf"))
    srcs = _helpers(plan, dtype, NC, kv8)
    sfx = f"{'e4m3_' if f8 else ''}{WGMMA_DTYPES[dtype]}_{D}_{BN}_{BM}_{NS}"
    nthr = NC * WARPGROUP
    isz = plan.itemsize  # of q, K and V as TMA moves them (an 8-bit cache's: its own maps)

    def call(name, *args, ret="void"):
        return T.cuda.func_call(name, *args, source_code=srcs[name], return_type=ret)

    # the grid: (row tile, head, batch); packed: (tile slot, head), sequence b's row tiles in the
    # slots cu_seqlens_q[b] // block_m + b + i (fused_cuda.varlen_grid's numbering)
    nrt = T.floordiv(TQ, BM) + NB1 - 1 if packed else (SQ * (G if cache else 1) + BM - 1) // BM
    # split-KV (a KV cache; fused_cuda.Split, the mma.sync kernel's): while batch · KV heads
    # blocks are fewer than split_tasks and a sequence's rows fit one row tile (a decode step),
    # each sequence's key tiles are split into NSA chunks on blockIdx.z, their partials merged
    # by a second kernel; NSA is 1 (no split) otherwise
    split = Split(n_splits(split_tasks, B, KH), nrt, B, KH, BM, SQ * G, D) if cache and split_tasks else None
    NSA = 1 if split is None else split.active

    # a tile row's query position and head: a KV-cache tile's rows are positions × the KV head's
    # query heads (row = position · G + g), the others' one head's positions
    def pos(row):
        return T.floordiv(row, G) if cache else row

    def head(hh, row):
        return hh * G + T.floormod(row, G) if cache else hh

    def tile_range(seq, row0, start):
        """The block's key tiles ``[first, first + count)``: from the first key its first row may
        see (a left window, the sequence's start) to the last its last row may (causal, a right
        window), within the sequence's keys."""
        begin = vis.key_begin(pos(row0) + seq.off, start)
        first = 0 if begin is None else Visibility.tiles_before(begin, BN)
        end = vis.key_end(pos(row0 + BM - 1) + 1 + seq.off)
        last = (seq.k_len + BN - 1) // BN if end is None else \
            Visibility.tiles_to(T.min(seq.k_len, T.max(end, 0)), BN)
        return first, T.max(last - first, 0)

    lse = bool(spec.return_lse)
    tq = tirx.Var("q_tmap", ty=T.handle("tensormap").ty)
    tk = tirx.Var("k_tmap", ty=T.handle("tensormap").ty)
    tv = tirx.Var("v_tmap", ty=T.handle("tensormap").ty)
    LSE = None if not lse else tirx.decl_buffer((H, TQ) if packed else (B, H, SQ), "float32", "LSE")
    row_in_wg, col_of = acc_row, acc_col

    def needs_mask(seq, j, wrow0, start):
        # tile j holds the key tail, or a key its warpgroup's first row sees past (the diagonal, a
        # right window) or its last row before (a left window, the start)
        lo, hi = j * BN, (j + 1) * BN - 1
        conds = [hi >= seq.k_len, vis.hides(hi, pos(wrow0) + seq.off, start),
                 vis.hides(lo, pos(wrow0 + WG_ROWS - 1) + seq.off, start)]
        conds = [c for c in conds if c is not None]
        return conds[0] if len(conds) == 1 else tirx.Or(conds[0], conds[1] if len(conds) == 2 else
                                                         tirx.Or(conds[1], conds[2]))

    def visible(seq, t, r, j, wrow0, start):
        key = j * BN + col_of(t, r)
        sees = vis.sees(key, pos(wrow0 + row_in_wg(t, r)) + seq.off, start)
        return key < seq.k_len if sees is None else tirx.And(key < seq.k_len, sees)

    def kv_head(hh):  # the block's KV head (hh: a KV-cache tile's KV head, else its query head)
        return hh if cache else hh // G

    def factor(hh, value):
        # a score's factor; an 8-bit cache's key scale folded in, fp8 inputs' q scale too
        if f8:
            return var.q_scaled(hh, var.k_scaled(kv_head(hh), value))
        return var.k_scaled(hh, value) if kv8 is not None else T.float32(value)

    def logit(seq, s, t, r, j, wrow0, hh):
        # a raw score in log2 units through the variants' hook: softcap, then ALiBi's distance
        key = j * BN + col_of(t, r)
        return var.logit(s * factor(hh, score_scale(spec)), lambda: head(hh, wrow0 + row_in_wg(t, r)),
                         lambda: pos(wrow0 + row_in_wg(t, r)) + seq.off - key)

    def o_at(seq, hh, row, col):
        return (seq.q0 + row, hh, col) if packed else (seq.b, head(hh, row), pos(row), col)

    def lse_at(seq, hh, row):
        return (hh, seq.q0 + row) if packed else (seq.b, head(hh, row), pos(row))

    x = types.SimpleNamespace(**locals())
    x.__dict__.update(_tma(x))
    return x


def _tma(x) -> dict:
    """The tensor maps and the coordinates of each TMA box, by layout: bhsd (head_dim, length,
    batch·heads), varlen (head_dim, heads, total) with boxes of one head's rows, a KV cache's Q
    (head_dim, group, positions, batch·kv heads), a page pool (head_dim, kv heads, page rows,
    pages); 64 columns a box."""
    B, BM, BN, D, G, H, KH, isz = x.B, x.BM, x.BN, x.D, x.G, x.H, x.KH, x.isz
    cache, packed, paged, SQ, SK, ML = x.cache, x.packed, x.paged, x.SQ, x.SK, x.ML
    if packed:
        TQ, TK = x.TQ, x.TK
    if paged:
        PS, NPG, PROWS = x.PS, x.NPG, x.PROWS

    if cache:
        maps = ((SQ, B * KH, BM), (NPG, KH, PROWS) if paged else (ML, B * KH, BN))

        def q_coord(seq, row0, hh):  # hh: the KV head
            return 0, T.floordiv(row0, G), seq.b * KH + hh

        def kv_coord(seq, key0, kvh):
            return key0, seq.b * KH + kvh

        def kv_box(seq, key0, kvh, i):
            """A key tile's TMA box ``i`` (of :data:`nboxes`): its coordinates past dim 0. Paged:
            one per page the tile spans, at its block_table entry, or at page −1 past the
            sequence's pages (out of bounds: TMA fills zeros and counts the bytes; no read past
            its table row)."""
            if not paged:
                return kv_coord(seq, key0, kvh)
            idx = T.floordiv(key0, PS) + (i if PS < BN else 0)
            page = T.if_then_else(idx * PS < seq.k_len, seq.bt[seq.b, idx], -1)
            return kvh, T.floormod(key0, PS) if PS > BN else 0, page
    elif packed:
        maps = ((TQ, H, BM), (TK, KH, BN))

        def q_coord(seq, row0, hh):
            return hh, seq.q0 + row0

        def kv_coord(seq, key0, kvh):
            return kvh, seq.k0 + key0

        def kv_box(seq, key0, kvh, i):
            return kv_coord(seq, key0, kvh)
    else:
        maps = ((SQ, B * H, BM), (SK, B * KH, BN))

        def q_coord(seq, row0, hh):
            return row0, seq.b * H + hh

        def kv_coord(seq, key0, kvh):
            return key0, seq.b * KH + kvh

        def kv_box(seq, key0, kvh, i):
            return kv_coord(seq, key0, kvh)

    def tmap_args(rows, planes, box_rows, gqa=False, pages=False, kv8=False):
        if gqa:  # Q of a KV-cache tile: (head_dim, group, positions, batch·kv heads)
            dims, strides, box, el = tensor_map_gqa(D, G, rows, planes, box_rows, isz)
        elif kv8:  # an 8-bit cache: whole rows of head_dim bytes, unswizzled
            dims, strides, box, el = (tensor_map8_paged(D, planes, PS, rows, box_rows) if pages
                                      else tensor_map8(D, rows, planes, box_rows))
        elif pages:  # a page pool: (head_dim, kv heads, page rows, pages)
            dims, strides, box, el = tensor_map_paged(D, planes, PS, rows, box_rows, isz)
        else:  # boxes of the plan's slab rows (fp8 at head_dim 64: 64 bytes, the 64B swizzle)
            dims, strides, box, el = (tensor_map_packed if packed else tensor_map)(D, rows, planes, box_rows, isz,
                                                                                    x.plan.slab_cols)
        return [*dims, *strides, *box, *el]

    return {"maps": maps, "q_coord": q_coord, "kv_box": kv_box, "tmap_args": tmap_args}


def _q_loader(x):
    """The macro ``load_q(sb, seq, row0, hh)``: the block's Q by TMA into its slabs, its bytes on
    Q's full barrier (a KV-cache tile's Q by a 4-D box: (d, group, positions, heads))."""
    call, plan, tq, q_coord = x.call, x.plan, x.tq, x.q_coord
    q_copy = "hop_tma4d" if x.cache else "hop_tma3d"

    @T.macro
    def load_q(sb, seq, row0, hh):
        T.evaluate(call("hop_expect", sb + plan.bar_full_q(), plan.q_bytes))
        for sl in T.unroll(plan.slabs):
            T.evaluate(call(q_copy, sb + plan.q_slab(sl), T.address_of(tq), sb + plan.bar_full_q(),
                            sl * plan.slab_cols, *q_coord(seq, row0, hh)))

    return load_q


def _producer(x):
    """The producer thread's TMA loads: Q once, then K and V tile by tile into their stages."""
    call, plan, tk, tv, NS, BN = x.call, x.plan, x.tk, x.tv, x.NS, x.BN
    kv_box, nboxes = x.kv_box, x.nboxes
    rows = x.PROWS if x.paged else BN  # rows of one box
    kv_copy = "hop_tma4d" if x.paged else "hop_tma3d"  # a page pool: (d, kv heads, page rows, pages)
    load_q = _q_loader(x)

    @T.macro
    def producer(sb, seq, row0, hh, kvh, first, nt):
        # loop tile j is key tile first + j; stages and parities count the loop's tiles
        load_q(sb, seq, row0, hh)
        for j in T.serial(nt):
            if j >= NS:  # the stage's previous tile read by every consumer
                T.evaluate(call("hop_wait", sb + plan.bar_empty(0) + j % NS * 8, empty_parity(j, NS)))
            T.evaluate(call("hop_expect", sb + plan.bar_full_k(0) + j % NS * 8, plan.kv_tile_bytes))
            for sl in T.unroll(plan.slabs):
                for i in T.unroll(nboxes):
                    T.evaluate(call(kv_copy, sb + plan.k_tile(0) + j % NS * plan.kv_tile_bytes + plan.kv_slab(sl)
                                    + i * rows * ROW_BYTES, T.address_of(tk), sb + plan.bar_full_k(0) + j % NS * 8,
                                    sl * plan.slab_cols, *kv_box(seq, (first + j) * BN, kvh, i)))
            T.evaluate(call("hop_expect", sb + plan.bar_full_v(0) + j % NS * 8, plan.kv_tile_bytes))
            for sl in T.unroll(plan.slabs):
                for i in T.unroll(nboxes):
                    T.evaluate(call(kv_copy, sb + plan.v_tile(0) + j % NS * plan.kv_tile_bytes + plan.kv_slab(sl)
                                    + i * rows * ROW_BYTES, T.address_of(tv), sb + plan.bar_full_v(0) + j % NS * 8,
                                    sl * plan.slab_cols, *kv_box(seq, (first + j) * BN, kvh, i)))

    return producer


def _producer8(x):
    """An 8-bit cache's producer warpgroup: its thread 0 loads Q, then each tile's K and V bytes
    by TMA into their staging stage (rows of head_dim bytes); all 128 threads convert a landed
    tile into the 16-bit stage the consumers read (once they have released it), arrive on its full
    barriers, and hand the staging stage back to the next load."""
    call, plan, tk, tv, NS, BN = x.call, x.plan, x.tk, x.tv, x.NS, x.BN
    kv_box, nboxes, D = x.kv_box, x.nboxes, x.D
    rows = x.PROWS if x.paged else BN
    kv_copy = "hop_tma4d" if x.paged else "hop_tma3d"
    cvt = cvt_helper(plan, x.dtype, x.kv8)[1]
    load_q = _q_loader(x)

    @T.macro
    def load8(sb, seq, kvh, first, j):
        # tile j's K and V bytes into staging stage j % NS: one box per page (or the tile)
        T.evaluate(call("hop_expect", sb + plan.bar_full8(0) + j % NS * 8, 2 * plan.kv8_tile_bytes))
        for i in T.unroll(nboxes):
            T.evaluate(call(kv_copy, sb + plan.k8_tile(0) + j % NS * 2 * plan.kv8_tile_bytes + i * rows * D,
                            T.address_of(tk), sb + plan.bar_full8(0) + j % NS * 8, 0,
                            *kv_box(seq, (first + j) * BN, kvh, i)))
            T.evaluate(call(kv_copy, sb + plan.v8_tile(0) + j % NS * 2 * plan.kv8_tile_bytes + i * rows * D,
                            T.address_of(tv), sb + plan.bar_full8(0) + j % NS * 8, 0,
                            *kv_box(seq, (first + j) * BN, kvh, i)))

    @T.macro
    def producer8(sb, seq, row0, hh, kvh, first, nt, t):
        if t == 0:
            load_q(sb, seq, row0, hh)
            for j in T.serial(T.min(nt, NS)):
                load8(sb, seq, kvh, first, j)
        for j in T.serial(nt):
            T.evaluate(call("hop_wait", sb + plan.bar_full8(0) + j % NS * 8, full_parity(j, NS)))
            if j >= NS:  # the 16-bit stage's previous tile read by every consumer
                T.evaluate(call("hop_wait", sb + plan.bar_empty(0) + j % NS * 8, empty_parity(j, NS)))
            T.evaluate(call(cvt, sb + plan.k8_tile(0) + j % NS * 2 * plan.kv8_tile_bytes,
                            sb + plan.k_tile(0) + j % NS * plan.kv_tile_bytes, t))
            T.evaluate(call("hop_arrive", sb + plan.bar_full_k(0) + j % NS * 8))
            T.evaluate(call(cvt, sb + plan.v8_tile(0) + j % NS * 2 * plan.kv8_tile_bytes,
                            sb + plan.v_tile(0) + j % NS * plan.kv_tile_bytes, t))
            T.evaluate(call("hop_arrive", sb + plan.bar_full_v(0) + j % NS * 8))
            T.evaluate(call("hop_wg_sync", 5))  # the staging stage read by all 128 threads
            if t == 0:
                if j + NS < nt:
                    load8(sb, seq, kvh, first, j + NS)

    return producer8


def _producer_f8(x):
    """fp8 inputs' producer warpgroup: its thread 0 loads Q, K tile by tile into the consumers'
    stages (once they released the stage's last tile) and V into a staging stage; all 128 threads
    transpose each landed V tile into the stage's ``Vᵀ`` (``hop_vt8``), arrive on its full
    barrier, and hand the staging stage back to the next load."""
    call, plan, tk, tv, NS, BN = x.call, x.plan, x.tk, x.tv, x.NS, x.BN
    kv_box, packed = x.kv_box, x.packed
    vt = f"hop_vt8_{x.D}_{BN}"
    load_q = _q_loader(x)

    @T.macro
    def load(tmv, dst, bar, seq, kvh, first, j):
        # one tile (K or V) of 128-byte slab rows, its bytes on barrier bar
        T.evaluate(call("hop_expect", bar, plan.kv_tile_bytes))
        for sl in T.unroll(plan.slabs):
            T.evaluate(call("hop_tma3d", dst + plan.kv_slab(sl), T.address_of(tmv), bar, sl * plan.slab_cols,
                            *kv_box(seq, (first + j) * BN, kvh, 0)))

    @T.macro
    def producer_f8(sb, seq, row0, hh, kvh, first, nt, t):
        if t == 0:
            load_q(sb, seq, row0, hh)
            for j in T.serial(T.min(nt, NS)):
                load(tk, sb + plan.k_tile(j), sb + plan.bar_full_k(j), seq, kvh, first, j)
                load(tv, sb + plan.vs_tile(j), sb + plan.bar_full8(j), seq, kvh, first, j)
        for j in T.serial(nt):
            if j >= NS:  # the stage's previous tile read by every consumer: its K, then its V^T
                T.evaluate(call("hop_wait", sb + plan.bar_empty(0) + j % NS * 8, empty_parity(j, NS)))
                if t == 0:
                    load(tk, sb + plan.k_tile(0) + j % NS * plan.kv_tile_bytes, sb + plan.bar_full_k(0) + j % NS * 8,
                         seq, kvh, first, j)
            T.evaluate(call("hop_wait", sb + plan.bar_full8(0) + j % NS * 8, full_parity(j, NS)))
            # keys past the sequence's (packed: the next sequence's rows) transposed as zeros
            T.evaluate(call(vt, sb + plan.vs_tile(0) + j % NS * plan.kv_tile_bytes,
                            sb + plan.v_tile(0) + j % NS * plan.kv_tile_bytes, t,
                            T.min(seq.k_len - (first + j) * BN, BN) if packed else BN))
            T.evaluate(call("hop_arrive", sb + plan.bar_full_v(0) + j % NS * 8))
            T.evaluate(call("hop_wg_sync", 5))  # the staging stage read by all 128 threads
            if t == 0:
                if j + NS < nt:
                    load(tv, sb + plan.vs_tile(0) + j % NS * plan.kv_tile_bytes, sb + plan.bar_full8(0) + j % NS * 8,
                         seq, kvh, first, j + NS)

    return producer_f8


def _softmax(x):
    """The online softmax of one key tile on a consumer thread's score registers: the scores
    masked where needed, the rows' new max, ``alpha = exp2(m_old − m_new)`` into ``al`` (the
    caller rescales O by it once no product is writing O), ``P`` in place of ``S``, the sums."""
    needs_mask, neg_inf, NSR, qscale, visible = x.needs_mask, x.neg_inf, x.NSR, x.qscale, x.visible
    logit, transforms, factor = x.logit, x.transforms, x.factor

    @T.macro
    def softmax(seq, S, m, l, al, t, wrow0, j, hh, start):
        # scores of key tile j: the variants' score hook, then masked where the tile needs it
        if transforms:
            for r in T.unroll(NSR):
                S[r] = logit(seq, S[r], t, r, j, wrow0, hh)
        if needs_mask(seq, j, wrow0, start):
            for r in T.unroll(NSR):
                S[r] = T.Select(visible(seq, t, r, j, wrow0, start), S[r], neg_inf)
        for h in T.unroll(2):
            al[h] = neg_inf
        for r in T.unroll(NSR):
            al[r % 4 // 2] = T.max(al[r % 4 // 2], S[r])
        for h in T.unroll(2):
            # the row's four lanes; scaled once (the scale is positive), the new max in log2 units
            mn: T.float32 = T.max(m[h], T.cuda.warp_max(al[h], 4) * (factor(hh, qscale) if not transforms
                                                                     else T.float32(1.0)))
            al[h] = T.exp2(m[h] - guarded(mn))  # a row with no visible key yet keeps its max at 0
            m[h] = mn
            l[h] = l[h] * al[h]
        for r in T.unroll(NSR):
            S[r] = T.exp2(S[r] * (factor(hh, qscale) if not transforms else T.float32(1.0)) - guarded(m[r % 4 // 2]))
            l[r % 4 // 2] = l[r % 4 // 2] + S[r]

    return softmax


def _epilogue(x, rescale):
    """A consumer's last step, as the macros ``finish`` (the rows' lse, the sink, the normalised
    output; an 8-bit cache's value scale) and ``store_part`` (a split-KV chunk's state)."""
    col_of, dtype, LSE, lse, lse_at, NOR, o_at, row_in_wg, var, vis = \
        x.col_of, x.dtype, x.LSE, x.lse, x.lse_at, x.NOR, x.o_at, x.row_in_wg, x.var, x.vis
    head, pos, kv_head = x.head, x.pos, x.kv_head

    @T.macro
    def finish(seq, O, Oa, m, l, al, t, wrow0, hh):
        # the rows' lse, the sink, the normalised output
        if lse:  # FlashAttention's softmax_lse: without the sink
            if t % 4 == 0:
                for h in T.unroll(2):
                    if pos(wrow0 + row_in_wg(t, 2 * h)) < seq.q_len:
                        LSE[lse_at(seq, hh, wrow0 + row_in_wg(t, 2 * h))] = lse_of(m[h], l[h])
        if var.SK is not None:
            for h in T.unroll(2):  # the sink joins the denominator: (acc·w, l·w + e), w in al
                al[h] = var.sink_terms(m[h], head(hh, wrow0 + row_in_wg(t, 2 * h)))[0]
                l[h] = l[h] * al[h] + var.sink_terms(m[h], head(hh, wrow0 + row_in_wg(t, 2 * h)))[1]
            rescale(Oa, al)
        for r in T.unroll(NOR):
            if pos(wrow0 + row_in_wg(t, r)) < seq.q_len:
                # an 8-bit cache's value scale once per output (v_scaled: Oa itself otherwise)
                O[o_at(seq, hh, wrow0 + row_in_wg(t, r), col_of(t, r))] = T.Cast(dtype, normalize_where(
                    var.v_scaled(Oa[r], kv_head(hh)), l[r % 4 // 2],
                    vis.sees_a_key(pos(wrow0 + row_in_wg(t, r)) + seq.off, seq.k_len, var.start(seq.b))))

    def part_row(row):
        # rows < BM: the workspace holds one row tile (the min says so to TVM's buffer
        # compaction, which would size it by seq_q from the row's extent: fused_cuda.merge_grid)
        return T.min(row, x.BM - 1)

    @T.macro
    def store_part(seq, Op, St, ch, Oa, m, l, t, wrow0, hh):
        # chunk ch's state for the merge kernel: the unnormalised output, the rows' max (log2
        # units) and sum; the lse and the sink are the merge's
        for r in T.unroll(NOR):
            Op[ch, seq.b, hh, part_row(wrow0 + row_in_wg(t, r)), col_of(t, r)] = Oa[r]
        if t % 4 == 0:
            for h in T.unroll(2):
                St[ch, seq.b, hh, part_row(wrow0 + row_in_wg(t, 2 * h)), 0] = m[h]
                St[ch, seq.b, hh, part_row(wrow0 + row_in_wg(t, 2 * h)), 1] = l[h]

    return finish, store_part


def _consumer(x, softmax):
    """A consumer warpgroup: its rows' products, softmax and store. With ``overlap`` (FlashAttention-3's
    intra-warpgroup overlap) tile j's ``S = Q·Kᵀ`` is issued together with tile j − 1's ``O += P·V``
    and the softmax of tile j runs while that product is in flight; O is rescaled after it."""
    (call, dtype, neg_inf, NOR, NS, NSR, nthr, overlap, packed, pingpong, plan, sfx, var) = \
        (x.call, x.dtype, x.neg_inf, x.NOR, x.NS, x.NSR, x.nthr, x.overlap, x.packed, x.pingpong, x.plan, x.sfx, x.var)
    BN, kv_rows = x.BN, plan.kv_slab(1)  # a V tile's bytes per slab
    # V's rows past a sequence's keys are another's, or stale cache (fp8 inputs: the transpose
    # writes them as zeros)
    zero_tail = (packed or x.cache) and not x.f8
    pack = f"hop_pack8_{BN}" if x.f8 else f"hop_pack{BN}_{WGMMA_DTYPES[dtype]}"

    def stage(j):
        return j % NS

    @T.macro
    def turn_begin(wg):
        if pingpong:
            T.evaluate(call(f"hop_bar_sync{nthr}", 1 + wg))

    @T.macro
    def turn_end(wg):
        if pingpong:
            T.evaluate(call(f"hop_bar_arrive{nthr}", 2 - wg))

    @T.macro
    def issue_qk(S, sb, wg, j):
        T.evaluate(call("hop_wait", sb + plan.bar_full_k(0) + stage(j) * 8, full_parity(j, NS)))
        T.evaluate(call(f"hop_qk_{sfx}", S.access_ptr("rw"), sb + plan.q_rows(wg),
                        sb + plan.k_tile(0) + stage(j) * plan.kv_tile_bytes))

    @T.macro
    def issue_pv(Oa, Pk, sb, seq, wg, t, j, key0):
        T.evaluate(call("hop_wait", sb + plan.bar_full_v(0) + stage(j) * 8, full_parity(j, NS)))
        if zero_tail:
            # the rows past the sequence's keys belong to the next sequence (varlen) or hold stale
            # cache: zeros in their place, so that a P of 0 meets no inf or NaN there (TMA fills
            # only past the tensor's end)
            if key0 + BN > seq.k_len:
                T.evaluate(call("hop_zero_rows", sb + plan.v_tile(0) + stage(j) * plan.kv_tile_bytes, kv_rows,
                                plan.slabs, T.max(seq.k_len - key0, 0), BN, t))
                T.evaluate(call("hop_wg_sync", 3 + wg))
        T.evaluate(call(f"hop_pv_{sfx}", Oa.access_ptr("rw"), Pk.access_ptr("r"),
                        sb + plan.v_tile(0) + stage(j) * plan.kv_tile_bytes))

    @T.macro
    def rescale(Oa, al):
        for r in T.unroll(NOR):
            Oa[r] = Oa[r] * al[r % 4 // 2]

    @T.macro
    def release(sb, j):  # tile j's stage read by this thread's products
        T.evaluate(call("hop_arrive", sb + plan.bar_empty(0) + stage(j) * 8))

    finish, store_part = _epilogue(x, rescale)

    @T.macro
    def consumer(sb, seq, O, S, Pk, Oa, m, l, al, tid, row0, hh, first, nt, part):
        # loop tile j is key tile first + j (a window or a start skips the tiles before);
        # part: (chunk, Op, St) of a split-KV grid, or None
        wg = tid // WARPGROUP - 1
        t = tid % WARPGROUP
        wrow0 = row0 + wg * WG_ROWS
        for h in T.unroll(2):
            m[h] = neg_inf
            l[h] = T.float32(0)
        for r in T.unroll(NOR):
            Oa[r] = T.float32(0)
        if pingpong:
            if wg == 1:  # the first turn is consumer 0's
                T.evaluate(call(f"hop_bar_arrive{nthr}", 1))
        T.evaluate(call("hop_wait", sb + plan.bar_full_q(), 0))
        if overlap:
            if nt > 0:
                turn_begin(wg)
                issue_qk(S, sb, wg, 0)
                turn_end(wg)
                T.evaluate(call(f"hop_wait_acc{NSR}", S.access_ptr("rw")))
                softmax(seq, S, m, l, al, t, wrow0, first, hh, var.start(seq.b))  # O is 0: no rescale
                T.evaluate(call(pack, Pk.access_ptr("w"), S.access_ptr("r")))
                for j in T.serial(1, nt):
                    turn_begin(wg)
                    issue_qk(S, sb, wg, j)
                    issue_pv(Oa, Pk, sb, seq, wg, t, j - 1, (first + j - 1) * BN)
                    turn_end(wg)
                    T.evaluate(call(f"hop_wait1_acc{NSR}", S.access_ptr("rw")))
                    softmax(seq, S, m, l, al, t, wrow0, first + j, hh, var.start(seq.b))
                    T.evaluate(call(f"hop_wait_acc{NOR}", Oa.access_ptr("rw")))
                    rescale(Oa, al)
                    release(sb, j - 1)
                    T.evaluate(call(pack, Pk.access_ptr("w"), S.access_ptr("r")))
                turn_begin(wg)
                issue_pv(Oa, Pk, sb, seq, wg, t, nt - 1, (first + nt - 1) * BN)
                turn_end(wg)
                T.evaluate(call(f"hop_wait_acc{NOR}", Oa.access_ptr("rw")))
                release(sb, nt - 1)
        else:
            for j in T.serial(nt):
                turn_begin(wg)
                issue_qk(S, sb, wg, j)
                turn_end(wg)
                T.evaluate(call(f"hop_wait_acc{NSR}", S.access_ptr("rw")))
                softmax(seq, S, m, l, al, t, wrow0, first + j, hh, var.start(seq.b))
                rescale(Oa, al)
                T.evaluate(call(pack, Pk.access_ptr("w"), S.access_ptr("r")))
                turn_begin(wg)
                issue_pv(Oa, Pk, sb, seq, wg, t, j, (first + j) * BN)
                turn_end(wg)
                T.evaluate(call(f"hop_wait_acc{NOR}", Oa.access_ptr("rw")))
                release(sb, j)
        if pingpong:
            if wg == 0:  # consumer 1's last turn handed back: no arrival left pending
                T.evaluate(call(f"hop_bar_sync{nthr}", 1))
        for h in T.unroll(2):  # the row's sum over its four lanes
            l[h] = T.cuda.warp_sum(l[h], 4)
        if part is None:
            finish(seq, O, Oa, m, l, al, t, wrow0, hh)
        elif x.NSA > 1:  # split: a chunk's partials
            store_part(seq, part[1], part[2], part[0], Oa, m, l, t, wrow0, hh)
        else:  # a batch that needs no split (or a chunked prefill): the rows' output itself
            finish(seq, O, Oa, m, l, al, t, wrow0, hh)

    return consumer


def _block(x, producer, consumer):
    """One thread block: its shared memory and registers, the mbarriers' init, then the producer
    warpgroup (its registers given back, one thread loading) and the consumers."""
    BN, call, G, NOR, NS, NSR, nthr, plan, tile_range, var = \
        x.BN, x.call, x.G, x.NOR, x.NS, x.NSR, x.nthr, x.plan, x.tile_range, x.var
    cache, kv8, f8 = x.cache, x.kv8 is not None, x.f8
    producer8 = _producer8(x) if kv8 else None
    producer_f8 = _producer_f8(x) if f8 else None
    # a stage's K (V) is full once its converters (or transposers), or TMA, arrived
    converted_k = WARPGROUP if kv8 else 1
    converted_v = WARPGROUP if kv8 or f8 else 1

    @T.macro
    def block(Q, K, V, O, seq, hh, tid, row0, part=None):
        smem = T.sblock_alloc_buffer((plan.alloc_bytes,), "uint8", scope="shared.dyn")
        S = T.sblock_alloc_buffer((NSR,), "float32", scope="local")
        Oa = T.sblock_alloc_buffer((NOR,), "float32", scope="local")
        m = T.sblock_alloc_buffer((2,), "float32", scope="local")
        l = T.sblock_alloc_buffer((2,), "float32", scope="local")
        al = T.sblock_alloc_buffer((2,), "float32", scope="local")  # alpha
        # P: 16-bit pairs, or e4m3 quads
        Pk = T.sblock_alloc_buffer((BN // (8 if f8 else 4),), "uint32", scope="local")
        # the whole allocation named (a pointer to its element 0 alone let TVM compact it to 1 byte)
        sb: T.uint32 = call("hop_smem_base", smem.access_ptr("rw", extent=plan.alloc_bytes), ret="uint32")
        # the key tiles [first, first + nt) of the block's rows; split, of its chunk part[0]
        # (both kernels' fused_cuda.chunk_span), in registers
        span = T.sblock_alloc_buffer((2,), "int32", scope="local")
        span[0] = tile_range(seq, row0, var.start(seq.b))[0]
        span[1] = tile_range(seq, row0, var.start(seq.b))[1]
        if part is not None:
            span[0] = span[0] + chunk_span(span[1], part[0], x.NSA, BN)[0]
            span[1] = chunk_span(span[1], part[0], x.NSA, BN)[1]
        first = T.meta_var(span[0])
        nt = T.meta_var(span[1])
        if tid == 0:
            T.evaluate(call("hop_mbar_init", sb + plan.bar_full_q(), 1))
            for s in T.unroll(NS):
                T.evaluate(call("hop_mbar_init", sb + plan.bar_full_k(s), converted_k))
                T.evaluate(call("hop_mbar_init", sb + plan.bar_full_v(s), converted_v))
                T.evaluate(call("hop_mbar_init", sb + plan.bar_empty(s), nthr))
                if kv8 or f8:
                    T.evaluate(call("hop_mbar_init", sb + plan.bar_full8(s), 1))
            T.evaluate(call("hop_fence_init"))
        T.tvm_storage_sync("shared")
        if tid < WARPGROUP:
            if kv8:
                T.evaluate(call("hop_regs_converter"))
                producer8(sb, seq, row0, hh, hh, first, nt, tid)
            elif f8:
                T.evaluate(call("hop_regs_transposer"))
                producer_f8(sb, seq, row0, hh, hh // G, first, nt, tid)
            else:
                T.evaluate(call("hop_regs_producer"))
                if tid == 0:
                    producer(sb, seq, row0, hh, hh if cache else hh // G, first, nt)
        else:
            T.evaluate(call("hop_regs_consumer_f8" if f8 else "hop_regs_consumer"))
            consumer(sb, seq, O, S, Pk, Oa, m, l, al, tid, row0, hh, first, nt, part)

    return block


@T.macro
def locate(sq, CQ, CK, slot, NB1, BM: int):
    """Tile slot ``slot``'s sequence (``fused_cuda.varlen_grid``'s numbering: sequence b's row
    tiles take the slots ``cu_seqlens_q[b] // BM + b + i``) by a binary search on ``CQ``: ``sq``
    = (its first row, q0, q_len, k0, k_len, b). A spare slot's first row is past its q_len."""
    sq[0] = 0
    sq[1] = NB1 - 2
    for _ in T.serial(31):  # 31 halvings cover any int32 batch
        if sq[0] < sq[1]:
            if T.floordiv(CQ[T.floordiv(sq[0] + sq[1] + 1, 2)], BM) + T.floordiv(sq[0] + sq[1] + 1, 2) <= slot:
                sq[0] = T.floordiv(sq[0] + sq[1] + 1, 2)
            else:
                sq[1] = T.floordiv(sq[0] + sq[1] + 1, 2) - 1
    sq[5] = sq[0]
    sq[3] = CK[sq[0]]
    sq[4] = CK[sq[0] + 1] - sq[3]
    sq[1] = CQ[sq[0]]
    sq[2] = CQ[sq[0] + 1] - sq[1]
    sq[0] = (slot - T.floordiv(sq[1], BM) - sq[5]) * BM


#: one block an SM: ptxas then knows the registers at entry (65536 / threads) and sizes the
#: consumers' code by setmaxnreg's 240, not by that share
ONE_PER_SM = "tirx.launch_bounds_min_blocks_per_sm"


def _tmaps(x):
    """The macro ``tmaps(Q, K, V)``: the three tensor maps, encoded on the host at each call."""
    dtype, maps, tq, tk, tv, tmap_args, plan = x.dtype, x.maps, x.tq, x.tk, x.tv, x.tmap_args, x.plan
    cache, paged, kv8, f8 = x.cache, x.paged, x.kv8 is not None, x.f8

    @T.macro
    def tmap(tmv, buf, rows, planes, box_rows, gqa=False, pages=False, bytes8=False):
        # a 3-D view (4-D: a KV-cache tile's Q, a page pool), boxes of 128 bytes of columns and
        # box_rows rows, 128B swizzle (wgmma_layout); an 8-bit cache's: whole rows of bytes,
        # unswizzled; fp8 inputs': as 16-bit ones, of bytes
        T.Bind(T.tvm_stack_alloca("tensormap", 1), var=tmv)
        T.tensormap_encode_tiled(tmv, buf.data, *tmap_args(rows, planes, box_rows, gqa, pages, bytes8),
                                 descriptor_dtype="uint8" if bytes8 or f8 else dtype, rank=4 if gqa or pages else 3,
                                 swizzle=0 if bytes8 else plan.tma_swizzle)

    @T.macro
    def tmaps(Q, K, V):
        tmap(tq, Q, *maps[0], cache)
        tmap(tk, K, *maps[1], False, paged, kv8)
        tmap(tv, V, *maps[1], False, paged, kv8)

    return tmaps


def _dense_grid(x, block, tmaps):
    """The macro ``dense_grid(Q, K, V, O, CS, BT)`` of the bhsd and KV-cache layouts: a (row tile,
    head, batch) grid of ``block``; split-KV, its chunks' workspace and the merge kernel; an
    appending call's ``k_new``/``v_new`` written into the cache first (the other CUDA kernels'
    ``fused_cuda.append_grid``, a kernel of its own: TMA then reads what it wrote)."""
    B, BM, BN, D, H, KH, LSE, nrt, SK, SQ, THREADS = \
        x.B, x.BM, x.BN, x.D, x.H, x.KH, x.LSE, x.nrt, x.SK, x.SQ, x.THREADS
    cache, causal, paged, var, split, NSA, spec = x.cache, x.causal, x.paged, x.var, x.split, x.NSA, x.spec
    new = SQ if spec.append else 0  # an appending kernel: each sequence's keys and its new ones

    def grid_block(n, axis):
        return T.thread_binding(n, thread=f"blockIdx.{axis}")

    def lanes(n):
        return T.thread_binding(n, thread="threadIdx.x")

    kvl = kv_layout(spec, B, D) if cache else None  # the merge's and the append's cache indexing
    append = append_grid(spec, grid_block, lanes, kvl, var, B, SQ) if spec.append else None
    fp8 = spec.kv_dtype_name.startswith("float8")  # written as bits (f32_to_kv) through uint8 aliases

    @T.macro
    def tiles(Q, K, V, O, CS, BT, part):
        # a (row tile, head, batch) grid (a KV cache: a KV head's; its length read once into a
        # register); split (part: the workspace), (sequence, chunk) pairs on blockIdx.z
        for bx in T.thread_binding(nrt, thread="blockIdx.x"):
            for hh in T.thread_binding(KH if cache else H, thread="blockIdx.y"):
                for bz in T.thread_binding(B * NSA, thread="blockIdx.z"):
                    for tid in T.thread_binding(THREADS, thread="threadIdx.x"):
                        with T.attr(0, ONE_PER_SM, 1):
                            with T.sblock("tile"):
                                T.reads()
                                T.writes()
                                # the sequence's keys, the sequence and the chunk (truncdiv,
                                # truncmod: non-negative operands)
                                kl = T.sblock_alloc_buffer((3,), "int32", scope="local")
                                kl[1] = T.truncdiv(bz, NSA) if part is not None else bz
                                kl[0] = plus(CS[kl[1]], new) if cache else SK
                                kl[2] = T.truncmod(bz, NSA) if part is not None else 0
                                block(Q, K, V, O, Seq(b=kl[1], q0=0, q_len=SQ, k0=0, k_len=kl[0], bt=BT), hh, tid,
                                      ((nrt - 1 - bx) if causal else bx) * BM,
                                      None if part is None else (kl[2], part[0], part[1]))

    if split is not None:
        def at(b, kh, r, k_len, X):  # the merge reads no K/V: its tile's output and lse indices
            return cache_tile(spec, BM, BN, b, kh, 0, SQ, k_len, kvl, X, LSE, var)

        merge = merge_grid(spec, grid_block, lanes, split, at, LSE, new)

    @T.macro
    def dense_grid(Q, K, V, O, CS, BT):
        tmaps(Q, K, V)
        if append is not None:
            if fp8:
                K8 = T.decl_buffer(K.shape, "uint8", data=K.data)
                V8 = T.decl_buffer(V.shape, "uint8", data=V.data)
                append(K8, V8, (BT, CS) if paged else (CS,))
            else:
                append(K, V, (BT, CS) if paged else (CS,))
        if split is None:
            tiles(Q, K, V, O, CS, BT, None)
        else:
            with T.sblock("split_kv"):
                T.reads()
                T.writes()
                Op = T.sblock_alloc_buffer(split.part_shape, "float32")
                St = T.sblock_alloc_buffer(split.state_shape, "float32")
                tiles(Q, K, V, O, CS, BT, (Op, St))
                merge(Op, St, O, (BT, CS) if paged else (CS,))

    return dense_grid


def fused_attention_wgmma(spec: AttentionSpec, block_m: int, block_n: int, stages: int,
                          pingpong: bool = True, overlap: bool = True, split_tasks: int = 0) -> tirx.PrimFunc:
    """Arguments (call order), ``spec.dtype`` (float16 or bfloat16), compact row-major, 16-byte
    aligned: bhsd ``Q (B, H, Sq, D)``, ``K (B, KH, Skv, D)``, ``V (B, KH, Skv, D)``, the variants'
    arguments, ``O (B, H, Sq, D)``, then ``LSE (B, H, Sq) float32`` with ``spec.return_lse``
    (batch and lengths static or symbolic); varlen ``Q (total_q, H, D)``, ``K``/``V (total_k, KH,
    D)``, ``cu_seqlens_q``/``cu_seqlens_k (batch + 1,) int32``, the variants' arguments, ``O
    (total_q, H, D)``, ``LSE (H, total_q)``; kvcache ``Q (B, H, Sq, D)``, ``K``/``V (B, KH,
    max_len, D)``, ``cache_seqlens (B,) int32``, ``O``; paged ``K``/``V (num_pages, page_size, KH,
    D)``, ``block_table (B, max_pages) int32`` before ``cache_seqlens``. ``split_tasks`` (the
    KV-cache layouts; 0: none): split-KV until the grid has that many blocks, the chunks'
    partials in a workspace the function allocates, merged by a second kernel
    (``fused_cuda.merge_grid``, the mma.sync kernel's)."""
    x = _context(spec, block_m, block_n, stages, pingpong, overlap, split_tasks)
    (B, BM, BN, D, dtype, H, KH, LSE, lse, NS, nrt, packed, SK, SQ, THREADS) = \
        (x.B, x.BM, x.BN, x.D, x.dtype, x.H, x.KH, x.LSE, x.lse, x.NS, x.nrt, x.packed, x.SK, x.SQ, x.THREADS)
    cache, causal, paged, var, split = x.cache, x.causal, x.paged, x.var, x.split
    producer = _producer(x)
    consumer = _consumer(x, _softmax(x))
    block = _block(x, producer, consumer)
    tmaps = _tmaps(x)
    dense_grid = _dense_grid(x, block, tmaps)

    attrs = {"global_symbol": ENTRY, "tirx.noalias": True, "attn.workload": "fused_wgmma",
             **record(FUSED_WGMMA, block_m=BM, block_n=BN, stages=NS, pingpong=int(pingpong), overlap=int(overlap)),
             **record(CUDA_SPLIT, split_tasks=split_tasks if split is not None else 0)}
    kvt = spec.kv_dtype_name  # the cache's dtype (an 8-bit one's bytes go by TMA, unread here)
    qt = spec.q_dtype_name  # q's (fp8 inputs: e4m3, into the products as it is)
    if paged:
        NPG, PS, MP = x.NPG, x.PS, x.MP

        @T.prim_func(s_tir=True, check_well_formed=False)
        def attention_paged(
            Q: T.Buffer((B, H, SQ, D), qt),
            K: T.Buffer((NPG, PS, KH, D), kvt),
            V: T.Buffer((NPG, PS, KH, D), kvt),
            BT: T.Buffer((B, MP), "int32"),
            CS: T.Buffer((B,), "int32"),
            O: T.Buffer((B, H, SQ, D), dtype),
        ):
            T.func_attr(attrs)
            dense_grid(Q, K, V, O, CS, BT)
        func = attention_paged
    elif cache:
        ML = x.ML

        @T.prim_func(s_tir=True, check_well_formed=False)
        def attention_kvcache(
            Q: T.Buffer((B, H, SQ, D), qt),
            K: T.Buffer((B, KH, ML, D), kvt),
            V: T.Buffer((B, KH, ML, D), kvt),
            CS: T.Buffer((B,), "int32"),
            O: T.Buffer((B, H, SQ, D), dtype),
        ):
            T.func_attr(attrs)
            dense_grid(Q, K, V, O, CS, None)
        func = attention_kvcache
    elif packed:
        TQ, TK, NB1 = x.TQ, x.TK, x.NB1

        @T.prim_func(s_tir=True, check_well_formed=False)
        def attention_varlen(
            Q: T.Buffer((TQ, H, D), qt),
            K: T.Buffer((TK, KH, D), kvt),
            V: T.Buffer((TK, KH, D), kvt),
            CQ: T.Buffer((NB1,), "int32"),
            CK: T.Buffer((NB1,), "int32"),
            O: T.Buffer((TQ, H, D), dtype),
        ):
            T.func_attr(attrs)
            tmaps(Q, K, V)
            for bx in T.thread_binding(nrt, thread="blockIdx.x"):
                for hh in T.thread_binding(H, thread="blockIdx.y"):
                    for tid in T.thread_binding(THREADS, thread="threadIdx.x"):
                        with T.attr(0, ONE_PER_SM, 1):
                            with T.sblock("tile"):
                                T.reads()
                                T.writes()
                                # the slot's sequence (first row, q0, q_len, k0, k_len), in registers
                                sq = T.sblock_alloc_buffer((6,), "int32", scope="local")
                                locate(sq, CQ, CK, (nrt - 1 - bx) if causal else bx, NB1, BM)
                                if sq[0] < sq[2]:  # a spare slot computes nothing
                                    block(Q, K, V, O, Seq(b=sq[5], q0=sq[1], q_len=sq[2], k0=sq[3], k_len=sq[4]),
                                          hh, tid, sq[0])
        func = attention_varlen
    else:
        @T.prim_func(s_tir=True, check_well_formed=False)
        def attention(
            Q: T.Buffer((B, H, SQ, D), qt),
            K: T.Buffer((B, KH, SK, D), kvt),
            V: T.Buffer((B, KH, SK, D), kvt),
            O: T.Buffer((B, H, SQ, D), dtype),
        ):
            T.func_attr(attrs)
            dense_grid(Q, K, V, O, None, None)
        func = attention
    if lse or var.buffers:  # the variants' arguments before O, the log-sum-exp after it
        params = list(func.params)
        params = params[:-1] + var.buffers + params[-1:] + ([LSE] if lse else [])
        func = tirx.PrimFunc(params, func.body, func.ret_type, func.attrs)
    # the merge's normalisation (fused_cuda's tile) binds a let per use: made unique
    return ssa_checked(func) if split is not None else func
