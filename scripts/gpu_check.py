#!/usr/bin/env python3
"""One-shot GPU check: build, validate and benchmark the CUDA kernels on this machine's GPU.

For S in {1024, 4096, 16384}, D in {64, 128}, causal and not, fp16 and fp32: build the fused
kernel (hand preset for the local GPU's arch), validate it against the float64 NumPy reference
(sampled rows at long lengths), time it next to the materialized build (TVM dlight) and PyTorch
SDPA when torch with CUDA is present, and print TFLOP/s (4·B·H·Sq·Skv·D, halved for causal) plus
the ptxas resources. Writes everything to --json. Sized to finish in a few minutes on an
H100-class GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import tvm

from tvm_attention.artifact import validate_built
from tvm_attention.build import build_kernel
from tvm_attention.cuda_tools import find_nvcc
from tvm_attention.spec import AttentionSpec
from tvm_attention.target import local_cuda_arch, resolve_target
from tvm_attention.timing import time_callable, time_module


def torch_sdpa_cuda(spec):
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    dt = {"float16": torch.float16, "float32": torch.float32, "bfloat16": torch.bfloat16}[spec.dtype]
    q = torch.randn(spec.q_shape, device="cuda", dtype=dt)
    k = torch.randn(spec.kv_shape, device="cuda", dtype=dt)
    v = torch.randn(spec.kv_shape, device="cuda", dtype=dt)

    def run():
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=spec.causal)
        torch.cuda.synchronize()

    return run


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--head-dim", type=int, nargs="+", default=[64, 128])
    p.add_argument("--dtype", nargs="+", default=["float16", "float32"])
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--json", default="gpu_check.json")
    p.add_argument("--skip-materialized-above", type=int, default=8192,
                   help="skip the materialized build past this length (S×S buffers)")
    a = p.parse_args()

    arch = local_cuda_arch()
    if arch is None:
        print("gpu_check: no CUDA GPU visible to TVM (tvm.cuda(0).exist is False)", file=sys.stderr)
        return 2
    if find_nvcc() and "TVM_CUDA_COMPILE_MODE" not in os.environ:
        os.environ["TVM_CUDA_COMPILE_MODE"] = "nvcc"  # NVRTC needs the cuda-bindings package
    target = resolve_target("cuda")
    dev = tvm.cuda(0)
    print(f"# gpu_check on {arch}: {dev.device_name}, tvm {tvm.__version__}", flush=True)
    rows = []
    t_start = time.time()
    for dtype in a.dtype:
        for d in a.head_dim:
            for causal in (False, True):
                for s in a.seq:
                    spec = AttentionSpec(batch=1, heads=a.heads, seq_q=s, head_dim=d, dtype=dtype, causal=causal)
                    row = {"spec": spec.to_dict()}
                    try:
                        built = build_kernel(spec, target=target)
                        row["knobs"] = built.knobs.to_dict()
                        row["resources"] = built.resources
                        row["audit"] = built.audit.verdict
                        v = validate_built(built)
                        row["validation"] = v.to_dict()
                        t = time_module(built.module, built.entry, spec, repeat=5, min_repeat_ms=100, device=dev)
                        row["fused_tflops"] = t.gflops(spec) / 1e3
                    except Exception as e:  # recorded, the sweep goes on
                        row["fused_error"] = f"{type(e).__name__}: {e}"
                        traceback.print_exc()
                    if s <= a.skip_materialized_above:
                        try:
                            mat = build_kernel(spec, "materialized", target=target)
                            tm = time_module(mat.module, mat.entry, spec, repeat=3, min_repeat_ms=50, device=dev)
                            row["materialized_tflops"] = tm.gflops(spec) / 1e3
                        except Exception as e:
                            row["materialized_error"] = f"{type(e).__name__}: {e}"
                    fn = torch_sdpa_cuda(spec)
                    if fn is not None:
                        tq = time_callable(fn, repeat=5, min_repeat_ms=100)
                        row["torch_tflops"] = tq.gflops(spec) / 1e3
                    rows.append(row)
                    print(json.dumps({k: row.get(k) for k in ("fused_tflops", "materialized_tflops", "torch_tflops")})
                          + f"  {spec.short_name()}  valid={row.get('validation', {}).get('passed')}"
                          + f"  max_err={row.get('validation', {}).get('max_abs_err')}", flush=True)
    with open(a.json, "w") as f:
        json.dump({"arch": arch, "device": dev.device_name, "rows": rows}, f, indent=2)
    print("\n| dtype | D | causal | S | fused TFLOP/s | materialized | torch SDPA | valid | regs | spills |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        sp = r["spec"]
        fmt = lambda x: f"{x:.1f}" if isinstance(x, float) else "-"
        res = r.get("resources") or {}
        print(f"| {sp['dtype']} | {sp['head_dim']} | {sp['causal']} | {sp['seq_q']} | {fmt(r.get('fused_tflops'))} | "
              f"{fmt(r.get('materialized_tflops'))} | {fmt(r.get('torch_tflops'))} | "
              f"{r.get('validation', {}).get('passed')} | {res.get('registers', '-')} | {res.get('spills', '-')} |")
    print(f"total {time.time() - t_start:.0f} s; JSON: {a.json}")
    failed = [r for r in rows if "fused_error" in r or not r.get("validation", {}).get("passed")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
