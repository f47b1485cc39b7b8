#!/usr/bin/env python3
"""Build the GPU check's payload offline: every CUDA kernel it runs, self-contained, in one folder
that a bare GPU machine runs with what it has (Python, PyTorch, NumPy) plus tvm-ffi's wheel.

The GPU machines lent to this project have no ``apache-tvm``, no package index, and take at most
64 MiB of files per command; ``apache-tvm``'s wheel alone is 100 MB. So everything TVM does is done
here: each kernel is built for each ``--arch``, its CUDA source compiled to a fatbin with nvcc, and
exported as an artifact (``kernel_binary``: no JIT compile at load). The payload holds:

    run.sh                      the device entry: installs the wheel(s) to /tmp, runs the check
    gpu_device_check.py         loads, validates and times every kernel next to torch (no tvm)
    tvm_attention/              the package (the device script imports only its loader side)
    runtime/                    TVM's runtime libraries, once (each artifact lists them, SHA-256)
    kernels/<arch>/<name>/      attention.so, kernel.fatbin, manifest.json per kernel
    wheels/                     apache-tvm-ffi for cp312 (``--wheel``; the device has no index)
    payload.json                what was built, with what

Sizes: about 0.17 MB per kernel and 4.5 MB of runtime and package, so the default sweep (2 kernels
× 24 shapes × 2 archs; a symbolic and a varlen one of each kernel per dtype, head_dim and causal:
64 more; a kvcache and a paged decode build of each per dtype and head_dim: 32 more, and a float8
e4m3 page pool of each per dtype at the first head_dim: 8 more; two builds with the attention
variants of each, float16 at the first head_dim: 8 more, up to 2.5 MB each) stays under the
56 MiB the check allows (208 kernels, 49.4 MiB with the wheel, built in 208 s on 2 cores,
measured 2026-12-02); the script refuses to write more.

    python scripts/gpu_payload.py --out gpu_payload --wheel        # the full check, sm_90 and sm_80
    python scripts/gpu_payload.py --out p --seq 1024 --head-dim 64 --dtype float16 --arch sm_90  # small
    python scripts/gpu_payload.py --out gpu_payload --hopper --wheel   # the Hopper kernel's table (sm_90)
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a source checkout

REPO = Path(__file__).resolve().parents[1]
KERNELS = ("fused_tc", "fused_simt", "fused_hopper")
#: the kernels a payload builds unless told (the Hopper kernel: ``--hopper``)
DEFAULT_KERNELS = ("fused_tc", "fused_simt")
#: ``--hopper``: the Hopper issue's table, one run of at most 5 minutes on an H100/H200: the Hopper
#: kernel next to the mma.sync one and the peers at FlashAttention's shapes, fp16/bf16, D 64/128,
#: S 1k-16k, causal and not, sm_90 only, a symbolic and a varlen Hopper build per (dtype, D,
#: causal), kvcache and paged decode builds of each kernel per (dtype, D) and an e4m3 page pool's
#: at the first head_dim (the e4m3 goal: a step at most 0.6x the 16-bit one; again appending its
#: new token in the call), and the variants' bhsd
#: build (window, kv_start) at the first head_dim, and fp8 (e4m3) inputs at the FlashAttention
#: shapes (head_dims 64 and 128, o in the last dtype: the fp8 goal, at least 1.5x our fp16); and
#: issue 65's goals: the modifier (a relative bias), the cascade, MLA's decode, the masks and the
#: backward (``--modifier``, ``--cascade``, ``--mla``, ``--masks``, ``--backward``)
#: the Hopper kernel's other forms timed beside its preset (a column each): name -> knob overrides
HOPPER_VARIANTS = {"hopper_seq": {"overlap": 0}}
HOPPER = dict(arch=["sm_90"], kernels=["fused_hopper", "fused_tc"], symbolic=True, cache=True, variants=True,
              varlen=True, fp8=True, modifier=True, cascade=True, mla=True, masks=True, backward=True)
#: fp8 inputs (``--fp8``): q, K and V e4m3 scaled per head, at the head_dims the Hopper kernel
#: builds them at
FP8 = "float8_e4m3fn"
FP8_HEAD_DIMS = (64, 128)
#: the layouts the Hopper kernel builds (``fused_wgmma.LAYOUTS``; the device side imports no workload)
HOPPER_LAYOUTS = ("bhsd", "varlen", "kvcache", "paged")
#: the symbolic kernels' dims (``--symbolic``): validated at awkward shapes on the device, and timed
#: at each static shape next to the static kernels (the price of not knowing the lengths)
SYMBOLIC = ("batch", "seq_q", "seq_kv")
#: the KV-cache kernels (``--cache``), at the decode goal's step: GQA 32:8, batch 64, 4096 keys
CACHE_LAYOUTS = (("kvcache", None), ("paged", 16))
DECODE = dict(batch=64, heads=32, kv_heads=8, seq_q=1, seq_kv=4096)
#: the 8-bit cache of the decode builds (one paged build per dtype, at the first head_dim)
KV8 = "float8_e4m3fn"
#: a device command carries at most 64 MiB of files; the rest is left for what travels with it
#: the attention variants (``--variants``, float16 per head_dim): a paged decode step with a window,
#: softcap, ALiBi, sinks and lse, and a symbolic prefill with a window and a first key per sequence
VARIANT_SPECS = (
    dict(batch=4, heads=8, kv_heads=2, seq_q=1, seq_kv=512, layout="paged", page_size=16, window=(255, 0),
         softcap=30.0, alibi=True, sinks=True, return_lse=True),
    dict(batch=2, heads=8, kv_heads=2, seq_q=512, seq_kv=512, dynamic=("batch", "seq_q", "seq_kv"), window=(127, 0),
         kv_start=True),
    # what the call decides (the SIMT and mma.sync kernels): a relative bias read from a tensor and
    # a mask_mod; a speculative-decoding verify step (4 drafts appended, a tree's custom mask, key
    # bounds) on a page pool
    dict(batch=2, heads=8, kv_heads=2, seq_q=512, seq_kv=512, dynamic=("batch", "seq_q", "seq_kv"),
         score_mod="def score_mod(score, b, h, q_idx, kv_idx):\n    return score + bias[h] * (q_idx - kv_idx)\n",
         mod_tensors=(("bias", "float32", ("heads",)),),
         mask_mod="def mask_mod(b, h, q_idx, kv_idx):\n    return (q_idx - kv_idx) % 3 != 1\n"),
    dict(batch=4, heads=8, kv_heads=2, seq_q=4, seq_kv=512, layout="paged", page_size=16, append=True,
         custom_mask=True, key_bounds=True),
)
#: the modifier goal (issue 65: a score modifier costs at most 10 % over the plain kernel and runs
#: at least 1.0x compiled FlexAttention with the same modifier): FlexAttention's relative bias, a
#: slope per head read from a tensor, on the mma.sync kernel at one prefill shape of the table
#: (static, beside the plain build of that shape); ``twin``: the device check's torch form of it
#: for FlexAttention (``gpu_device_check.FLEX_TWINS``)
MODIFIER_GOAL = dict(score_mod=("def score_mod(score, b, h, q_idx, kv_idx):\n"
                                "    return score + bias[h] * (q_idx - kv_idx)\n"),
                     mod_tensors=(("bias", "float32", ("heads",)),))
MODIFIER_TWIN = "relative_bias"
#: the cascade's step (issue 65 item 5, ``--cascade``): 64 sequences decode a token each over a prefix
#: of 8192 keys they share (FlashInfer's cascade benchmark: parallel sampling from one long prompt)
#: and 512 keys of their own, GQA 32:8, D=128, a page pool of 16-key pages; built as the prefix and
#: suffix kernels of ``cascade.prefix_spec``/``suffix_spec`` by each non-Hopper kernel of the
#: payload, in its first dtype. The step without the cascade is the suffix kernel over block
#: tables that hold the prefix's pages too (it reads the prefix once per sequence: 8.9x the bytes)
CASCADE = dict(batch=64, heads=32, kv_heads=8, seq_q=1, head_dim=128, causal=True, layout="paged", page_size=16)
CASCADE_LENGTHS = (8192, 512)
#: the MLA goal (issue 65 item 4, ``--mla``): DeepSeek-V3's decode step, 128 heads over its latent
#: rows (576 wide, V their first 512 columns) in a pool of 64-row pages, bf16, batch 64 × 4096 keys:
#: at least 70 % of the memory roof or of the tensor-core roof, whichever binds; on the MLA
#: tensor-core kernel (``--schedule fused_mla``), a 16-bit cache and an e4m3 one (FlashMLA's FP8 form)
MLA = dict(batch=64, heads=128, kv_heads=1, seq_q=1, seq_kv=4096, head_dim=576, head_dim_v=512, causal=True,
           scale=0.0722, layout="mla_paged", page_size=64, dtype="bfloat16")
MLA_KV = (None, "float8_e4m3fn")
#: the mask goals (issue 65 items 2 and 7, ``--masks``), on the mma.sync kernel: ``sparse``, a custom
#: mask at a long prefill (S 8192, B1 H16, D 128, fp16) timed with all bits set and with 90 % of its
#: 128 × 128 blocks hidden (goal: at least 5x faster); ``verify``, a speculative-decoding step on a
#: page pool (8 sequences of 4096 keys, GQA 32:8, D 128) that appends 64 drafts and attends through
#: their tree's mask, against ``append``, the same 64 tokens appended causally (goal: at most 1.3x)
MASK_GOALS = {
    "sparse": dict(batch=1, heads=16, seq_q=8192, seq_kv=8192, head_dim=128, dtype="float16", custom_mask=True),
    "verify": dict(batch=8, heads=32, kv_heads=8, seq_q=64, seq_kv=4096, head_dim=128, dtype="float16", causal=True,
                   layout="paged", page_size=16, append=True, custom_mask=True),
    "append": dict(batch=8, heads=32, kv_heads=8, seq_q=64, seq_kv=4096, head_dim=128, dtype="float16", causal=True,
                   layout="paged", page_size=16, append=True),
}
#: the backward goal (issue 65 item 6, ``--backward``): the CUDA backward (``build_backward`` with a CUDA
#: target, exported) per (head_dim, causal) of the table, float16, symbolic lengths (one build serves
#: every S of the table at FlashAttention's shapes), timed against torch SDPA's flash backward
BACKWARD_DTYPE = "float16"
MAX_PAYLOAD_BYTES = 56 * 2**20
#: files of an artifact the device needs (lowered.tir and kernel.cu stay here: 0.4 MB a kernel)
DEVICE_FILES = ("attention.so", "attention_backward.so", "kernel.fatbin", "manifest.json")
TVM_FFI = "apache-tvm-ffi==0.1.14.post1"


def shape_of(seq: int, head_dim: int, tokens: int, width: int) -> tuple[int, int]:
    """FlashAttention's benchmark shapes: ``tokens`` per batch, a model width of ``width``."""
    return max(1, tokens // seq), max(1, width // head_dim)


def build_job(job: dict, require_binary: bool = True) -> dict:
    """In a pool worker: build and export one (spec, kernel, arch); no GPU is touched. Shared
    with ``gpu_check.py``, whose machine has the compiler (no precompiled binary needed there)."""
    import traceback

    from tvm_attention.artifact import export
    from tvm_attention.build import build_kernel
    from tvm_attention.spec import AttentionSpec
    from tvm_attention.target import resolve_target
    from tvm_attention.validate import ValidationResult

    t0 = time.time()
    spec = AttentionSpec.from_dict(job["spec"])
    if job.get("backward"):
        return _build_backward_job(job, spec, t0)
    try:
        built = build_kernel(spec, job["kernel"], target=resolve_target("cuda", arch=job["arch"]),
                             knobs=job.get("knobs"))
        m = export(built, job["dir"], ValidationResult.not_run(spec, "exported by a GPU check's build pool"))
        if require_binary and "kernel_binary" not in m:
            raise RuntimeError("no nvcc here: the kernel would need a compiler on the GPU machine")
        res = built.resources or {}
        return {"knobs": built.knobs.to_dict(), "audit": built.audit.verdict, "build_s": round(time.time() - t0, 2),
                "resources": res, "registers": res.get("registers"), "spills": res.get("spills"),
                "occupancy": res.get("occupancy")}
    except Exception as e:  # noqa: BLE001 - recorded, the others go on
        return {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc(limit=4)}


def _build_backward_job(job: dict, spec, t0: float) -> dict:
    """``build_job`` of a backward build: ``build_backward`` for the job's CUDA arch, exported (its
    fatbin compiled here)."""
    import traceback

    from tvm_attention.backward import build_backward
    from tvm_attention.backward_artifact import export_backward
    from tvm_attention.target import resolve_target

    try:
        kern = build_backward(spec, target=resolve_target("cuda", arch=job["arch"]))
        m = export_backward(kern, job["dir"])
        if "kernel_binary" not in m:
            raise RuntimeError("no nvcc here: the kernel would need a compiler on the GPU machine")
        res = kern.resources or {}
        return {"knobs": m["knobs"], "audit": m["audit"], "build_s": round(time.time() - t0, 2), "resources": res,
                "registers": res.get("registers"), "spills": res.get("spills"), "occupancy": res.get("occupancy")}
    except Exception as e:  # noqa: BLE001 - recorded, the others go on
        return {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc(limit=4)}


def jobs_for(a: argparse.Namespace, kernels_dir: Path) -> list[dict]:
    from tvm_attention.spec import AttentionSpec

    jobs = []

    def add(spec, arch, **extra):  # a build of each kernel that builds this spec (extra: the job's keys)
        for k in a.kernels:
            if k == "fused_hopper":  # the layouts it builds, on sm_90; its variants in bhsd (docs/cuda.md)
                if arch != "sm_90" or spec.layout not in HOPPER_LAYOUTS or (spec.variants and spec.layout != "bhsd") \
                        or spec.has_modifiers:  # its masking is its own: the call's masks are the others'
                    continue
            elif spec.q_dtype is not None:
                continue  # fp8 inputs: the Hopper kernel's alone
            elif a.hopper and not spec.has_modifiers and ((spec.dynamic and spec.layout == "bhsd") or spec.variants
                                                           or spec.layout == "varlen"):
                continue  # --hopper: the mma.sync kernel beside it at the static shapes and decode steps
                # (and what the call decides, which the Hopper kernel does not build)
            jobs.append({"spec": spec.to_dict(), "kernel": k, "arch": arch,
                         "dir": str(kernels_dir / arch / f"{k}_{spec.short_name()}"), **extra})
            if k == "fused_hopper" and not spec.dynamic and spec.q_dtype is None:
                # the same tiles without the intra-warpgroup overlap: its price or gain, and a
                # fallback if the overlapped form fails on its first run
                for column, knobs in HOPPER_VARIANTS.items():
                    jobs.append({"spec": spec.to_dict(), "kernel": k, "arch": arch, "knobs": knobs, "column": column,
                                 "dir": str(kernels_dir / arch / f"{column}_{spec.short_name()}")})

    for arch in a.arch:
        for dtype in a.dtype:
            for d in a.head_dim:
                for causal in a.causal:
                    for s in a.seq:
                        b, h = shape_of(s, d, a.tokens, a.width)
                        add(AttentionSpec(batch=b, heads=h, seq_q=s, head_dim=d, dtype=dtype, causal=causal), arch)
                        if a.fp8 and d in FP8_HEAD_DIMS and dtype == a.dtype[-1]:  # the fp8 prefill at this shape
                            add(AttentionSpec(batch=b, heads=h, seq_q=s, head_dim=d, dtype=dtype, causal=causal,
                                              q_dtype=FP8, kv_dtype=FP8), arch)
                        if a.modifier and (dtype, d, causal, s) == (a.dtype[0], a.head_dim[0], True, a.seq[-1]):
                            add(AttentionSpec(batch=b, heads=h, seq_q=s, head_dim=d, dtype=dtype, causal=causal,
                                              **MODIFIER_GOAL), arch, twin=MODIFIER_TWIN)
                    # one symbolic kernel serves every length of this (dtype, D, causal); one varlen
                    # kernel every packed batch
                    _, h = shape_of(max(a.seq), d, a.tokens, a.width)
                    for on, extra in ((a.symbolic, {"dynamic": SYMBOLIC}), (a.varlen, {"layout": "varlen"})):
                        if on:
                            add(AttentionSpec(batch=1, heads=h, seq_q=max(a.seq), head_dim=d, dtype=dtype,
                                              causal=causal, **extra), arch)
                if a.cache:  # decode steps: causal (at one new token, the same as not)
                    for layout, page in CACHE_LAYOUTS:
                        add(AttentionSpec(**DECODE, head_dim=d, dtype=dtype, causal=True, layout=layout,
                                          page_size=page), arch)
                    if d == a.head_dim[0]:  # a float8 e4m3 page pool at the first head_dim, and the
                        # same step appending its new token in the call (FlashAttention's k_new)
                        for append in (False, True):
                            add(AttentionSpec(**DECODE, head_dim=d, dtype=dtype, causal=True, layout="paged",
                                              page_size=16, kv_dtype=KV8, append=append), arch)
                # the variants, checked against the NumPy reference: float16 at the first head_dim
                # (the paged one's library embeds 2.4 MB of CUDA source: softcap, ALiBi and the
                # window unrolled over every score slot)
                if a.variants and dtype == "float16" and d == a.head_dim[0]:
                    for extra in VARIANT_SPECS:
                        add(AttentionSpec(head_dim=d, dtype=dtype, causal=True, **extra), arch)
        if a.cascade:  # the prefix and suffix kernels of the cascade's serving spec (CASCADE)
            from tvm_attention import cascade

            serving = AttentionSpec(**CASCADE, seq_kv=sum(CASCADE_LENGTHS), dtype=a.dtype[0])
            for k in a.kernels:
                if k == "fused_hopper":
                    continue  # its lse and paged prefill are the others' (docs/cuda.md)
                for which, spec in (("prefix", cascade.prefix_spec(serving)), ("suffix", cascade.suffix_spec(serving))):
                    jobs.append({"spec": spec.to_dict(), "kernel": k, "arch": arch, "cascade": which,
                                 "serving": serving.to_dict(), "lengths": list(CASCADE_LENGTHS),
                                 "dir": str(kernels_dir / arch / f"{k}_cascade_{which}_{spec.short_name()}")})
        if a.masks and "fused_tc" in a.kernels:  # the mask goals' builds (MASK_GOALS), on tensor cores
            for goal, fields in MASK_GOALS.items():
                spec = AttentionSpec(**fields)
                jobs.append({"spec": spec.to_dict(), "kernel": "fused_tc", "arch": arch, "mask_goal": goal,
                             "dir": str(kernels_dir / arch / f"fused_tc_maskgoal_{goal}_{spec.short_name()}")})
        if a.backward:  # the backward goal's builds: per (head_dim, causal), symbolic, at the table's shapes
            for d in a.head_dim:
                for causal in a.causal:
                    shapes = [(*shape_of(s, d, a.tokens, a.width), s) for s in a.seq]
                    spec = AttentionSpec(batch=1, heads=shapes[-1][1], seq_q=max(a.seq), head_dim=d,
                                         dtype=BACKWARD_DTYPE, causal=causal, dynamic=SYMBOLIC)
                    jobs.append({"spec": spec.to_dict(), "kernel": "backward_mma", "arch": arch, "backward": True,
                                 "shapes": shapes, "dir": str(kernels_dir / arch / f"backward_{spec.short_name()}")})
        if a.mla:  # the MLA goal's builds (MLA): the MLA kernel's, whatever --kernels names
            for kv in MLA_KV:
                spec = AttentionSpec(**MLA, kv_dtype=kv)
                jobs.append({"spec": spec.to_dict(), "kernel": "fused_mla", "arch": arch, "mla": True,
                             "dir": str(kernels_dir / arch / f"fused_mla_{spec.short_name()}")})
    return jobs


def copy_package(out: Path) -> None:
    """The package's Python files (no caches): the device script imports its loader side only."""
    src = REPO / "tvm_attention"
    for path in src.rglob("*.py"):
        dest = out / "tvm_attention" / path.relative_to(src)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, dest)


def download_wheel(out: Path) -> list[str]:
    """tvm-ffi's cp312 manylinux wheel (the GPU machines run Python 3.12 and have no index)."""
    (out / "wheels").mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
           "--implementation", "cp", "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
           "--platform", "manylinux2014_x86_64", "-d", str(out / "wheels"), TVM_FFI]
    subprocess.run(cmd, check=True)
    return sorted(p.name for p in (out / "wheels").glob("*.whl"))


RUN_SH = """#!/usr/bin/env bash
# The GPU check's device entry: tvm-ffi from the carried wheel, then the check. No network, no tvm.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
SITE=/tmp/tvm_attention_site
if ls "$HERE"/wheels/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$HERE"/wheels/*.whl
fi
export PYTHONPATH="$HERE:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv || true
exec python3 "$HERE/gpu_device_check.py" --payload "$HERE" "$@"
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="gpu_payload", help="payload folder (replaced)")
    p.add_argument("--arch", nargs="+", default=["sm_90", "sm_80"])
    p.add_argument("--seq", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--head-dim", type=int, nargs="+", default=[64, 128])
    p.add_argument("--dtype", nargs="+", default=["float16", "bfloat16"])
    p.add_argument("--causal", nargs="+", type=lambda t: t.lower() in ("1", "true", "yes"), default=[False, True])
    p.add_argument("--kernels", nargs="+", default=list(DEFAULT_KERNELS), choices=list(KERNELS))
    p.add_argument("--hopper", action="store_true",
                   help="the Hopper kernel's payload: " + ", ".join(f"--{k} {v}" for k, v in HOPPER.items()))
    p.add_argument("--symbolic", action=argparse.BooleanOptionalAction, default=True,
                   help="also a symbolic-shape build of each kernel per (arch, dtype, head_dim, causal)")
    p.add_argument("--cache", action=argparse.BooleanOptionalAction, default=True,
                   help="also kvcache and paged (page 16) decode builds of each kernel per (arch, dtype, head_dim)")
    p.add_argument("--variants", action=argparse.BooleanOptionalAction, default=True,
                   help="also builds with the attention variants, float16 at the first --head-dim, per arch")
    p.add_argument("--varlen", action=argparse.BooleanOptionalAction, default=True,
                   help="also a varlen (packed, cu_seqlens) build of each kernel per (arch, dtype, head_dim, causal)")
    p.add_argument("--fp8", action=argparse.BooleanOptionalAction, default=False,
                   help="also fp8 (e4m3) prefill builds of the Hopper kernel at head_dims 64 and 128, o in the last "
                        "--dtype")
    p.add_argument("--modifier", action=argparse.BooleanOptionalAction, default=False,
                   help="also the modifier goal's build (a relative bias, mma.sync) at the longest causal shape of "
                        "the first --dtype and --head-dim")
    p.add_argument("--cascade", action=argparse.BooleanOptionalAction, default=False,
                   help="also the cascade's prefix and suffix builds (64 sequences over a shared prefix of 8192 keys) "
                        "of each non-Hopper kernel in the first --dtype, timed against the same step without it")
    p.add_argument("--backward", action=argparse.BooleanOptionalAction, default=False,
                   help="also the CUDA backward per (--head-dim, --causal), float16, symbolic: timed at each --seq "
                        "against torch SDPA's flash backward")
    p.add_argument("--masks", action=argparse.BooleanOptionalAction, default=False,
                   help="also the mask goals' builds on tensor cores: a custom mask at S 8192 (all bits against 90 %% "
                        "of the blocks hidden) and a 64-draft tree verify step against a 64-token append")
    p.add_argument("--mla", action=argparse.BooleanOptionalAction, default=False,
                   help="also the MLA goal's builds (DeepSeek-V3's decode: 128 heads, 576/512, a bf16 and an e4m3 "
                        "page pool) on the MLA tensor-core kernel")
    p.add_argument("--tokens", type=int, default=16384, help="batch × seq_len (FlashAttention's benchmark)")
    p.add_argument("--width", type=int, default=2048, help="heads × head_dim")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel builds")
    p.add_argument("--wheel", action="store_true", help="download tvm-ffi's cp312 wheel into the payload")
    a = p.parse_args(argv)
    if a.hopper:
        for key, value in HOPPER.items():
            setattr(a, key, value)

    from tvm_attention.cuda_tools import find_nvcc
    from tvm_attention.runtime import compiler_runtime_paths

    if find_nvcc() is None:
        print("gpu_payload: nvcc not found: the payload's kernels must be compiled here", file=sys.stderr)
        return 2
    out = Path(a.out)
    if out.exists():
        shutil.rmtree(out)
    (out / "runtime").mkdir(parents=True)
    t0 = time.time()
    jobs = jobs_for(a, out / "kernels")
    ctx = multiprocessing.get_context("spawn")  # workers start clean (TVM's thread pools, no fork)
    with concurrent.futures.ProcessPoolExecutor(max_workers=max(1, a.jobs), mp_context=ctx) as pool:
        builds = list(pool.map(build_job, jobs))
    runtime = {}
    for path in compiler_runtime_paths(cuda=True):
        shutil.copy2(path, out / "runtime" / path.name)
        runtime[path.name] = path.stat().st_size
    for job, b in zip(jobs, builds):
        d = Path(job["dir"])
        if "error" in b or not d.is_dir():
            continue
        for f in d.iterdir():
            if f.name not in DEVICE_FILES:
                f.unlink()  # runtime libraries live once in runtime/; lowered.tir, kernel.cu stay here
    copy_package(out)
    shutil.copy2(REPO / "scripts" / "gpu_device_check.py", out / "gpu_device_check.py")
    (out / "run.sh").write_text(RUN_SH)
    os.chmod(out / "run.sh", 0o755)
    wheels = download_wheel(out) if a.wheel else []
    failed = [(j, b) for j, b in zip(jobs, builds) if "error" in b]
    info = {"created": time.strftime("%Y-%m-%dT%H:%M:%S"), "archs": a.arch, "tvm_ffi": TVM_FFI, "wheels": wheels,
            "runtime": runtime, "build_s": round(time.time() - t0, 1),
            "kernels": [{"kernel": j["kernel"], "arch": j["arch"], "spec": j["spec"],
                         **{key: j[key] for key in ("column", "knobs", "twin", "cascade", "serving", "lengths", "mla",
                                                    "mask_goal", "backward", "shapes")
                            if key in j},
                         "dir": str(Path(j["dir"]).relative_to(out)), **b} for j, b in zip(jobs, builds)]}
    (out / "payload.json").write_text(json.dumps(info, indent=1) + "\n")
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"gpu_payload: {len(jobs) - len(failed)}/{len(jobs)} kernels for {', '.join(a.arch)} in "
          f"{time.time() - t0:.0f} s; {size / 2**20:.1f} MiB in {out}")
    for j, b in failed:
        print(f"build failed: {j['kernel']} {j['arch']} {Path(j['dir']).name}: {b['error']}\n{b['trace']}",
              file=sys.stderr)
    if size > MAX_PAYLOAD_BYTES:
        print(f"gpu_payload: {size / 2**20:.1f} MiB is over the {MAX_PAYLOAD_BYTES / 2**20:.0f} MiB a device "
              "command may carry: build fewer kernels", file=sys.stderr)
        return 2
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
