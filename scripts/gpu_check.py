#!/usr/bin/env python3
"""One-shot GPU check: build, validate and benchmark both CUDA kernels on this machine's GPU.

For S in {1024, 4096, 16384}, D in {64, 128}, causal and not, fp16 and bf16, each kernel
(``fused_tc``: tensor cores, ``fused_simt``: CUDA cores) is built with the hand preset for the
local GPU's arch, validated against the float64 NumPy reference (sampled rows at long lengths)
and timed next to PyTorch SDPA's flash backend (FlashAttention-2) in the same run; TFLOP/s
count 4·B·H·Sq·Skv·D, halved for causal (FlashAttention's convention). Shapes follow
FlashAttention's benchmark: 16k tokens per batch (batch = 16384 / S) and a model width of 2048
(heads = 2048 / D), so every length fills the GPU.

Builds (TVM lowering, ptxas report, export) run first in a process pool; the GPU part runs in
this process, one kernel at a time. Sized to finish within ten minutes on an H100-class GPU.
Writes everything to --json and prints a Markdown table.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import os
import sys
import time
import traceback
from pathlib import Path

from gpu_payload import KERNELS, build_job, shape_of  # noqa: E402 - beside this script


def _build_one(job: dict) -> dict:
    """In a pool worker: build and export one (spec, kernel); no GPU is touched."""
    return build_job(job, require_binary=False)


def torch_flash(spec):
    """SDPA restricted to the flash backend (FlashAttention-2), or None without torch/CUDA."""
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    dt = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[spec.dtype]
    q = torch.randn(spec.q_shape, device="cuda", dtype=dt)
    k = torch.randn(spec.kv_shape, device="cuda", dtype=dt)
    v = torch.randn(spec.kv_shape, device="cuda", dtype=dt)

    def run():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=spec.causal)
        torch.cuda.synchronize()

    return run


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--head-dim", type=int, nargs="+", default=[64, 128])
    p.add_argument("--dtype", nargs="+", default=["float16", "bfloat16"])
    p.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=list(KERNELS) + ["fused", "materialized"])
    p.add_argument("--tokens", type=int, default=16384, help="batch × seq_len (FlashAttention's benchmark)")
    p.add_argument("--width", type=int, default=2048, help="heads × head_dim")
    p.add_argument("--jobs", type=int, default=min(12, os.cpu_count() or 1), help="parallel builds")
    p.add_argument("--out", default="gpu_check_out", help="artifacts and JSON go here")
    p.add_argument("--json", default=None, help="default: OUT/gpu_check.json")
    p.add_argument("--arch", default=None, help="default: the local GPU's (needed with --build-only offline)")
    p.add_argument("--build-only", action="store_true",
                   help="build and export only (no GPU needed): checks the script and the builds offline")
    a = p.parse_args()

    import tvm

    from tvm_attention.cuda_tools import find_nvcc
    from tvm_attention.loader import AttentionKernel, read_manifest
    from tvm_attention.spec import AttentionSpec
    from tvm_attention.target import local_cuda_arch
    from tvm_attention.timing import time_callable, time_module
    from tvm_attention.validate import validate_callable

    arch = a.arch or local_cuda_arch()
    if arch is None:
        print("gpu_check: no CUDA GPU visible to TVM (tvm.cuda(0).exist is False); "
              "--build-only --arch sm_XX builds without one", file=sys.stderr)
        return 2
    if find_nvcc() and "TVM_CUDA_COMPILE_MODE" not in os.environ:
        os.environ["TVM_CUDA_COMPILE_MODE"] = "nvcc"  # NVRTC needs the cuda-bindings package
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"# gpu_check for {arch}, tvm {tvm.__version__}", flush=True)
    t_start = time.time()

    specs = []
    for dtype in a.dtype:
        for d in a.head_dim:
            for causal in (False, True):
                for s in a.seq:
                    b, h = shape_of(s, d, a.tokens, a.width)
                    specs.append(AttentionSpec(batch=b, heads=h, seq_q=s, head_dim=d, dtype=dtype, causal=causal))
    jobs = [{"spec": sp.to_dict(), "kernel": k, "arch": arch, "dir": str(out / f"{k}_{sp.short_name()}")}
            for sp in specs for k in a.kernels]
    # spawned workers: a forked child would inherit this process's CUDA state
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=max(1, a.jobs), mp_context=ctx) as pool:
        builds = list(pool.map(_build_one, jobs))
    failed_builds = [(j, b) for j, b in zip(jobs, builds) if "error" in b]
    print(f"# built {len(jobs)} kernels in {time.time() - t_start:.0f} s ({len(failed_builds)} failed)", flush=True)
    for j, b in failed_builds:
        print(f"build failed: {j['kernel']} {AttentionSpec.from_dict(j['spec']).short_name()}: {b['error']}\n"
              f"{b['trace']}", file=sys.stderr)
    if a.build_only:
        for j, b in zip(jobs, builds):
            res = b.get("resources") or {}
            print(f"{j['kernel']:10s} {AttentionSpec.from_dict(j['spec']).short_name():40s} {b.get('knobs')} "
                  f"regs={res.get('registers')} spills={res.get('spills')} occupancy={res.get('occupancy')}")
        return 1 if failed_builds else 0
    dev = tvm.cuda(0)
    print(f"# running on {dev.device_name}", flush=True)

    rows = []
    for job, b in zip(jobs, builds):
        spec = AttentionSpec.from_dict(job["spec"])
        row = {"kernel": job["kernel"], "spec": job["spec"], **b}
        if "error" not in b:
            try:
                m = read_manifest(job["dir"])
                module = tvm.runtime.load_module(str(Path(job["dir"]) / m["library"]))
                kern = AttentionKernel(spec, module[m["entry"]], device="cuda")
                row["validation"] = validate_callable(spec, kern).to_dict()
                t = time_module(module, m["entry"], spec, repeat=5, min_repeat_ms=100, device=dev)
                row["tflops"] = t.gflops(spec) / 1e3
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {e}"
                traceback.print_exc()
        rows.append(row)
        v = row.get("validation", {})
        print(f"{job['kernel']:10s} {spec.short_name():40s} tflops={row.get('tflops')} "
              f"valid={v.get('passed')} max_err={v.get('max_abs_err')} {row.get('error', '')}", flush=True)
    flash = {}
    for spec in specs:
        fn = torch_flash(spec)
        if fn is not None:
            try:
                flash[spec.short_name()] = time_callable(fn, repeat=5, min_repeat_ms=100).gflops(spec) / 1e3
            except Exception as e:  # noqa: BLE001 - e.g. no flash kernel for this dtype/arch
                print(f"torch flash {spec.short_name()}: {type(e).__name__}: {e}", flush=True)

    with open(a.json or out / "gpu_check.json", "w") as f:
        json.dump({"arch": arch, "device": dev.device_name, "rows": rows, "torch_flash_tflops": flash}, f, indent=2)
    fmt = lambda x: f"{x:.1f}" if isinstance(x, float) else "-"  # noqa: E731
    print("\n| dtype | D | causal | S | B×H | kernel | TFLOP/s | FA2 (torch) | ratio | valid | regs | occupancy |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        sp = AttentionSpec.from_dict(r["spec"])
        fa = flash.get(sp.short_name())
        ratio = r["tflops"] / fa if fa and r.get("tflops") else None
        res = r.get("resources") or {}
        print(f"| {sp.dtype} | {sp.head_dim} | {sp.causal} | {sp.seq_q} | {sp.batch}×{sp.heads} | {r['kernel']} | "
              f"{fmt(r.get('tflops'))} | {fmt(fa)} | {fmt(ratio)} | {r.get('validation', {}).get('passed')} | "
              f"{res.get('registers', '-')} | {res.get('occupancy', '-')} |")
    print(f"total {time.time() - t_start:.0f} s")
    failed = [r for r in rows if "error" in r or not r.get("validation", {}).get("passed")]
    for r in failed:
        print(f"FAILED {r['kernel']} {AttentionSpec.from_dict(r['spec']).short_name()}: "
              f"{r.get('error') or r.get('validation')}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
