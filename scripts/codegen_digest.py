#!/usr/bin/env python3
"""Digest of the generated code of every preset: a refactor's proof that nothing it emits moved.

For a matrix of specs (every layout, dtype, causal and not, static and symbolic, decode shapes,
odd head dims) × targets (AVX-512 and AVX2 CPUs, CUDA sm_80/sm_90, both CUDA kernels) × families,
the hand schedule's final lowered TIR (what codegen sees, and for CUDA also the generated CUDA C)
is hashed. Run it before and after a change and diff the outputs:

    python scripts/codegen_digest.py > before.txt      # on the old commit
    python scripts/codegen_digest.py > after.txt
    diff before.txt after.txt                          # empty: byte-identical

``--dump DIR`` also writes each case's code, to see what differs. ``--asm`` also hashes each CPU
case's machine code (LLVM's assembly): the proof for a change that rewrites the IR but should
compile to the same instructions. Cross-compiles only: nothing runs, so every target builds on any
host (CUDA without a GPU or nvcc).
"""
from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a source checkout

from tvm import s_tir  # noqa: E402

try:  # schedules/ is tvm_attention.schedules; an older commit (to digest it) had a top-level package
    import tvm_attention.schedules as schedules  # noqa: E402
except ModuleNotFoundError as e:
    if e.name != "tvm_attention.schedules":
        raise
    import schedules  # noqa: E402

get_schedule = schedules.get_schedule
try:  # the one capability-and-knob check; before it existed (to digest an older commit): the family's
    check = schedules.check
except AttributeError:
    def check(family, knobs, spec, target):
        family.check(knobs, spec, target)
from tvm_attention.build import resolve_knobs  # noqa: E402
from tvm_attention.cuda_tools import kernel_source  # noqa: E402
from tvm_attention.lowering import codegen, lower_final  # noqa: E402
from tvm_attention.spec import AttentionSpec  # noqa: E402
from tvm_attention.target import resolve_target  # noqa: E402

CPUS = ("znver4", "znver3")  # AVX-512 with AVX512-BF16, and AVX2 (16 vector registers)
DYN = ("batch", "seq_q", "seq_kv")


def cpu_cases() -> list[tuple[str, AttentionSpec]]:
    """(schedule, spec) pairs built for each CPU target."""
    s = []
    for causal in (False, True):
        s.append(AttentionSpec(batch=1, heads=8, seq_q=1024, head_dim=64, causal=causal))
        s.append(AttentionSpec(batch=1, heads=8, seq_q=1024, head_dim=64, causal=causal, dynamic=DYN))
    s += [
        AttentionSpec(batch=2, heads=8, kv_heads=2, seq_q=300, seq_kv=517, head_dim=128, causal=True),
        AttentionSpec(batch=1, heads=4, seq_q=256, head_dim=96, causal=True),
        AttentionSpec(batch=1, heads=2, seq_q=256, head_dim=256),
        AttentionSpec(batch=1, heads=8, kv_heads=2, seq_q=1024, head_dim=64, causal=True, dtype="bfloat16", dynamic=DYN),
        AttentionSpec(batch=1, heads=8, seq_q=1024, head_dim=128, dtype="float16"),
        AttentionSpec(batch=2, heads=8, kv_heads=2, seq_q=512, head_dim=64, causal=True, layout="varlen",
                      return_lse=True),
        AttentionSpec(batch=4, heads=32, kv_heads=8, seq_q=1, seq_kv=4096, head_dim=128, causal=True,
                      layout="kvcache", dynamic=DYN),
        # static decode steps (bhsd, seq_q 1): the packed nest alone; at batch 1 with 2 kv heads few
        # enough (batch, kv head) tasks to split the keys
        AttentionSpec(batch=4, heads=32, kv_heads=8, seq_q=1, seq_kv=4096, head_dim=128, causal=True),
        AttentionSpec(batch=1, heads=8, kv_heads=2, seq_q=1, seq_kv=4096, head_dim=64, causal=True),
        AttentionSpec(batch=4, heads=32, kv_heads=8, seq_q=1, seq_kv=4096, head_dim=128, causal=True,
                      layout="paged", dynamic=DYN, return_lse=True, dtype="bfloat16"),
        AttentionSpec(batch=1, heads=8, seq_q=1, seq_kv=2048, head_dim=64, causal=True, layout="paged"),
    ]
    # the attention variants (issue 26), after the plain specs: their names carry the variants
    every = dict(softcap=30.0, alibi=True, sinks=True, kv_start=True)
    s += [
        AttentionSpec(batch=2, heads=8, kv_heads=2, seq_q=1024, head_dim=64, causal=True, window=(255, 0), **every),
        AttentionSpec(batch=1, heads=8, kv_heads=2, seq_q=1024, head_dim=64, causal=True, window=(255, 0),
                      softcap=30.0, dtype="bfloat16", dynamic=DYN),
        AttentionSpec(batch=4, heads=32, kv_heads=8, seq_q=1, seq_kv=4096, head_dim=128, causal=True,
                      layout="kvcache", window=(1023, 0), return_lse=True, **every),
        AttentionSpec(batch=4, heads=32, kv_heads=8, seq_q=1, seq_kv=4096, head_dim=128, causal=True,
                      layout="paged", window=(1023, 0), softcap=30.0, sinks=True),
        AttentionSpec(batch=2, heads=8, kv_heads=2, seq_q=512, head_dim=64, causal=True, layout="varlen",
                      window=(63, 0), softcap=30.0, alibi=True, sinks=True, return_lse=True),
    ]
    # user-written modifiers with key bounds: a document mask, a relative bias read from a tensor
    mods = dict(mask_mod="lambda b, h, q, kv: doc[b, q] == doc[b, kv]",
                score_mod="lambda s, b, h, q, kv: s - slope[h] * abs(q - kv)", key_bounds=True,
                mod_tensors=(("doc", "int32", ("batch", "seq_kv")), ("slope", "float32", ("heads",))))
    s += [
        AttentionSpec(batch=1, heads=8, kv_heads=2, seq_q=1024, head_dim=64, causal=True, dynamic=DYN, **mods),
        AttentionSpec(batch=4, heads=32, kv_heads=8, seq_q=1, seq_kv=4096, head_dim=128, causal=True,
                      layout="paged", dynamic=DYN, return_lse=True, **mods),
    ]
    # 8-bit caches (issue 27): float8 read through float16, int8 appended in the same call
    s += [
        AttentionSpec(batch=4, heads=32, kv_heads=8, seq_q=1, seq_kv=4096, head_dim=128, causal=True,
                      layout="paged", dtype="bfloat16", kv_dtype="float8_e4m3fn"),
        AttentionSpec(batch=4, heads=32, kv_heads=8, seq_q=1, seq_kv=4096, head_dim=128, causal=True,
                      layout="kvcache", kv_dtype="int8", append=True, return_lse=True),
    ]
    cases = [("fused", x) for x in s]
    cases += [("materialized", AttentionSpec(batch=1, heads=8, seq_q=512, head_dim=64, causal=True)),
              ("rowcache", AttentionSpec(batch=1, heads=8, seq_q=512, head_dim=64, causal=True))]
    return cases


def cuda_cases() -> list[tuple[str, str, AttentionSpec]]:
    """(arch, schedule, spec) for the CUDA kernels."""
    out = []
    for arch in ("sm_80", "sm_90"):
        for d in (64, 128):
            for dtype in ("float16", "bfloat16"):
                out.append((arch, "fused_tc", AttentionSpec(batch=1, heads=8, seq_q=4096, head_dim=d,
                                                            dtype=dtype, causal=True)))
            out.append((arch, "fused_simt", AttentionSpec(batch=1, heads=8, seq_q=4096, head_dim=d, causal=True)))
            out.append((arch, "fused_simt", AttentionSpec(batch=1, heads=8, seq_q=1000, head_dim=d,
                                                          dtype="float16")))
    out.append(("sm_90", "fused_tc", AttentionSpec(batch=2, heads=8, kv_heads=2, seq_q=300, seq_kv=517,
                                                   head_dim=64, dtype="float16", causal=True)))
    # the variant contract on both CUDA kernels (decode steps, a symbolic varlen prefill)
    every = dict(window=(1023, 0), softcap=30.0, alibi=True, sinks=True)
    out.append(("sm_90", "fused_tc", AttentionSpec(batch=4, heads=32, kv_heads=8, seq_q=1, seq_kv=4096, head_dim=128,
                                                   dtype="float16", causal=True, layout="paged", **every)))
    out.append(("sm_80", "fused_simt", AttentionSpec(batch=4, heads=32, kv_heads=8, seq_q=1, seq_kv=4096,
                                                     head_dim=128, causal=True, layout="kvcache", kv_start=True,
                                                     return_lse=True, **every)))
    out.append(("sm_90", "fused_tc", AttentionSpec(batch=2, heads=8, kv_heads=2, seq_q=512, head_dim=64,
                                                   dtype="bfloat16", causal=True, layout="varlen", alibi=True,
                                                   sinks=True)))
    return out


def lowered(schedule: str, spec: AttentionSpec, target):
    family = get_schedule(schedule, target)
    knobs = resolve_knobs(family, spec, target, None)
    check(family, knobs, spec, target)
    sch = s_tir.Schedule(family.workload(spec, knobs))
    with target:
        sch = family.apply(sch, knobs, spec)
    return lower_final(sch.mod, target)


def name_of(schedule: str, spec: AttentionSpec, where: str) -> str:
    dyn = "dyn-" + "-".join(spec.dynamic) if spec.dynamic else "static"
    return (f"{where}/{schedule}/{spec.layout}_b{spec.batch}_h{spec.heads}_kv{spec.kv_heads}_q{spec.seq_q}"
            f"_k{spec.seq_kv}_d{spec.head_dim}_{spec.dtype}_{'causal' if spec.causal else 'full'}_{dyn}"
            f"{spec.variant_suffix()}{'_lse' if spec.return_lse else ''}"
            f"{'_kv' + spec.kv_dtype if spec.kv_dtype else ''}{'_append' if spec.append else ''}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dump", help="also write each case's code into this folder")
    p.add_argument("--no-cuda", action="store_true", help="CPU cases only")
    p.add_argument("--asm", action="store_true", help="also hash each CPU case's assembly")
    a = p.parse_args(argv)
    jobs = [(s, x, resolve_target({"kind": "llvm", "mcpu": cpu}), cpu) for cpu in CPUS for s, x in cpu_cases()]
    if not a.no_cuda:
        jobs += [(s, x, resolve_target("cuda", arch=arch), arch) for arch, s, x in cuda_cases()]
    for schedule, spec, target, where in jobs:
        name = name_of(schedule, spec, where)
        low = lowered(schedule, spec, target)
        parts = {"tir": low.script()}
        if str(target.kind) == "cuda":
            parts["cu"] = kernel_source(codegen(low))
        elif a.asm:
            parts["asm"] = codegen(low).inspect_source("asm")
        for kind, text in parts.items():
            print(f"{hashlib.sha256(text.encode()).hexdigest()[:16]}  {kind}  {name}", flush=True)
            if a.dump:
                path = Path(a.dump) / f"{name}.{kind}"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
