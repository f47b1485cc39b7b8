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

The addresses, descriptors and fragment layouts come from :mod:`.wgmma_layout` (one source for the
kernel and for the NumPy model that checks them, :mod:`.wgmma_model`). Inputs float16 or
bfloat16, fp32 accumulators; static or symbolic batch and lengths; causal masking (bottom-right)
with the key-tile loop stopping at the block's diagonal, the key tail masked, a row that sees no
key stores zeros; optional lse.
"""
from __future__ import annotations

import types

from tvm import tirx
from tvm.script import tirx as T

from ..spec import ENTRY, AttentionSpec
from ..visibility import Visibility
from ._math import guarded, lse_of, normalize_where
from .knob_attrs import FUSED_WGMMA, record
from .kv import dim
from .variants import Variants, score_scale
from .variants import transforms as transforms_scores
from .wgmma_layout import (
    SLAB_COLS,
    TMA_SWIZZLE_128B,
    WARPGROUP,
    WG_ROWS,
    SmemPlan,
    acc_col,
    acc_row,
    empty_parity,
    full_parity,
    tensor_map,
)

WGMMA_DTYPES = {"float16": "f16", "bfloat16": "bf16"}
#: registers a warpgroup keeps after ``setmaxnreg``: the producer's few (an address and a loop),
#: and the consumers' (score and output fragments, 64 + 64 at block_n = head_dim = 128); 24 +
#: 2 × 240 registers × 128 threads fill an SM's 64 K
PRODUCER_REGS = 24
CONSUMER_REGS = 240


def _helpers(plan: SmemPlan, dtype: str, consumers: int) -> dict[str, str]:
    """Device helpers by name (inline PTX), their constants from ``plan``: TVM emits each source
    once per name, so every name carries the shapes it was generated for."""
    ab = WGMMA_DTYPES[dtype]
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
            f'      "wgmma.mma_async.sync.aligned.m64n{BN}k16.f32.{ab}.{ab} {{{regs(ns)}}}, %{ns}, %{ns + 1}, p, 1, 1, 0, 0;\\n}}\\n"\n'
            f'      : {outs("s", ns)} : "l"(da), "l"(db), "r"({int(kk > 0)})); }}\n')
    pv_steps = []
    for kk in range(plan.pv_steps):
        pv_steps.append(
            f"  {{ unsigned long long db = {plan.pv_desc_high}ull | ((v + {plan.v_step(kk)}u) >> 4);\n"
            f'    asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{no + 5}, 0;\\n"\n'
            f'      "wgmma.mma_async.sync.aligned.m64n{D}k16.f32.{ab}.{ab} {{{regs(no)}}}, '
            f'{{{regs(4, no)}}}, %{no + 4}, p, 1, 1, 1;\\n}}\\n"\n'
            f'      : {outs("o", no)} : "r"(a[{4 * kk}]), "r"(a[{4 * kk + 1}]), "r"(a[{4 * kk + 2}]), '
            f'"r"(a[{4 * kk + 3}]), "l"(db), "r"(1)); }}\n')
    sfx = f"{ab}_{D}_{BN}_{plan.block_m}_{plan.stages}"
    return {
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
        "hop_regs_producer": f"""
__device__ __forceinline__ void hop_regs_producer() {{
  asm volatile("setmaxnreg.dec.sync.aligned.u32 {PRODUCER_REGS};\\n" ::: "memory");
}}""",
        "hop_regs_consumer": f"""
__device__ __forceinline__ void hop_regs_consumer() {{
  asm volatile("setmaxnreg.inc.sync.aligned.u32 {CONSUMER_REGS};\\n" ::: "memory");
}}""",
        f"hop_qk_{sfx}": f"""
__device__ __forceinline__ void hop_qk_{sfx}(float* s, unsigned q, unsigned k) {{
  // S (64 x {BN}, this warpgroup's rows) = Q·K^T: {plan.qk_steps} k16 steps, both from shared memory
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
{fence_ops("o", no)}  asm volatile("wgmma.fence.sync.aligned;\\n" ::: "memory");
{"".join(pv_steps)}  asm volatile("wgmma.commit_group.sync.aligned;\\n" ::: "memory");
}}""",
        f"hop_wait1_acc{ns}": f"""
__device__ __forceinline__ void hop_wait1_acc{ns}(float* d) {{
  // all but the last committed group done: S = Q·K^T, committed before the P·V still in flight
  asm volatile("wgmma.wait_group.sync.aligned 1;\\n" ::: "memory");
{fence_ops("d", ns)}}}""",
        f"hop_wait_acc{ns}": f"""
__device__ __forceinline__ void hop_wait_acc{ns}(float* d) {{
  asm volatile("wgmma.wait_group.sync.aligned 0;\\n" ::: "memory");
{fence_ops("d", ns)}}}""",
        f"hop_wait_acc{no}": f"""
__device__ __forceinline__ void hop_wait_acc{no}(float* d) {{
  asm volatile("wgmma.wait_group.sync.aligned 0;\\n" ::: "memory");
{fence_ops("d", no)}}}""",
    }


def _context(spec: AttentionSpec, block_m: int, block_n: int, stages: int, pingpong: bool, overlap: bool):
    """Every constant, index helper and device call of one Hopper kernel, by name."""
    if spec.dtype not in WGMMA_DTYPES:
        raise ValueError(f"the Hopper kernel takes float16 or bfloat16, not {spec.dtype}")
    if spec.layout != "bhsd":
        raise ValueError(f"the Hopper kernel builds the bhsd layout so far, not {spec.layout}")
    plan = SmemPlan(spec.head_dim, block_m, block_n, stages, spec.itemsize)
    B, H, KH, G = dim(spec, "batch"), spec.heads, spec.kv_heads, spec.group_size
    SQ, SK, D = dim(spec, "seq_q"), dim(spec, "seq_kv"), spec.head_dim
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
    var = Variants.declare(spec, B)  # the variants' arguments and hooks (window, softcap, ALiBi, sinks, kv_start)
    transforms = transforms_scores(spec)
    # the scores' factor: with a softcap or ALiBi the hook takes the scaled score and returns log2
    # units (the max is then of those); else the max of the raw scores is scaled once
    qscale = 1.0 if transforms else score_scale(spec)
    neg_inf = T.float32(float("-inf"))
    srcs = _helpers(plan, dtype, NC)
    sfx = f"{WGMMA_DTYPES[dtype]}_{D}_{BN}_{BM}_{NS}"
    nthr = NC * WARPGROUP

    def call(name, *args, ret="void"):
        return T.cuda.func_call(name, *args, source_code=srcs[name], return_type=ret)

    nrt = (SQ + BM - 1) // BM  # row tiles
    off = vis.offset(SQ, SK)  # row i sits at key position i + off (bottom-right)

    def tile_range(row0, start):
        """The block's key tiles ``[first, first + count)``: from the first key its first row may
        see (a left window, the sequence's start) to the last its last row may (causal, a right
        window), within the keys."""
        begin = vis.key_begin(row0 + off, start)
        first = 0 if begin is None else Visibility.tiles_before(begin, BN)
        end = vis.key_end(row0 + BM + off)
        last = (SK + BN - 1) // BN if end is None else Visibility.tiles_to(T.min(SK, T.max(end, 0)), BN)
        return first, T.max(last - first, 0)

    lse = bool(spec.return_lse)
    tq = tirx.Var("q_tmap", ty=T.handle("tensormap").ty)
    tk = tirx.Var("k_tmap", ty=T.handle("tensormap").ty)
    tv = tirx.Var("v_tmap", ty=T.handle("tensormap").ty)
    isz = spec.itemsize
    LSE = tirx.decl_buffer((B, H, SQ), "float32", "LSE") if lse else None
    row_in_wg, col_of = acc_row, acc_col

    def needs_mask(j, wrow0, start):
        # tile j holds the key tail, or a key its warpgroup's first row sees past (the diagonal, a
        # right window) or its last row before (a left window, the start)
        lo, hi = j * BN, (j + 1) * BN - 1
        conds = [hi >= SK, vis.hides(hi, wrow0 + off, start), vis.hides(lo, wrow0 + WG_ROWS - 1 + off, start)]
        conds = [c for c in conds if c is not None]
        return conds[0] if len(conds) == 1 else tirx.Or(conds[0], conds[1] if len(conds) == 2 else
                                                         tirx.Or(conds[1], conds[2]))

    def visible(t, r, j, wrow0, start):
        key = j * BN + col_of(t, r)
        sees = vis.sees(key, wrow0 + row_in_wg(t, r) + off, start)
        return key < SK if sees is None else tirx.And(key < SK, sees)

    def logit(s, t, r, j, wrow0, hh):
        # a raw score in log2 units through the variants' hook: softcap, then ALiBi's distance
        key = j * BN + col_of(t, r)
        return var.logit(s * T.float32(score_scale(spec)), lambda: hh, lambda: wrow0 + row_in_wg(t, r) + off - key)

    return types.SimpleNamespace(**locals())


def _producer(x):
    """The producer thread's TMA loads: Q once, then K and V tile by tile into their stages."""
    call, plan, tq, tk, tv, NS, BN = x.call, x.plan, x.tq, x.tk, x.tv, x.NS, x.BN

    @T.macro
    def producer(sb, row0, bh, kvh, first, nt):
        # loop tile j is key tile first + j; stages and parities count the loop's tiles
        T.evaluate(call("hop_expect", sb + plan.bar_full_q(), plan.q_bytes))
        for sl in T.unroll(plan.slabs):
            T.evaluate(call("hop_tma3d", sb + plan.q_slab(sl), T.address_of(tq), sb + plan.bar_full_q(),
                            sl * SLAB_COLS, row0, bh))
        for j in T.serial(nt):
            if j >= NS:  # the stage's previous tile read by every consumer
                T.evaluate(call("hop_wait", sb + plan.bar_empty(0) + j % NS * 8, empty_parity(j, NS)))
            T.evaluate(call("hop_expect", sb + plan.bar_full_k(0) + j % NS * 8, plan.kv_tile_bytes))
            for sl in T.unroll(plan.slabs):
                T.evaluate(call("hop_tma3d", sb + plan.k_tile(0) + j % NS * plan.kv_tile_bytes + plan.kv_slab(sl),
                                T.address_of(tk), sb + plan.bar_full_k(0) + j % NS * 8, sl * SLAB_COLS, (first + j) * BN,
                                kvh))
            T.evaluate(call("hop_expect", sb + plan.bar_full_v(0) + j % NS * 8, plan.kv_tile_bytes))
            for sl in T.unroll(plan.slabs):
                T.evaluate(call("hop_tma3d", sb + plan.v_tile(0) + j % NS * plan.kv_tile_bytes + plan.kv_slab(sl),
                                T.address_of(tv), sb + plan.bar_full_v(0) + j % NS * 8, sl * SLAB_COLS, (first + j) * BN,
                                kvh))

    return producer


def _softmax(x):
    """The online softmax of one key tile on a consumer thread's score registers: the scores
    masked where needed, the rows' new max, ``alpha = exp2(m_old − m_new)`` into ``al`` (the
    caller rescales O by it once no product is writing O), ``P`` in place of ``S``, the sums."""
    needs_mask, neg_inf, NSR, qscale, visible = x.needs_mask, x.neg_inf, x.NSR, x.qscale, x.visible
    logit, transforms = x.logit, x.transforms

    @T.macro
    def softmax(S, m, l, al, t, wrow0, j, hh, start):
        # scores of key tile j: the variants' score hook, then masked where the tile needs it
        if transforms:
            for r in T.unroll(NSR):
                S[r] = logit(S[r], t, r, j, wrow0, hh)
        if needs_mask(j, wrow0, start):
            for r in T.unroll(NSR):
                S[r] = T.Select(visible(t, r, j, wrow0, start), S[r], neg_inf)
        for h in T.unroll(2):
            al[h] = neg_inf
        for r in T.unroll(NSR):
            al[r % 4 // 2] = T.max(al[r % 4 // 2], S[r])
        for h in T.unroll(2):
            # the row's four lanes; scaled once (the scale is positive), the new max in log2 units
            mn: T.float32 = T.max(m[h], T.cuda.warp_max(al[h], 4) * T.float32(qscale))
            al[h] = T.exp2(m[h] - guarded(mn))  # a row with no visible key yet keeps its max at 0
            m[h] = mn
            l[h] = l[h] * al[h]
        for r in T.unroll(NSR):
            S[r] = T.exp2(S[r] * T.float32(qscale) - guarded(m[r % 4 // 2]))
            l[r % 4 // 2] = l[r % 4 // 2] + S[r]

    return softmax


def _consumer(x, softmax):
    """A consumer warpgroup: its rows' products, softmax and store. With ``overlap`` (FlashAttention-3's
    intra-warpgroup overlap) tile j's ``S = Q·Kᵀ`` is issued together with tile j − 1's ``O += P·V``
    and the softmax of tile j runs while that product is in flight; O is rescaled after it."""
    (call, col_of, dtype, LSE, lse, neg_inf, NOR, NS, NSR, nthr, off, overlap, pingpong, plan, row_in_wg, sfx, SK,
     SQ, var, vis) = (x.call, x.col_of, x.dtype, x.LSE, x.lse, x.neg_inf, x.NOR, x.NS, x.NSR, x.nthr, x.off,
                      x.overlap, x.pingpong, x.plan, x.row_in_wg, x.sfx, x.SK, x.SQ, x.var, x.vis)
    pack = f"hop_pack{x.BN}_{WGMMA_DTYPES[dtype]}"

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
    def issue_pv(Oa, Pk, sb, j):
        T.evaluate(call("hop_wait", sb + plan.bar_full_v(0) + stage(j) * 8, full_parity(j, NS)))
        T.evaluate(call(f"hop_pv_{sfx}", Oa.access_ptr("rw"), Pk.access_ptr("r"),
                        sb + plan.v_tile(0) + stage(j) * plan.kv_tile_bytes))

    @T.macro
    def rescale(Oa, al):
        for r in T.unroll(NOR):
            Oa[r] = Oa[r] * al[r % 4 // 2]

    @T.macro
    def release(sb, j):  # tile j's stage read by this thread's products
        T.evaluate(call("hop_arrive", sb + plan.bar_empty(0) + stage(j) * 8))

    @T.macro
    def consumer(sb, O, S, Pk, Oa, m, l, al, tid, row0, bb, hh, first, nt):
        # loop tile j is key tile first + j (a window or a start skips the tiles before)
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
                softmax(S, m, l, al, t, wrow0, first, hh, var.start(bb))  # O is 0: no rescale
                T.evaluate(call(pack, Pk.access_ptr("w"), S.access_ptr("r")))
                for j in T.serial(1, nt):
                    turn_begin(wg)
                    issue_qk(S, sb, wg, j)
                    issue_pv(Oa, Pk, sb, j - 1)
                    turn_end(wg)
                    T.evaluate(call(f"hop_wait1_acc{NSR}", S.access_ptr("rw")))
                    softmax(S, m, l, al, t, wrow0, first + j, hh, var.start(bb))
                    T.evaluate(call(f"hop_wait_acc{NOR}", Oa.access_ptr("rw")))
                    rescale(Oa, al)
                    release(sb, j - 1)
                    T.evaluate(call(pack, Pk.access_ptr("w"), S.access_ptr("r")))
                turn_begin(wg)
                issue_pv(Oa, Pk, sb, nt - 1)
                turn_end(wg)
                T.evaluate(call(f"hop_wait_acc{NOR}", Oa.access_ptr("rw")))
                release(sb, nt - 1)
        else:
            for j in T.serial(nt):
                turn_begin(wg)
                issue_qk(S, sb, wg, j)
                turn_end(wg)
                T.evaluate(call(f"hop_wait_acc{NSR}", S.access_ptr("rw")))
                softmax(S, m, l, al, t, wrow0, first + j, hh, var.start(bb))
                rescale(Oa, al)
                T.evaluate(call(pack, Pk.access_ptr("w"), S.access_ptr("r")))
                turn_begin(wg)
                issue_pv(Oa, Pk, sb, j)
                turn_end(wg)
                T.evaluate(call(f"hop_wait_acc{NOR}", Oa.access_ptr("rw")))
                release(sb, j)
        if pingpong:
            if wg == 0:  # consumer 1's last turn handed back: no arrival left pending
                T.evaluate(call(f"hop_bar_sync{nthr}", 1))
        for h in T.unroll(2):  # the row's sum over its four lanes
            l[h] = T.cuda.warp_sum(l[h], 4)
        if lse:  # FlashAttention's softmax_lse: without the sink
            if t % 4 == 0:
                for h in T.unroll(2):
                    if wrow0 + row_in_wg(t, 2 * h) < SQ:
                        LSE[bb, hh, wrow0 + row_in_wg(t, 2 * h)] = lse_of(m[h], l[h])
        if var.SK is not None:
            for h in T.unroll(2):  # the sink joins the denominator: (acc·w, l·w + e), w in al
                al[h] = var.sink_terms(m[h], hh)[0]
                l[h] = l[h] * al[h] + var.sink_terms(m[h], hh)[1]
            rescale(Oa, al)
        for r in T.unroll(NOR):
            if wrow0 + row_in_wg(t, r) < SQ:
                O[bb, hh, wrow0 + row_in_wg(t, r), col_of(t, r)] = T.Cast(dtype, normalize_where(
                    Oa[r], l[r % 4 // 2], vis.sees_a_key(wrow0 + row_in_wg(t, r) + off, SK, var.start(bb))))

    return consumer


def fused_attention_wgmma(spec: AttentionSpec, block_m: int, block_n: int, stages: int,
                          pingpong: bool = True, overlap: bool = True) -> tirx.PrimFunc:
    """Arguments (call order), ``spec.dtype`` (float16 or bfloat16), compact row-major, 16-byte
    aligned: ``Q (B, H, Sq, D)``, ``K (B, KH, Skv, D)``, ``V (B, KH, Skv, D)``, ``O (B, H, Sq,
    D)``, then ``LSE (B, H, Sq) float32`` with ``spec.return_lse``. Batch and lengths static or
    symbolic (``spec.dynamic``)."""
    x = _context(spec, block_m, block_n, stages, pingpong, overlap)
    (B, BM, BN, D, dtype, G, H, isz, KH, LSE, lse, NOR, NS, NSR, nrt, nthr, plan, SK, SQ, THREADS, tk, tq, tv) = \
        (x.B, x.BM, x.BN, x.D, x.dtype, x.G, x.H, x.isz, x.KH, x.LSE, x.lse, x.NOR, x.NS, x.NSR, x.nrt, x.nthr,
         x.plan, x.SK, x.SQ, x.THREADS, x.tk, x.tq, x.tv)
    call, causal, tile_range, var = x.call, x.causal, x.tile_range, x.var
    producer = _producer(x)
    consumer = _consumer(x, _softmax(x))

    @T.macro
    def tmap(var, buf, rows, planes, box_rows):
        # a 3-D view (head_dim, rows, planes); boxes of 64 columns × box_rows × 1, 128B swizzle
        T.Bind(T.tvm_stack_alloca("tensormap", 1), var=var)
        T.tensormap_encode_tiled(var, buf.data, *[a for part in tensor_map(D, rows, planes, box_rows, isz) for a in part],
                                 descriptor_dtype=dtype, rank=3, swizzle=TMA_SWIZZLE_128B)

    attrs = {"global_symbol": ENTRY, "tirx.noalias": True, "attn.workload": "fused_wgmma",
             **record(FUSED_WGMMA, block_m=BM, block_n=BN, stages=NS, pingpong=int(pingpong), overlap=int(overlap))}

    @T.prim_func(s_tir=True, check_well_formed=False)
    def attention(
        Q: T.Buffer((B, H, SQ, D), dtype),
        K: T.Buffer((B, KH, SK, D), dtype),
        V: T.Buffer((B, KH, SK, D), dtype),
        O: T.Buffer((B, H, SQ, D), dtype),
    ):
        T.func_attr(attrs)
        tmap(tq, Q, SQ, B * H, BM)
        tmap(tk, K, SK, B * KH, BN)
        tmap(tv, V, SK, B * KH, BN)
        for bx in T.thread_binding(nrt, thread="blockIdx.x"):
            for hh in T.thread_binding(H, thread="blockIdx.y"):
                for bb in T.thread_binding(B, thread="blockIdx.z"):
                    for tid in T.thread_binding(THREADS, thread="threadIdx.x"):
                        # one block an SM: ptxas then knows the registers at entry (65536 / threads) and
                        # sizes the consumers' code by setmaxnreg's 240, not by that share
                        with T.attr(0, "tirx.launch_bounds_min_blocks_per_sm", 1):
                            with T.sblock("tile"):
                                T.reads()
                                T.writes()
                                smem = T.sblock_alloc_buffer((plan.alloc_bytes,), "uint8", scope="shared.dyn")
                                S = T.sblock_alloc_buffer((NSR,), "float32", scope="local")
                                Oa = T.sblock_alloc_buffer((NOR,), "float32", scope="local")
                                m = T.sblock_alloc_buffer((2,), "float32", scope="local")
                                l = T.sblock_alloc_buffer((2,), "float32", scope="local")
                                al = T.sblock_alloc_buffer((2,), "float32", scope="local")  # alpha
                                Pk = T.sblock_alloc_buffer((BN // 4,), "uint32", scope="local")  # P, 16-bit pairs
                                sb: T.uint32 = call("hop_smem_base", T.address_of(smem[0]), ret="uint32")
                                row0 = ((nrt - 1 - bx) if causal else bx) * BM
                                first = T.meta_var(tile_range(row0, var.start(bb))[0])
                                nt = tile_range(row0, var.start(bb))[1]
                                if tid == 0:
                                    T.evaluate(call("hop_mbar_init", sb + plan.bar_full_q(), 1))
                                    for s in T.unroll(NS):
                                        T.evaluate(call("hop_mbar_init", sb + plan.bar_full_k(s), 1))
                                        T.evaluate(call("hop_mbar_init", sb + plan.bar_full_v(s), 1))
                                        T.evaluate(call("hop_mbar_init", sb + plan.bar_empty(s), nthr))
                                    T.evaluate(call("hop_fence_init"))
                                T.tvm_storage_sync("shared")
                                if tid < WARPGROUP:
                                    T.evaluate(call("hop_regs_producer"))
                                    if tid == 0:
                                        producer(sb, row0, bb * H + hh, bb * KH + hh // G, first, nt)
                                else:
                                    T.evaluate(call("hop_regs_consumer"))
                                    consumer(sb, O, S, Pk, Oa, m, l, al, tid, row0, bb, hh, first, nt)


    func = attention
    if lse or var.buffers:  # the variants' arguments before O, the log-sum-exp after it
        params = list(func.params)
        params = params[:-1] + var.buffers + params[-1:] + ([LSE] if lse else [])
        func = tirx.PrimFunc(params, func.body, func.ret_type, func.attrs)
    return func
