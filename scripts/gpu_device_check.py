#!/usr/bin/env python3
"""The GPU check's device side: run a payload's prebuilt kernels on this GPU next to PyTorch.

Runs where there is no ``apache-tvm`` (``scripts/gpu_payload.py`` builds the payload offline and
its ``run.sh`` calls this): PyTorch, NumPy and tvm-ffi only; it imports the package's loader side
(``tvm_attention.load``), never ``tvm`` or the build path. For each kernel of this GPU's arch:

1. load the artifact (TVM's runtime from the payload, the kernel's precompiled fatbin: no JIT);
2. validate it on seeded random inputs against a float64 torch reference of sampled query rows
   (every row's keys; the tolerance of the dtype, ``tvm_attention.validate.TOLERANCES``);
3. time it (CUDA events, the median of rounds of at least ``--min-ms``) next to torch SDPA's
   flash and cuDNN backends and FlexAttention (``torch.compile``), on the same inputs, in this run.

A symbolic kernel is validated at awkward shapes (``AWKWARD``) and a varlen one on ragged packed
batches (``VARLEN_BATCHES``, every row); each is also timed at every static shape it serves (the
varlen one with the batch packed, its output checked against the static kernel's).

Prints and writes one table (``check.md``, ``check.json`` in ``--out``): TFLOP/s (4·B·H·Sq·Skv·D,
halved when causal), the share of the GPU's dense fp16/bf16 peak, and ours/theirs ratios. Peers
that fail or run past ``--budget`` seconds are recorded as such; the check itself never runs past
the budget by more than one measurement.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

#: dense fp16/bf16 tensor-core peaks (TFLOP/s, SXM parts), by a substring of the device name
PEAKS = {"H200": 989.5, "H100": 989.5, "A100": 312.0, "L40S": 362.1, "L4": 121.0}


def flops(spec) -> float:
    return spec.flops()


def cuda_time(torch, fn, min_ms: float, rounds: int) -> float:
    """Median seconds per call over ``rounds`` rounds of at least ``min_ms`` each (CUDA events)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    n = max(1, int(min_ms / max(start.elapsed_time(end), 1e-3)))
    times = []
    for _ in range(rounds):
        start.record()
        for _ in range(n):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / n / 1e3)
    return statistics.median(times)


def reference_rows(torch, spec, q, k, v, rows):
    """float64 attention of query rows ``rows`` against every key (bottom-right causal)."""
    qs = q[:, :, rows].double()
    kk, vv = k.double(), v.double()
    if spec.kv_heads != spec.heads:
        g = spec.heads // spec.kv_heads
        kk, vv = kk.repeat_interleave(g, dim=1), vv.repeat_interleave(g, dim=1)
    s = torch.matmul(qs, kk.transpose(-1, -2)) * spec.scale
    if spec.causal:  # the lengths are the tensors' (a symbolic kernel's spec holds representatives)
        r = torch.as_tensor(rows, device=q.device).view(-1, 1)
        j = torch.arange(k.shape[2], device=q.device).view(1, -1)
        s = s.masked_fill(j > r + (k.shape[2] - q.shape[2]), float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.matmul(p, vv)


def validate(torch, spec, kernel, q, k, v, seed: int) -> dict:
    from tvm_attention.validate import TOLERANCES

    out = kernel(q, k, v)
    gen = torch.Generator().manual_seed(seed)
    seq_q = q.shape[2]
    n = min(seq_q, 64)
    rows = sorted(set(torch.randperm(seq_q, generator=gen)[:n].tolist()) | {0, seq_q - 1})
    ref = reference_rows(torch, spec, q, k, v, rows)
    got = out[:, :, rows].double()
    atol, rtol = TOLERANCES[spec.dtype]
    diff = (got - ref).abs()
    ok = bool(torch.isfinite(got).all()) and bool((diff <= atol + rtol * ref.abs()).all())
    return {"passed": ok, "max_abs_err": float(diff.max()), "rows_checked": len(rows), "atol": atol, "rtol": rtol}


def fp8_inputs(torch, spec, dtype, device: str, gen) -> list:
    """The arguments of an fp8-input build (``spec.q_dtype``) before ``o``: q, k, v drawn in
    ``dtype`` and quantized per head (``quant.quantize_kv``, on the CPU), then ``q_scale``,
    ``k_scale``, ``v_scale``."""
    from tvm_attention.quant import quantize_kv

    drawn = [torch.randn(shape, device=device, dtype=dtype, generator=gen)
             for shape in (spec.q_shape, spec.kv_shape, spec.v_shape)]
    (q, qs), (k, ks), (v, vs) = (quantize_kv(t.cpu(), spec.q_dtype, head_axis=1) for t in drawn)
    return [t.to(device) for t in (q, k, v, qs, ks, vs)]


def validate_fp8(torch, spec, kernel, x: list, seed: int) -> dict:
    """An fp8-input build's output on sampled rows against float64 attention of what its inputs
    stand for (``scale · stored``), within ``validate.tolerances`` (P is rounded to e4m3)."""
    from tvm_attention.validate import tolerances

    out = kernel(*x)
    q, k, v = (t.double() * s.double().view(1, -1, 1, 1) for t, s in zip(x[:3], x[3:]))
    gen = torch.Generator().manual_seed(seed)
    seq_q = q.shape[2]
    rows = sorted(set(torch.randperm(seq_q, generator=gen)[:min(seq_q, 64)].tolist()) | {0, seq_q - 1})
    ref = reference_rows(torch, spec, q, k, v, rows)
    got = out[:, :, rows].double()
    atol, rtol = tolerances(spec)
    diff = (got - ref).abs()
    ok = bool(torch.isfinite(got).all()) and bool((diff <= atol + rtol * ref.abs()).all())
    return {"passed": ok, "max_abs_err": float(diff.max()), "rows_checked": len(rows), "atol": atol, "rtol": rtol}


#: the payload's modifier builds (``gpu_payload.MODIFIER_GOAL``, named by a job's ``twin``) in
#: FlexAttention's terms: name -> (the modifier's tensors -> its ``score_mod``). Each is the
#: package's source written in torch; ``test_gpu_payload`` checks the two agree on the CPU
FLEX_TWINS = {
    "relative_bias": lambda tensors: (lambda score, b, h, q_idx, kv_idx: score + tensors["bias"][h] * (q_idx - kv_idx)),
}


def modifier_inputs(torch, spec, dtype, device: str, gen) -> dict:
    """A modifier build's arguments by name: q, k, v drawn in ``dtype``, its tensors (float32)
    small enough to leave the softmax well spread (a slope of at most 0.01 a position)."""
    x = {"q": torch.randn(spec.q_shape, device=device, dtype=dtype, generator=gen),
         "k": torch.randn(spec.kv_shape, device=device, dtype=dtype, generator=gen),
         "v": torch.randn(spec.v_shape, device=device, dtype=dtype, generator=gen)}
    for name, tdtype, dims in spec.mod_tensors:
        shape = tuple(getattr(spec, d) if isinstance(d, str) else d for d in dims)
        x[name] = (torch.rand(shape, device=device, generator=gen) * 0.01).to(getattr(torch, tdtype))
    return x


def validate_modifier(torch, spec, out, x: dict, seed: int) -> dict:
    """A modifier build's output on sampled rows against the package's float64 NumPy reference
    (which knows the modifiers' semantics), within the dtype's tolerances."""
    import numpy as np

    from tvm_attention.reference import reference_attention
    from tvm_attention.validate import TOLERANCES

    gen = torch.Generator().manual_seed(seed)
    rows = np.array(sorted(set(torch.randperm(spec.seq_q, generator=gen)[:32].tolist()) | {0, spec.seq_q - 1}))
    host = {n: t.float().cpu().numpy().astype(np.float64) for n, t in x.items()}
    ref = reference_attention(spec, host["q"], host["k"], host["v"], rows=rows,
                              mod_tensors={n: host[n] for n, _, _ in spec.mod_tensors})
    got = out[:, :, torch.as_tensor(rows, device=out.device)].double().cpu().numpy()
    atol, rtol = TOLERANCES[spec.dtype]
    diff = np.abs(got - ref)
    ok = bool(np.isfinite(got).all() and (diff <= atol + rtol * np.abs(ref)).all())
    return {"passed": ok, "max_abs_err": float(diff.max()), "rows_checked": len(rows), "atol": atol, "rtol": rtol}


def modifier_goal(torch, kernels: list[dict], rows: dict, payload: Path, torch_dtype: dict, min_ms: float,
                  rounds: int, no_flex: bool) -> None:
    """The modifier goal's builds (``twin`` in the payload): each validated on sampled rows and
    timed, then compiled FlexAttention with the same modifier (its twin) timed on the same
    inputs, as columns ``tc_mod`` and ``flex_mod`` of the plain build's row (the same shape)."""
    import tvm_attention
    import tvm_ffi
    from tvm_attention.spec import AttentionSpec

    for i, k in enumerate(kernels):
        spec = AttentionSpec.from_dict(k["spec"])
        plain = dataclasses.replace(spec, score_mod=None, mask_mod=None, mod_tensors=())
        row = rows.setdefault(plain.short_name(), {"spec": plain.to_dict(), "tflops": {}, "errors": {}})
        x = modifier_inputs(torch, spec, torch_dtype[spec.dtype], "cuda", torch.Generator(device="cuda").manual_seed(i))
        try:
            kernel = tvm_attention.load(payload / k["dir"])
            args = [x["q"], x["k"], x["v"], *(x[n] for n, _, _ in spec.mod_tensors)]
            row.setdefault("validation", {})["tc_mod"] = validate_modifier(torch, spec, kernel(*args), x, seed=i)
            ffi = [tvm_ffi.from_dlpack(t) for t in (*args, torch.empty_like(x["q"]))]
            fn = kernel.function
            with tvm_ffi.use_torch_stream():
                row["tflops"]["tc_mod"] = flops(spec) / cuda_time(torch, lambda: fn(*ffi), min_ms, rounds) / 1e12
        except Exception as e:  # noqa: BLE001 - recorded in the row, the check goes on
            row["errors"]["tc_mod"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        if no_flex:
            row["errors"]["flex_mod"] = "skipped (--no-flex)"
            continue
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            torch._dynamo.reset()
            compiled = torch.compile(flex_attention)
            off = spec.seq_kv - spec.seq_q
            mask = create_block_mask(lambda b, h, q_, j: j <= q_ + off, None, None, spec.seq_q, spec.seq_kv,
                                     device="cuda") if spec.causal else None
            twin = FLEX_TWINS[k["twin"]](x)
            row["tflops"]["flex_mod"] = flops(spec) / cuda_time(
                torch, lambda: compiled(x["q"], x["k"], x["v"], score_mod=twin, block_mask=mask, scale=spec.scale),
                min_ms, rounds) / 1e12
        except Exception as e:  # noqa: BLE001
            row["errors"]["flex_mod"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"


def modifier_lines(rows: dict) -> list[str]:
    """The modifier goal's lines (``check.md``): per shape, the plain tensor-core build, the same
    with the modifier, its cost over the plain one (goal: at most 1.10) and against compiled
    FlexAttention with the same modifier (goal: at least 1.0); nothing without such a row."""
    from tvm_attention.spec import AttentionSpec

    f = fmt
    had = [(key, row) for key, row in rows.items() if "tc_mod" in row["tflops"] or "tc_mod" in row["errors"]]
    if not had:
        return []
    lines = ["", "A score modifier (relative bias from a tensor) on tensor cores (goals: at most 1.10x the plain "
                 "kernel's time, at least 1.0x compiled FlexAttention with the same modifier):", "",
             "| dtype | D | causal | S | B×H | tc | tc + modifier | time over plain | flex + modifier | "
             "ours / flex | valid |", "|" + "---|" * 11]
    def ratio(a, b, t):  # a / b of two TFLOP/s (the same FLOPs: a time ratio the other way)
        return t[a] / t[b] if t.get(a) and t.get(b) else None

    for key, row in had:
        sp, t = AttentionSpec.from_dict(row["spec"]), row["tflops"]
        lines.append(f"| {sp.dtype} | {sp.head_dim} | {sp.causal} | {sp.seq_q} | {sp.batch}×{sp.heads} | "
                     f"{f(t.get('fused_tc'))} | {f(t.get('tc_mod'))} | {f(ratio('fused_tc', 'tc_mod', t), '{:.2f}')} | "
                     f"{f(t.get('flex_mod'))} | {f(ratio('tc_mod', 'flex_mod', t), '{:.2f}')} | "
                     f"{row.get('validation', {}).get('tc_mod', {}).get('passed')} |")
    return lines


def peers(torch, spec, q, k, v):
    """name -> callable of each torch peer on the same inputs (None when torch lacks it)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    F = torch.nn.functional
    out = {}
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", getattr(SDPBackend, "CUDNN_ATTENTION", None))):
        if backend is None:
            out[name] = None
            continue

        def run(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=spec.causal, scale=spec.scale)

        out[name] = run
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        # a fresh compile per shape: dynamo's cache is per function, and past its recompile limit
        # (8) flex_attention runs eager, unfused (the score matrix in memory), a figure 30x too low
        torch._dynamo.reset()
        compiled = torch.compile(flex_attention)
        mask = None
        if spec.causal:
            off = spec.seq_kv - spec.seq_q
            mask = create_block_mask(lambda b, h, i, j: j <= i + off, None, None, spec.seq_q, spec.seq_kv,
                                     device=q.device)
        out["flex"] = lambda: compiled(q, k, v, block_mask=mask, scale=spec.scale)
    except Exception:  # noqa: BLE001 - an older torch: recorded as missing
        out["flex"] = None
    return out


def preload_runtime(payload: Path, manifests: list[dict]) -> None:
    """TVM's runtime libraries from the payload (one copy for every kernel), after checking them
    against the SHA-256 every manifest records; only those the manifests list (a CPU payload
    carries no CUDA runtime)."""
    from tvm_attention import runtime

    want = {e["file"]: e["sha256"] for m in manifests for e in m.get("runtime_libraries", [])}
    for name, sha in want.items():
        h = hashlib.sha256((payload / "runtime" / name).read_bytes()).hexdigest()
        if h != sha:
            raise RuntimeError(f"runtime/{name}: SHA-256 {h} is not the one the kernels were built with ({sha})")
    runtime.ensure_runtime(payload / "runtime", [n for n in (runtime.RUNTIME_CPU, runtime.RUNTIME_CUDA) if n in want])


#: a static shape's row names the symbolic build of each kernel that is timed there too
DYN_NAMES = {"fused_tc": "tc_dyn", "fused_simt": "simt_dyn", "fused_hopper": "hopper_dyn"}
#: kernels not yet run on a GPU: each first runs once in a child process (``--smoke``), so that a
#: hang or a fault (which poisons the CUDA context) costs that kernel alone, not the check
UNPROVEN = ("fused_hopper",)
SMOKE_SECONDS = 60.0  # per kernel, the child's start included


def smoke_child(payload: Path, dirs: list[str]) -> int:
    """``--smoke``: load and run each kernel once on its own shape (symbolic ones at a small one),
    validate it, and print one ``SMOKE`` line per kernel as it finishes."""
    import torch

    import tvm_attention
    from tvm_attention.spec import AttentionSpec

    torch_dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
    for i, d in enumerate(dirs):
        print(f"SMOKE start {d}", flush=True)
        try:
            spec = AttentionSpec.from_dict(json.loads((payload / d / "manifest.json").read_text())["spec"])
            if spec.dynamic:  # an awkward shape: tails in both lengths, a batch of 2
                spec = dataclasses.replace(spec, dynamic=(), batch=2, seq_q=300, seq_kv=517)
            kernel = tvm_attention.load(payload / d)
            gen = torch.Generator(device="cuda").manual_seed(i)
            q, k, v = (torch.randn(s, device="cuda", dtype=torch_dtype[spec.dtype], generator=gen)
                       for s in (spec.q_shape, spec.kv_shape, spec.kv_shape))
            res = validate(torch, spec, kernel, q, k, v, seed=i)
            torch.cuda.synchronize()
            print(f"SMOKE {'ok' if res['passed'] else 'invalid'} {d} {res['max_abs_err']}", flush=True)
        except Exception as e:  # noqa: BLE001 - a Python-level error: reported, the next kernel runs
            print(f"SMOKE error {d} {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}", flush=True)
    return 0


def smoke(payload: Path, kernels: list[dict], seconds: float = SMOKE_SECONDS, child: list[str] | None = None
          ) -> dict[str, str]:
    """Run ``kernels`` once each in child processes (``smoke_child``; ``child``: the command that
    runs it, this script by default); returns dir -> why it failed ("hang", "crash (exit N)",
    "invalid ERR", "error ...") for those that did not pass. A child that hangs past ``seconds`` on
    one kernel, or dies, costs that kernel: the next child starts after it."""
    import subprocess
    import threading

    failed: dict[str, str] = {}
    todo = [k["dir"] for k in kernels]
    while todo:
        cmd = [*(child or [sys.executable, str(Path(__file__).resolve())]), "--payload", str(payload), "--smoke", *todo]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
        reader.start()
        current, deadline, seen = None, time.time() + seconds, 0
        while proc.poll() is None and time.time() < deadline:
            time.sleep(0.2)
            for ln in lines[seen:]:
                parts = ln.split(maxsplit=3)
                if len(parts) >= 3 and parts[0] == "SMOKE":
                    if parts[1] == "start":
                        current, deadline = parts[2], time.time() + seconds
                    else:
                        todo.remove(parts[2])
                        current = None
                        if parts[1] != "ok":
                            failed[parts[2]] = f"{parts[1]} {parts[3].strip() if len(parts) > 3 else ''}".strip()
            seen = len(lines)
        if proc.poll() is None:
            proc.kill()
            why = "hang"
        else:
            why = f"crash (exit {proc.returncode})"
        reader.join(timeout=5)
        for ln in lines[seen:]:  # the child's last words
            parts = ln.split(maxsplit=3)
            if len(parts) >= 3 and parts[0] == "SMOKE" and parts[1] != "start" and parts[2] in todo:
                todo.remove(parts[2])
                if parts[1] != "ok":
                    failed[parts[2]] = f"{parts[1]} {parts[3].strip() if len(parts) > 3 else ''}".strip()
        if current is not None and current in todo:
            failed[current] = f"{why}: {''.join(lines[-3:]).strip()[:300]}"
            todo.remove(current)
        elif todo and proc.returncode not in (0, None):
            failed[todo.pop(0)] = why
        elif todo and why == "hang":
            failed[todo.pop(0)] = why
    return failed
#: (batch, seq_q, seq_kv) every symbolic kernel is validated at: one key, key tails, Sq > Skv, a
#: decode row over a long cache, no key (zero rows), a batch of 3 (the grid's z)
AWKWARD = [(1, 1, 1), (3, 37, 45), (1, 113, 203), (3, 1, 517), (1, 300, 45), (2, 37, 1), (1, 5, 0),
           (2, 1000, 4099)]


def check_cases(kernels: list[dict], payload: Path, cases, key: str, run_case, what: str) -> list[dict]:
    """Each kernel through the loader on every case (``cases``: a list, or the spec's list from
    ``cases(spec)``): ``run_case(i, spec, kernel, case)`` returns the validation of kernel ``i``
    on ``case``; an error is recorded as a failed case and the check goes on. Each result holds
    the kernel, the case (under ``key``) and the validation."""
    import tvm_attention
    from tvm_attention.spec import AttentionSpec

    out = []
    for i, k in enumerate(kernels):
        spec = AttentionSpec.from_dict(k["spec"])
        try:
            kernel = tvm_attention.load(payload / k["dir"])
        except Exception as e:  # noqa: BLE001 - recorded, the check goes on
            out.append({"kernel": k["dir"], key: [], "passed": False, "error": f"{type(e).__name__}: {e}"})
            continue
        todo = cases(spec) if callable(cases) else cases
        for case in todo:
            try:
                r = run_case(i, spec, kernel, case)
            except Exception as e:  # noqa: BLE001
                r = {"passed": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
            shown = case if isinstance(case, dict) else [list(c) if isinstance(c, tuple) else c for c in case]
            out.append({"kernel": k["dir"], key: shown, **r})
        print(f"{what} {k['dir']}: {sum(c['passed'] for c in out if c['kernel'] == k['dir'])}/{len(todo)} "
              "valid", flush=True)
    return out


def check_symbolic(torch, kernels: list[dict], payload: Path, torch_dtype: dict, device: str = "cuda") -> list[dict]:
    """Each symbolic kernel through the loader at every ``AWKWARD`` shape against the reference
    (``device``: where the inputs live; the tests run it on CPU artifacts)."""

    def run_case(i, spec, kernel, shape):
        b, sq, sk = shape
        gen = torch.Generator(device=device).manual_seed(i * 1000 + sq)
        shapes = [(b, spec.heads, sq, spec.head_dim)] + [(b, spec.kv_heads, sk, spec.head_dim)] * 2
        x = [torch.randn(s, device=device, dtype=torch_dtype[spec.dtype], generator=gen) for s in shapes]
        return validate(torch, spec, kernel, *x, seed=sq)

    return check_cases(kernels, payload, AWKWARD, "shape", run_case, "symbolic")


#: a static shape's row names the varlen build of each kernel timed there (the batch packed)
VARLEN_NAMES = {"fused_tc": "tc_varlen", "fused_simt": "simt_varlen", "fused_hopper": "hopper_varlen"}
#: packed batches ((seq_q, seq_kv) per sequence) every varlen kernel is validated on, every row:
#: empty sequences, one row, Sq above and below Skv, no keys (zero rows), tails, long among short
VARLEN_BATCHES = [[(0, 7), (1, 1), (70, 33), (33, 70), (5, 0), (129, 129), (0, 0), (3, 200)], [(37, 45)],
                  [(1, 1)] * 3, [(1000, 4099), (300, 45), (1, 517)]]


def packed_inputs(torch, spec, lens, dtype, device: str, gen):
    """q ``(total_q, H, D)``, k, v ``(total_k, KH, D)`` and cu_seqlens_q/k (int32) on ``device``."""
    cq = [0]
    ck = [0]
    for sq, sk in lens:
        cq.append(cq[-1] + sq)
        ck.append(ck[-1] + sk)
    q = torch.randn((cq[-1], spec.heads, spec.head_dim), device=device, dtype=dtype, generator=gen)
    k = torch.randn((ck[-1], spec.kv_heads, spec.head_dim), device=device, dtype=dtype, generator=gen)
    v = torch.randn((ck[-1], spec.kv_heads, spec.head_dim), device=device, dtype=dtype, generator=gen)
    as_index = lambda c: torch.tensor(c, dtype=torch.int32, device=device)  # noqa: E731
    return q, k, v, as_index(cq), as_index(ck)


def validate_varlen(torch, spec, kernel, q, k, v, cq, ck) -> dict:
    """Every row of every sequence against the float64 reference of that sequence alone."""
    from tvm_attention.validate import TOLERANCES

    out = kernel(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck)
    atol, rtol = TOLERANCES[spec.dtype]
    ok, worst = bool(torch.isfinite(out).all()), 0.0
    bounds_q, bounds_k = cq.tolist(), ck.tolist()
    for b in range(len(bounds_q) - 1):
        q0, q1, k0, k1 = bounds_q[b], bounds_q[b + 1], bounds_k[b], bounds_k[b + 1]
        if q1 == q0:
            continue

        def bhsd(x, lo, hi):
            return x[lo:hi].transpose(0, 1).unsqueeze(0)

        ref = reference_rows(torch, spec, bhsd(q, q0, q1), bhsd(k, k0, k1), bhsd(v, k0, k1), list(range(q1 - q0)))
        diff = (bhsd(out, q0, q1).double() - ref).abs()
        worst = max(worst, float(diff.max()))
        ok = ok and bool((diff <= atol + rtol * ref.abs()).all())
        if k1 == k0:
            ok = ok and not bool(out[q0:q1].any())  # no key: exact zeros
    return {"passed": ok, "max_abs_err": worst, "rows_checked": int(bounds_q[-1]), "atol": atol, "rtol": rtol}


def check_varlen(torch, kernels: list[dict], payload: Path, torch_dtype: dict, device: str = "cuda") -> list[dict]:
    """Each varlen kernel through the loader on every ``VARLEN_BATCHES`` batch against the
    reference (``device``: where the inputs live; the tests run it on CPU artifacts)."""

    def run_case(i, spec, kernel, lens):
        gen = torch.Generator(device=device).manual_seed(i * 1000 + len(lens))
        return validate_varlen(torch, spec, kernel, *packed_inputs(torch, spec, lens, torch_dtype[spec.dtype], device,
                                                                  gen))

    return check_cases(kernels, payload, VARLEN_BATCHES, "seqlens", run_case, "varlen")


#: (seq_q, cache_seqlens) every KV-cache kernel is validated at, every row: a decode step over
#: mixed caches (empty, one key, tile and page edges), 4 new tokens, a prefill chunk of 37 over
#: shorter caches (causal rows that see no key: zeros); the layouts' own validation cases; then
#: small batches of long caches, which split-KV cuts into chunks (and a chunk past the keys)
CACHE_CASES = [(1, [0, 1, 15, 16, 17, 63, 65, 200, 3]), (4, [0, 1, 15, 16, 17, 63, 65, 200, 3]),
               (37, [0, 37, 100, 20]), (1, [5000, 0, 1100]), (4, [4097, 300])]

#: (batch, keys) a KV-cache kernel's decode step is timed at, each against the streaming read:
#: the decode goal's batch 64 (no split: 512 thread blocks), then batches too small to fill the
#: GPU alone, which split-KV spreads over the SMs
DECODE_STEPS = [(None, None), (4, 16384), (1, 32768)]  # None: the build's own batch and keys


def cache_inputs(torch, spec, seq_q: int, lens: list[int], dtype, device: str, gen) -> list:
    """A KV-cache kernel's inputs in call order on ``device``: q ``(B, H, seq_q, D)``; kvcache
    ``k_cache``/``v_cache (B, KH, max_len, D)``; paged ``k_pages``/``v_pages (num_pages,
    page_size, KH, D)`` in shuffled order with 3 spare pages and ``block_table (B, max_pages)``
    padded with -1 (never read); then ``cache_seqlens (B,) int32``; an appending kernel's
    ``k_new``/``v_new (B, KH, seq_q, D)`` last (the caches with room for them)."""
    b, kh, d = len(lens), spec.kv_heads, spec.head_dim
    q = torch.randn((b, spec.heads, seq_q, d), device=device, dtype=dtype, generator=gen)
    cs = torch.tensor(lens, dtype=torch.int32, device=device)
    room = seq_q if spec.append else 0  # the keys the call appends
    new = [torch.randn((b, kh, seq_q, d), device=device, dtype=dtype, generator=gen) for _ in range(2)] \
        if spec.append else []
    if spec.layout == "kvcache":
        shape = (b, kh, max(lens + [1]) + room, d)
        return quantized(torch, spec, [q, torch.randn(shape, device=device, dtype=dtype, generator=gen),
                                       torch.randn(shape, device=device, dtype=dtype, generator=gen), cs]) + new
    p = spec.page_size
    need = [-(-(n + room) // p) for n in lens]
    num = sum(need) + 3
    order = torch.randperm(num, device=device, generator=gen).to(torch.int32)
    table = torch.full((b, max(need + [1])), -1, dtype=torch.int32, device=device)
    start = 0
    for i, n in enumerate(need):
        table[i, :n] = order[start:start + n]
        start += n
    shape = (num, p, kh, d)
    return quantized(torch, spec, [q, torch.randn(shape, device=device, dtype=dtype, generator=gen),
                                   torch.randn(shape, device=device, dtype=dtype, generator=gen), table, cs]) + new


def quantized(torch, spec, x: list) -> list:
    """``cache_inputs``' ``x`` with an 8-bit cache's K and V quantized per KV head
    (``quant.quantize_kv``, on the CPU) and their scales ``k_scale``, ``v_scale`` appended (the
    call order); ``x`` unchanged for a cache in the query dtype."""
    if not spec.kv_quantized:
        return x
    from tvm_attention.quant import quantize_kv

    axis = 1 if spec.layout == "kvcache" else 2
    (kq, ks), (vq, vs) = (quantize_kv(t.cpu(), spec.kv_dtype, head_axis=axis) for t in (x[1], x[2]))
    dev = x[0].device
    return [x[0], kq.to(dev), vq.to(dev), *x[3:], ks.to(dev), vs.to(dev)]


def cache_seqlens_of(spec, x: list):
    """``cache_seqlens`` among ``cache_inputs``' ``x`` (after block_table in paged)."""
    return x[3] if spec.layout == "kvcache" else x[4]


def cache_keys(spec, x: list, b: int, n: int):
    """Sequence ``b``'s first ``n`` keys and values of ``cache_inputs``' ``x``, as ``(1, KH, n, D)``
    (an 8-bit cache's dequantized: ``scale[h] · stored``, float32)."""
    k, v = x[1], x[2]
    if spec.kv_quantized:
        shape = (1, -1, 1, 1) if spec.layout == "kvcache" else (1, 1, -1, 1)
        ks, vs = x[-4:-2] if spec.append else x[-2:]
        k, v = k.float() * ks.view(shape), v.float() * vs.view(shape)
    if spec.layout == "kvcache":
        return k[b:b + 1, :, :n], v[b:b + 1, :, :n]
    pages = x[3][b, :-(-n // spec.page_size)].long()

    def gather(pool):
        return pool[pages].reshape(-1, spec.kv_heads, spec.head_dim)[:n].transpose(0, 1).unsqueeze(0)

    return gather(k), gather(v)


def appended_keys(torch, spec, x: list, b: int):
    """An appending call's new keys and values of sequence ``b`` as the cache must hold them:
    ``k_new``/``v_new`` quantized with the cache's scales (``quant.quantize_kv``, on the CPU) for
    an 8-bit cache, ``(1, KH, seq_q, D)`` in the cache's dtype."""
    kn, vn = x[-2][b:b + 1], x[-1][b:b + 1]
    if not spec.kv_quantized:
        return kn, vn
    from tvm_attention.quant import quantize_kv

    return tuple(quantize_kv(t.cpu().float(), spec.kv_dtype, head_axis=1, scale=s.cpu())[0].to(t.device)
                 for t, s in ((kn, x[-4]), (vn, x[-3])))


def validate_cache(torch, spec, kernel, x: list) -> dict:
    """Every row of every sequence of a KV-cache call against the float64 reference of that
    sequence's keys; a sequence with no key must give exact zeros. Appending: the reference
    attends to the keys the cache held before the call and the new ones, quantized here, and
    the cache must hold those new ones afterwards, bit for bit."""
    from tvm_attention.validate import TOLERANCES

    before = [t.clone() for t in x[1:3]] if spec.append else None  # the kernel writes the new keys
    out = kernel(*x)
    atol, rtol = TOLERANCES[spec.dtype]
    ok, worst = bool(torch.isfinite(out).all()), 0.0
    seq_q = x[0].shape[2]
    for b, n in enumerate(cache_seqlens_of(spec, x).tolist()):
        kb, vb = cache_keys(spec, x if before is None else [x[0], *before, *x[3:]], b, n)
        if spec.append:
            kn, vn = (t.float() * s.view(1, -1, 1, 1) if spec.kv_quantized else t
                      for t, s in zip(appended_keys(torch, spec, x, b), x[-4:-2]))
            kw, vw = cache_keys(spec, x, b, n + seq_q)  # what the call left in the cache
            ok = ok and bool((kw[:, :, n:] == kn).all()) and bool((vw[:, :, n:] == vn).all())
            kb, vb = torch.cat([kb, kn], 2), torch.cat([vb, vn], 2)
        ref = reference_rows(torch, spec, x[0][b:b + 1], kb, vb, list(range(seq_q)))
        diff = (out[b:b + 1].double() - ref).abs()
        worst = max(worst, float(diff.max()) if diff.numel() else 0.0)
        ok = ok and bool((diff <= atol + rtol * ref.abs()).all())
        if n == 0 and not spec.append:  # no key (appending, the new ones)
            ok = ok and not bool(out[b].any())
    return {"passed": ok, "max_abs_err": worst, "rows_checked": int(out.shape[0] * seq_q), "atol": atol,
            "rtol": rtol}


def check_cache(torch, kernels: list[dict], payload: Path, torch_dtype: dict, device: str = "cuda") -> list[dict]:
    """Each KV-cache kernel (kvcache, paged) through the loader at every ``CACHE_CASES`` case
    against the reference (``device``: where the inputs live; the tests run it on CPU artifacts)."""

    def run_case(i, spec, kernel, case):
        seq_q, lens = case
        gen = torch.Generator(device=device).manual_seed(i * 1000 + seq_q)
        return validate_cache(torch, spec, kernel, cache_inputs(torch, spec, seq_q, lens, torch_dtype[spec.dtype],
                                                                device, gen))

    return check_cases(kernels, payload, CACHE_CASES, "case", run_case, "cache")


def check_variants(torch, kernels: list[dict], payload: Path, device: str = "cuda") -> list[dict]:
    """Each build with attention variants (window, softcap, ALiBi, sinks, kv_start; float16 or
    float32) through the loader on its layout's validation cases, against the package's float64
    reference (``tvm_attention.layouts``: NumPy, no TVM), which knows the variants' semantics
    (the torch reference here does not): inputs from ``random_inputs`` moved to ``device``, the
    output (and the log-sum-exp, with ``return_lse``) compared on the host."""
    import numpy as np

    from tvm_attention.layouts import LAYOUTS
    from tvm_attention.validate import TOLERANCES

    def run_case(i, spec, kernel, case):
        layout = LAYOUTS[spec.layout]
        x = layout.random_inputs(spec, case, seed=i)
        got = kernel(*[torch.from_numpy(np.ascontiguousarray(x[a.name])).to(device) for a in layout.inputs_of(spec)])
        o, lse = (got[0], got[1]) if isinstance(got, tuple) else (got, None)
        ref, ref_lse = layout.reference_outputs(spec, x)
        out = o.double().cpu().numpy()
        atol, rtol = TOLERANCES[spec.dtype]
        ok = bool(np.isfinite(out).all() and np.allclose(out, ref, atol=atol, rtol=rtol))
        if lse is not None:
            lse = lse.cpu().numpy()
            seen = np.isfinite(ref_lse)
            ok = ok and bool(np.array_equal(np.isneginf(lse), np.isneginf(ref_lse))
                             and np.allclose(lse[seen], ref_lse[seen], atol=1e-3, rtol=1e-4))
        return {"passed": ok, "max_abs_err": float(np.abs(out - ref).max()) if out.size else 0.0}

    return check_cases(kernels, payload, lambda spec: LAYOUTS[spec.layout].validation_cases(spec), "case", run_case,
                       "variants")


def cascade_inputs(torch, spec, prefix_len: int, suffix_len: int, dtype, device: str, gen) -> dict:
    """A cascade step of the serving ``spec`` (paged, ``page_size`` dividing ``prefix_len``):
    ``spec.batch`` sequences of ``seq_q`` new tokens over a prefix of ``prefix_len`` keys they share
    (its pages once in the pool) and suffixes of ``suffix_len`` keys each. ``q``, the pools
    ``k``/``v (pages, page_size, KH, D)``, and three ``(block_table, cache_seqlens)``: the prefix's
    (one sequence), the suffixes', and ``plain``: each sequence's whole keys, the prefix's pages
    then its own (how a server without the cascade reads a shared prefix: every sequence reads it)."""
    n, page = spec.batch, spec.page_size
    if prefix_len % page:
        raise ValueError(f"cascade_inputs: the prefix ({prefix_len} keys) must fill whole pages of {page}")
    pp, sp = prefix_len // page, -(-suffix_len // page)
    shape = (pp + n * sp, page, spec.kv_heads, spec.head_dim)
    i32 = dict(dtype=torch.int32, device=device)
    ptable = torch.arange(pp, **i32).view(1, pp)
    stable = (pp + torch.arange(n * sp, **i32)).view(n, sp)
    return {"q": torch.randn((n, spec.heads, spec.seq_q, spec.head_dim), device=device, dtype=dtype, generator=gen),
            "k": torch.randn(shape, device=device, dtype=dtype, generator=gen),
            "v": torch.randn(shape, device=device, dtype=dtype, generator=gen),
            "prefix": (ptable, torch.tensor([prefix_len], **i32)),
            "suffix": (stable, torch.full((n,), suffix_len, **i32)),
            "plain": (torch.cat([ptable.expand(n, pp), stable], 1), torch.full((n,), prefix_len + suffix_len, **i32))}


def cascade_run(torch, spec, prefix_kernel, suffix_kernel, x: dict) -> tuple[dict, dict]:
    """The cascade (``cascade.attend``: the stacked queries over the shared prefix once, each
    sequence over its suffix, the states merged with torch's ops where the tensors are) of
    :func:`cascade_inputs`' ``x``, validated against the suffix kernel's plain call over each
    sequence's whole keys (output and lse) and both against the float64 reference of the first
    and last sequence; and the calls to time: ``cascade`` (the whole step through the loader),
    ``plain`` (the same step without the cascade), and the cascade's parts on prepared arguments
    (``prefix``, ``suffix``, ``merge``)."""
    from tvm_attention import cascade
    from tvm_attention.merge import merge_states
    from tvm_attention.validate import TOLERANCES

    q, k, v = x["q"], x["k"], x["v"]
    prefix, suffix, plain = (k, v, *x["prefix"]), (k, v, *x["suffix"]), (k, v, *x["plain"])
    o, lse = cascade.attend(prefix_kernel, suffix_kernel, q, prefix, suffix)
    o_plain, lse_plain = suffix_kernel(q, *plain)
    atol, rtol = TOLERANCES[spec.dtype]
    diff = (o.double() - o_plain.double()).abs()
    ok = bool(torch.isfinite(o).all()) and bool((diff <= atol + rtol * o_plain.double().abs()).all())
    ok = ok and bool(torch.allclose(lse, lse_plain, atol=1e-3, rtol=1e-4))
    worst = float(diff.max())
    table, lens = x["plain"]
    for b in sorted({0, spec.batch - 1}):
        n = int(lens[b])
        pages = table[b, :-(-n // spec.page_size)].long()
        kb, vb = (pool[pages].reshape(-1, spec.kv_heads, spec.head_dim)[:n].transpose(0, 1).unsqueeze(0)
                  for pool in (k, v))
        ref = reference_rows(torch, spec, q[b:b + 1], kb, vb, list(range(spec.seq_q)))
        for out in (o, o_plain):
            d = (out[b:b + 1].double() - ref).abs()
            worst = max(worst, float(d.max()))
            ok = ok and bool((d <= atol + rtol * ref.abs()).all())
    stacked = cascade.stack_queries(q, spec.kv_heads)
    o_p, lse_p = prefix_kernel(stacked, *prefix)
    o_s, lse_s = suffix_kernel(q, *suffix)
    n, h, sq = spec.batch, spec.heads, spec.seq_q
    calls = {"cascade": lambda: cascade.attend(prefix_kernel, suffix_kernel, q, prefix, suffix),
             "plain": lambda: suffix_kernel(q, *plain),
             "prefix": lambda: prefix_kernel(stacked, *prefix), "suffix": lambda: suffix_kernel(q, *suffix),
             "merge": lambda: merge_states(cascade.unstack(o_p, n, h, sq), cascade.unstack(lse_p, n, h, sq), o_s, lse_s)}
    return {"passed": ok, "max_abs_err": worst, "atol": atol, "rtol": rtol}, calls


def cascade_goal(torch, kernels: list[dict], payload: Path, torch_dtype: dict, min_ms: float, rounds: int) -> list[dict]:
    """The cascade's builds (``cascade`` in the payload: a prefix and a suffix kernel of one
    serving spec per kernel family) at ``gpu_payload.CASCADE``'s step: validated
    (:func:`cascade_run`), then each call timed (microseconds) and the bytes of K and V each reads."""
    import tvm_attention
    from tvm_attention.spec import AttentionSpec

    out = []
    for family in sorted({k["kernel"] for k in kernels}):
        pair = {k["cascade"]: k for k in kernels if k["kernel"] == family}
        entry = {"kernel": family, "serving": pair.get("suffix", pair.get("prefix"))["serving"]}
        try:
            spec = AttentionSpec.from_dict(entry["serving"])
            pre, suf = entry["lengths"] = pair["suffix"]["lengths"]
            kp, ks = (tvm_attention.load(payload / pair[w]["dir"]) for w in ("prefix", "suffix"))
            x = cascade_inputs(torch, spec, pre, suf, torch_dtype[spec.dtype], "cuda",
                               torch.Generator(device="cuda").manual_seed(7))
            entry["validation"], calls = cascade_run(torch, spec, kp, ks, x)
            entry["us"] = {name: cuda_time(torch, fn, min_ms, rounds) * 1e6 for name, fn in calls.items()}
            per_key = 2 * spec.kv_heads * spec.head_dim * spec.kv_itemsize  # K and V
            entry["bytes"] = {"cascade": (pre + spec.batch * suf) * per_key, "plain": spec.batch * (pre + suf) * per_key}
        except Exception as e:  # noqa: BLE001 - recorded, the check goes on
            entry["error"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        out.append(entry)
        print(f"cascade {family}: {entry.get('us')} {entry.get('validation') or entry.get('error')}", flush=True)
    return out


def cascade_lines(results: list[dict]) -> list[str]:
    """The cascade's lines (``check.md``): per kernel family, the step with the shared prefix read
    once against the same step reading it in every sequence (both through the loader), the
    cascade's parts on prepared arguments, and the bytes of K and V each reads."""
    if not results:
        return []
    f = fmt
    lines = ["", "A shared prefix read once (`tvm_attention.cascade`: the prefix pass, the suffixes, the merge "
                 "in torch on the GPU) against every sequence reading it (the same kernel over whole block tables), "
                 "microseconds a step:", "",
             "| kernel | sequences × H:KH × D | prefix + suffix | plain | cascade | plain / cascade | prefix | "
             "suffix | merge | bytes plain / cascade | valid |", "|" + "---|" * 11]
    for e in results:
        us, b, sp = e.get("us", {}), e.get("bytes", {}), e["serving"]
        lens = e.get("lengths", ("?", "?"))
        speed = us["plain"] / us["cascade"] if us.get("plain") and us.get("cascade") else None
        lines.append(f"| {e['kernel']} | {sp['batch']} × {sp['heads']}:{sp.get('kv_heads') or sp['heads']} × "
                     f"{sp['head_dim']} | {lens[0]} + {lens[1]} | {f(us.get('plain'))} | {f(us.get('cascade'))} | "
                     f"{f(speed, '{:.2f}')} | {f(us.get('prefix'))} | {f(us.get('suffix'))} | {f(us.get('merge'))} | "
                     f"{f(b['plain'] / b['cascade'] if b else None, '{:.1f}')} | "
                     f"{e.get('validation', {}).get('passed')}{' ' + e['error'][:80] if 'error' in e else ''} |")
    return lines


#: the MLA goal's steps (batch, keys): the build's own (batch 64 × 4096), and one sequence of 32k keys
#: (split-KV over the step's two row tiles of 64 heads)
MLA_STEPS = [(None, None), (1, 32768)]


def mla_inputs(torch, spec, batch: int, keys: int, device: str, gen) -> list:
    """A latent paged decode step's arguments in call order on ``device``: ``q (B, H, 1, D)``,
    ``kv_pages (pages, page_size, D)`` (every sequence ``keys`` keys, its pages in a shuffled
    order), ``block_table (B, pages a sequence)``, ``cache_seqlens``; an 8-bit cache its dtype's
    values of normal draws (float8: torch's cast, scale 1; int8: 16 steps a unit, scale 1/16) and
    ``kv_scale (1,)`` after them."""
    dtype = getattr(torch, spec.dtype)
    p = spec.page_size
    per = -(-keys // p)
    q = torch.randn((batch, spec.heads, spec.seq_q, spec.head_dim), device=device, dtype=dtype, generator=gen)
    pages = torch.randn((batch * per, p, spec.head_dim), device=device, dtype=torch.float32, generator=gen)
    scale = 1.0
    if spec.kv_dtype == "int8":
        pages, scale = (pages * 16).round().clamp(-127, 127).to(torch.int8), 1 / 16
    else:
        pages = pages.to(getattr(torch, spec.kv_dtype) if spec.kv_quantized else dtype)
    order = torch.randperm(batch * per, device=device, generator=gen).to(torch.int32)
    x = [q, pages, order.view(batch, per), torch.full((batch,), keys, dtype=torch.int32, device=device)]
    return x + ([torch.full((1,), scale, dtype=torch.float32, device=device)] if spec.kv_quantized else [])


def validate_mla(torch, spec, kernel, x: list, sequences=None) -> dict:
    """The call's output for ``sequences`` (default: the first and last) against a float64 torch
    reference of every head over that sequence's latent rows (dequantized: ``kv_scale`` times
    the stored value), V their first ``head_dim_v`` columns, causal bottom-right."""
    from tvm_attention.validate import TOLERANCES

    out = kernel(*x)
    q, pages, table, lens = x[:4]
    scale = float(x[4][0]) if spec.kv_quantized else 1.0
    atol, rtol = TOLERANCES[spec.dtype]
    ok, worst = bool(torch.isfinite(out).all()), 0.0
    for b in sequences or sorted({0, q.shape[0] - 1}):
        n = int(lens[b])
        rows = pages[table[b, :-(-n // spec.page_size)].long()].reshape(-1, spec.head_dim)[:n].double() * scale
        s = torch.matmul(q[b].double(), rows.T) * spec.scale  # (H, Sq, n)
        if spec.causal:
            i = torch.arange(q.shape[2], device=q.device).view(-1, 1)
            s = s.masked_fill(torch.arange(n, device=q.device).view(1, -1) > i + (n - q.shape[2]), float("-inf"))
        ref = torch.matmul(torch.softmax(s, -1).nan_to_num(0.0), rows[:, :spec.v_dim])
        diff = (out[b].double() - ref).abs()
        worst = max(worst, float(diff.max()))
        ok = ok and bool((diff <= atol + rtol * ref.abs()).all())
    return {"passed": ok, "max_abs_err": worst, "atol": atol, "rtol": rtol}


def mla_goal(torch, kernels: list[dict], payload: Path, min_ms: float, rounds: int, peak, stream) -> list[dict]:
    """The MLA goal's builds (``mla`` in the payload) at each of :data:`MLA_STEPS`: validated
    (:func:`validate_mla`), timed, and set against the memory roof (``stream``: a streaming
    read's bytes a second, measured in this run; the latent rows, q and o moved once) and the
    tensor-core roof (``peak`` TFLOP/s, dense 16-bit: 2·B·H·keys·(D + Dv) FLOPs)."""
    import tvm_attention
    import tvm_ffi
    from tvm_attention.spec import AttentionSpec

    out = []
    for i, (k, (batch, keys)) in enumerate((k, step) for k in kernels for step in MLA_STEPS):
        spec = AttentionSpec.from_dict(k["spec"])
        batch, keys = batch or spec.batch, keys or spec.seq_kv
        entry = {"dir": k["dir"], "spec": k["spec"], "batch": batch, "keys": keys}
        try:
            kernel = tvm_attention.load(payload / k["dir"])
            x = mla_inputs(torch, spec, batch, keys, "cuda", torch.Generator(device="cuda").manual_seed(i))
            entry["validation"] = validate_mla(torch, spec, kernel, x)
            o = torch.empty((batch, spec.heads, spec.seq_q, spec.v_dim), device="cuda", dtype=x[0].dtype)
            ffi = [tvm_ffi.from_dlpack(t) for t in (*x, o)]
            fn = kernel.function
            with tvm_ffi.use_torch_stream():
                secs = cuda_time(torch, lambda: fn(*ffi), min_ms, rounds)
            moved = batch * keys * spec.head_dim * spec.kv_itemsize + (x[0].numel() + o.numel()) * x[0].element_size()
            flop = 2.0 * batch * spec.heads * spec.seq_q * keys * (spec.head_dim + spec.v_dim)
            roofs = {"memory": moved / stream if stream else None, "tensor": flop / (peak * 1e12) if peak else None}
            binds = max((r for r in roofs.items() if r[1]), key=lambda r: r[1], default=(None, None))
            entry.update(us=secs * 1e6, gbps=moved / secs / 1e9, tflops=flop / secs / 1e12, binds=binds[0],
                         of_roof=binds[1] / secs if binds[1] else None)
        except Exception as e:  # noqa: BLE001 - recorded, the check goes on
            entry["error"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        out.append(entry)
        print(f"mla {k['dir']} B{batch} × {keys}: {entry.get('us', float('nan')):.1f} us, "
              f"{100 * (entry.get('of_roof') or float('nan')):.0f}% of the {entry.get('binds')} roof "
              f"{entry.get('validation') or entry.get('error')}", flush=True)
    return out


def mla_lines(entries: list[dict], stream, peak) -> list[str]:
    """The MLA goal's lines (``check.md``): each build at each step, its time, bandwidth and
    TFLOP/s, which roof binds and the share of it (goal: at least 0.70 at batch 64 × 4096)."""
    if not entries:
        return []
    f = fmt
    lines = ["", f"MLA decode on tensor cores (128 heads, latent 576 / 512, pages of 64; roofs: a streaming read "
                 f"{f(stream / 1e9 if stream else None, '{:.0f}')} GB/s, {f(peak)} TFLOP/s dense; goal: at least 0.70 "
                 "of the binding roof at batch 64 × 4096):", "",
             "| cache | batch × keys | µs | GB/s | TFLOP/s | binds | of that roof | valid |", "|" + "---|" * 8]
    for e in entries:
        cache = e["spec"].get("kv_dtype") or e["spec"]["dtype"]
        lines.append(f"| {cache} | {e['batch']} × {e['keys']} | {f(e.get('us'))} | {f(e.get('gbps'), '{:.0f}')} | "
                     f"{f(e.get('tflops'))} | {e.get('binds') or '-'} | {f(e.get('of_roof'), '{:.2f}')} | "
                     f"{e.get('validation', {}).get('passed')}{' ' + e['error'][:80] if 'error' in e else ''} |")
    return lines


#: the sparse mask goal's pattern: blocks of 128 rows × 128 keys, block (i, j) seen where
#: (j − i) % 10 == 0: 10 % of the key tiles of each row tile (the goal: at least 5x all bits set)
MASK_BLOCK, MASK_KEEP = 128, 10


def sparse_mask(rows: int, keys: int):
    """``(rows, keys)`` booleans of the sparse goal's block pattern (NumPy)."""
    import numpy as np

    i, j = np.arange(rows)[:, None] // MASK_BLOCK, np.arange(keys)[None, :] // MASK_BLOCK
    return (j - i) % MASK_KEEP == 0


def tree_mask(drafts: int, cached: int, seed: int):
    """A speculative-decoding step's ``(drafts, cached + drafts)`` booleans: every draft sees the
    cache, itself and its ancestors in a random tree (draft ``i``'s parent drawn below ``i``)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    parent = [-1] + [int(rng.integers(0, i)) for i in range(1, drafts)]
    m = np.zeros((drafts, cached + drafts), bool)
    m[:, :cached] = True
    for i in range(drafts):
        a = i
        while a >= 0:
            m[i, cached + a] = True
            a = parent[a]
    return m


def packed_mask(torch, masks, device: str) -> list:
    """``custom_mask``, ``mask_indptr`` of boolean masks (``masks.pack_mask``: FlashInfer's bits) on ``device``."""
    from tvm_attention.masks import pack_mask

    bits, indptr = pack_mask(masks)
    return [torch.from_numpy(bits).to(device), torch.from_numpy(indptr).to(device)]


def masked_reference(torch, spec, q, k, v, mask, rows):
    """float64 attention of query rows ``rows`` of ``q (1, H, Sq, D)`` over ``k``/``v (1, KH, n, D)``
    under the boolean ``mask (Sq, n)`` alone (a custom mask replaces causality)."""
    g = spec.heads // k.shape[1]
    kk, vv = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = torch.matmul(q[:, :, rows].double(), kk.transpose(-1, -2)) * spec.scale
    s = s.masked_fill(~torch.as_tensor(mask[rows], device=q.device), float("-inf"))
    return torch.matmul(torch.softmax(s, -1).nan_to_num(0.0), vv)


def _within(torch, spec, got, ref) -> tuple[bool, float]:
    from tvm_attention.validate import TOLERANCES

    atol, rtol = TOLERANCES[spec.dtype]
    diff = (got.double() - ref).abs()
    return bool(torch.isfinite(got).all()) and bool((diff <= atol + rtol * ref.abs()).all()), float(diff.max())


def mask_goal_runs(torch, spec, goal: str, kernel, device: str, gen) -> tuple[dict, dict]:
    """One mask goal's validation and its calls to time: ``sparse`` (a bhsd custom-mask build),
    the call with every bit set (``ones``) and with :func:`sparse_mask` (``masked``), each checked
    on 32 sampled rows against :func:`masked_reference`; ``verify`` (a paged build that appends),
    a step of 64 drafts through :func:`tree_mask` over caches of ``spec.seq_kv`` keys (``masked``),
    its first and last sequence checked, and the new keys in the cache; ``append``, the same step
    without a mask (``plain``: ``validate_cache``)."""
    import numpy as np

    dtype = getattr(torch, spec.dtype)
    if goal == "sparse":
        q, k, v = (torch.randn(sh, device=device, dtype=dtype, generator=gen)
                   for sh in (spec.q_shape, spec.kv_shape, spec.v_shape))
        rows = sorted(set(torch.randperm(spec.seq_q, generator=torch.Generator().manual_seed(0))[:32].tolist()))
        ok, worst, calls = True, 0.0, {}
        for name, mask in (("ones", np.ones((spec.seq_q, spec.seq_kv), bool)),
                           ("masked", sparse_mask(spec.seq_q, spec.seq_kv))):
            args = [q, k, v, *packed_mask(torch, [mask] * spec.batch, device)]
            good, err = _within(torch, spec, kernel(*args)[:, :, rows], masked_reference(torch, spec, q, k, v, mask, rows))
            ok, worst = ok and good, max(worst, err)
            calls[name] = args
        return {"passed": ok, "max_abs_err": worst}, calls
    x = cache_inputs(torch, spec, spec.seq_q, [spec.seq_kv] * spec.batch, dtype, device, gen)
    if goal == "append":
        return validate_cache(torch, spec, kernel, x), {"plain": x}
    trees = [tree_mask(spec.seq_q, spec.seq_kv, b) for b in range(spec.batch)]
    args = x[:5] + packed_mask(torch, trees, device) + x[5:]
    before = [t.clone() for t in x[1:3]]
    out = kernel(*args)
    ok, worst = True, 0.0
    for b in sorted({0, spec.batch - 1}):
        kb, vb = cache_keys(spec, [x[0], *before, *x[3:]], b, spec.seq_kv)
        kn, vn = x[-2][b:b + 1], x[-1][b:b + 1]
        kw, _ = cache_keys(spec, x, b, spec.seq_kv + spec.seq_q)
        ok = ok and bool((kw[:, :, spec.seq_kv:] == kn).all())
        ref = masked_reference(torch, spec, x[0][b:b + 1], torch.cat([kb, kn], 2), torch.cat([vb, vn], 2), trees[b],
                               list(range(spec.seq_q)))
        good, err = _within(torch, spec, out[b:b + 1], ref)
        ok, worst = ok and good, max(worst, err)
    return {"passed": ok, "max_abs_err": worst}, {"masked": args}


def mask_goals(torch, kernels: list[dict], payload: Path, min_ms: float, rounds: int) -> list[dict]:
    """The mask goals' builds (``mask_goal`` in the payload): each validated and its calls timed
    (microseconds; :func:`mask_goal_runs`)."""
    import tvm_attention
    import tvm_ffi
    from tvm_attention.spec import AttentionSpec

    out = []
    for i, k in enumerate(kernels):
        spec = AttentionSpec.from_dict(k["spec"])
        entry = {"goal": k["mask_goal"], "dir": k["dir"], "spec": k["spec"]}
        try:
            kernel = tvm_attention.load(payload / k["dir"])
            entry["validation"], calls = mask_goal_runs(torch, spec, k["mask_goal"], kernel, "cuda",
                                                         torch.Generator(device="cuda").manual_seed(i))
            fn, o = kernel.function, torch.empty(spec.o_shape if spec.layout == "bhsd" else
                                                 (spec.batch, spec.heads, spec.seq_q, spec.v_dim),
                                                 device="cuda", dtype=getattr(torch, spec.dtype))
            entry["us"] = {}
            for name, args in calls.items():
                ffi = [tvm_ffi.from_dlpack(t) for t in (*args, o)]
                with tvm_ffi.use_torch_stream():
                    entry["us"][name] = cuda_time(torch, lambda: fn(*ffi), min_ms, rounds) * 1e6
        except Exception as e:  # noqa: BLE001 - recorded, the check goes on
            entry["error"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        out.append(entry)
        print(f"mask goal {entry['goal']} {k['dir']}: {entry.get('us')} {entry.get('validation') or entry.get('error')}",
              flush=True)
    return out


def mask_lines(entries: list[dict]) -> list[str]:
    """The mask goals' lines (``check.md``): the sparse build's time with all bits set over its
    time with 90 % of the blocks hidden (goal: at least 5.0), the verify step's time over the
    plain 64-token append's (goal: at most 1.3)."""
    if not entries:
        return []
    f = fmt
    by = {e["goal"]: e for e in entries}
    us = {g: e.get("us", {}) for g, e in by.items()}
    valid = {g: e.get("validation", {}).get("passed") for g, e in by.items()}
    sp, vf, ap = us.get("sparse", {}), us.get("verify", {}), us.get("append", {})
    sparse = sp["ones"] / sp["masked"] if sp.get("ones") and sp.get("masked") else None
    verify = vf["masked"] / ap["plain"] if vf.get("masked") and ap.get("plain") else None
    return ["", "Custom masks on tensor cores (µs a call):", "",
            "| goal | the call | µs | against | µs | ratio | goal | valid |", "|" + "---|" * 8,
            f"| 90 % of the key tiles hidden (S 8192, B1 H16, D 128) | 10 % of the blocks | {f(sp.get('masked'))} | "
            f"every bit set | {f(sp.get('ones'))} | {f(sparse, '{:.2f}')} | ≥ 5.0 | {valid.get('sparse')} |",
            f"| tree verify of 64 drafts (B8, GQA 32:8, 4096 cached) | verify (append + tree mask) | "
            f"{f(vf.get('masked'))} | 64-token append | {f(ap.get('plain'))} | {f(verify, '{:.2f}')} | ≤ 1.3 | "
            f"{valid.get('verify')} / {valid.get('append')} |"]


def backward_flops(b: int, h: int, s: int, d: int, causal: bool) -> float:
    """The backward's FLOPs (FlashAttention's count: five products of 2·B·H·S²·D, halved when
    causal: 2.5x the forward's)."""
    return 10.0 * b * h * s * s * d / (2 if causal else 1)


def backward_inputs(torch, spec, b: int, h: int, s: int, device: str, gen) -> dict:
    """q, k, v, do ``(b, h, s, D)`` in the spec's dtype, and the forward's ``o`` and ``lse`` from
    torch's flash SDPA (its logsumexp: natural log, float32)."""
    dtype = getattr(torch, spec.dtype)
    x = {n: torch.randn((b, h, s, spec.head_dim), device=device, dtype=dtype, generator=gen) for n in ("q", "k", "v", "do")}
    out = torch.ops.aten._scaled_dot_product_flash_attention(x["q"], x["k"], x["v"], 0.0, spec.causal, False,
                                                              scale=spec.scale)
    x["o"], x["lse"] = out[0], out[1]
    return x


def backward_peer(torch, spec, x: dict):
    """torch SDPA's flash backward of ``x``: a call that returns (dq, dk, dv)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (x[n].detach().requires_grad_() for n in ("q", "k", "v"))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=spec.causal, scale=spec.scale)
    return lambda: torch.autograd.grad(out, (q, k, v), x["do"], retain_graph=True)


def compare_grads(torch, ours, theirs, tolerance: float = 2e-2) -> dict:
    """``ours`` against ``theirs`` (dq, dk, dv): the largest error as a share of the largest
    gradient, each within ``tolerance`` (both are 16-bit: flash's rounding is the peer's)."""
    worst = 0.0
    ok = True
    for a, b in zip(ours, theirs):
        rel = float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))
        worst = max(worst, rel)
        ok = ok and bool(torch.isfinite(a).all()) and rel <= tolerance
    return {"passed": ok, "max_rel_error": worst, "tolerance": tolerance}


def backward_goal(torch, kernels: list[dict], payload: Path, min_ms: float, rounds: int) -> list[dict]:
    """The backward goal's builds (``backward`` in the payload): at each of their ``shapes`` (B,
    H, S), ours (``load_backward``) against torch SDPA's flash backward on the same inputs:
    validated (:func:`compare_grads`), each timed (our library's function on preallocated outputs
    and scratch; theirs through autograd), TFLOP/s (:func:`backward_flops`) and the ratio."""
    import tvm_ffi
    from tvm_attention.backward import ENTRY as BACKWARD_ENTRY
    from tvm_attention.backward_artifact import load_backward
    from tvm_attention.spec import AttentionSpec

    out = []
    for i, k in enumerate(kernels):
        spec = AttentionSpec.from_dict(k["spec"])
        for b, h, s in k["shapes"]:
            entry = {"dir": k["dir"], "spec": k["spec"], "shape": [b, h, s]}
            try:
                kern = load_backward(payload / k["dir"])
                x = backward_inputs(torch, spec, b, h, s, "cuda", torch.Generator(device="cuda").manual_seed(i))
                peer = backward_peer(torch, spec, x)
                ours = kern(x["q"], x["k"], x["v"], x["o"], x["lse"], x["do"])
                entry["validation"] = compare_grads(torch, ours, peer())
                scratch = [torch.empty((b, h, s, spec.head_dim), device="cuda", dtype=torch.float32),
                           torch.empty((b, h, s), device="cuda", dtype=torch.float32)]
                args = [x[n] for n in ("q", "k", "v", "o", "lse", "do")] + list(ours) + scratch
                ffi = [tvm_ffi.from_dlpack(t) for t in args]
                fn = kern.module[BACKWARD_ENTRY]
                with tvm_ffi.use_torch_stream():
                    ours_s = cuda_time(torch, lambda: fn(*ffi), min_ms, rounds)
                theirs_s = cuda_time(torch, peer, min_ms, rounds)
                f = backward_flops(b, h, s, spec.head_dim, spec.causal)
                entry.update(ours_tflops=f / ours_s / 1e12, flash_tflops=f / theirs_s / 1e12, ratio=theirs_s / ours_s)
            except Exception as e:  # noqa: BLE001 - recorded, the check goes on
                entry["error"] = f"{type(e).__name__}: {e}"
                traceback.print_exc()
            out.append(entry)
            print(f"backward {k['dir']} {b}x{h}x{s}: {entry.get('ours_tflops', float('nan')):.1f} TFLOP/s, flash "
                  f"{entry.get('flash_tflops', float('nan')):.1f}, {entry.get('validation') or entry.get('error')}",
                  flush=True)
    return out


def backward_lines(entries: list[dict]) -> list[str]:
    """The backward goal's lines (``check.md``): ours and torch SDPA's flash backward at each shape,
    TFLOP/s, and ours over theirs (goal: at least 1.0)."""
    if not entries:
        return []
    from tvm_attention.spec import AttentionSpec

    f = fmt
    lines = ["", "The backward on tensor cores against torch SDPA's flash backward (TFLOP/s: 2.5x the forward's FLOPs; "
                 "goal: at least 1.0x):", "",
             "| dtype | D | causal | B×H | S | ours | flash | ours / flash | valid |", "|" + "---|" * 9]
    for e in entries:
        sp = AttentionSpec.from_dict(e["spec"])
        b, h, s = e["shape"]
        lines.append(f"| {sp.dtype} | {sp.head_dim} | {sp.causal} | {b}×{h} | {s} | {f(e.get('ours_tflops'))} | "
                     f"{f(e.get('flash_tflops'))} | {f(e.get('ratio'), '{:.2f}')} | "
                     f"{e.get('validation', {}).get('passed')}{' ' + e['error'][:80] if 'error' in e else ''} |")
    return lines


def stream_read(torch, min_ms: float, rounds: int) -> float:
    """Bytes per second of a streaming read on this GPU (``sum`` over 2 GiB of fp16: each byte
    read once), measured in this run: what a memory-bound decode step is judged against."""
    buf = torch.ones(2**30, dtype=torch.float16, device="cuda")
    secs = cuda_time(torch, lambda: buf.sum(), min_ms, rounds)
    return buf.numel() * buf.element_size() / secs


def fmt(x, spec="{:.1f}"):
    return spec.format(x) if isinstance(x, float) else "-"


def decode_table(decode: list, stream: float) -> list[str]:
    """The decode steps' lines (``check.md``): each KV-cache kernel at each step against a
    streaming read, then each 8-bit cache's step against the 16-bit cache's of the same kernel,
    layout, dtype, head_dim and step (the goal: an e4m3 step at most 0.6× the 16-bit one)."""
    from tvm_attention.spec import AttentionSpec

    f = fmt
    lines = ["", f"Decode steps (K and V bytes, each read once), against a streaming read of "
                 f"{stream / 1e9:.0f} GB/s in this run:", "",
             "| kernel | layout | dtype | K/V cache | D | B × H:KH × keys | µs | GB/s | % of stream | valid |",
             "|" + "---|" * 10]
    specs = [AttentionSpec.from_dict(e["spec"]) for e in decode]
    keys = [(e["kernel"], sp.layout, sp.page_size, sp.append, sp.dtype, sp.head_dim, sp.heads, sp.kv_heads,
             e["batch"], e["keys"]) for e, sp in zip(decode, specs)]
    # the 16-bit cache's step time by (kernel, layout, page, append, dtype, D, heads, step)
    sixteen = {key: e["us"] for e, sp, key in zip(decode, specs, keys) if sp.kv_dtype is None and "us" in e}
    for e, sp in zip(decode, specs):
        page = ("" if sp.page_size is None else f" p{sp.page_size}") + (" append" if sp.append else "")
        share = 100 * e["of_stream"] if "of_stream" in e else None
        lines.append(f"| {e['kernel']} | {sp.layout}{page} | {sp.dtype} | {sp.kv_dtype or sp.dtype} | "
                     f"{sp.head_dim} | "
                     f"{e['batch']} × {sp.heads}:{sp.kv_heads} × {e['keys']} | {f(e.get('us'))} | "
                     f"{f(e.get('gbps'))} | {f(share)} | {e.get('validation', {}).get('passed')}"
                     f"{' ' + e['error'] if 'error' in e else ''} |")
    pairs = [(e, sp, sixteen[key]) for e, sp, key in zip(decode, specs, keys)
             if sp.kv_dtype and "us" in e and key in sixteen]
    if pairs:
        lines += ["", "8-bit caches against the 16-bit cache of the same build and step (goal: e4m3 ≤ 0.6×):", "",
                  "| kernel | layout | K/V cache | D | B × keys | 8-bit µs | 16-bit µs | ratio |", "|" + "---|" * 8]
        for e, sp, us16 in pairs:
            page = "" if sp.page_size is None else f" p{sp.page_size}"
            lines.append(f"| {e['kernel']} | {sp.layout}{page} | {sp.kv_dtype} | {sp.head_dim} | "
                         f"{e['batch']} × {e['keys']} | {f(e['us'])} | {f(us16)} | {e['us'] / us16:.2f} |")
    return lines


def prefill_table(rows: dict, device_name: str, arch: str, peak, unproven: list, smoked: dict) -> list[str]:
    """The prefill table's lines (``check.md``): one row per shape, our kernels and the peers,
    the Hopper kernel's columns when the payload has it, then its first runs' outcome."""
    from tvm_attention.spec import AttentionSpec

    f = fmt
    hop = any("fused_hopper" in row["tflops"] or "fused_hopper" in row["errors"] for row in rows.values())
    f8 = any("hopper_fp8" in row["tflops"] or "hopper_fp8" in row["errors"] for row in rows.values())
    lines = [f"GPU check on {device_name} ({arch}), {time.strftime('%Y-%m-%d')}: TFLOP/s (4·B·H·Sq·Skv·D, halved "
             f"causal); "
             f"peak = dense fp16/bf16 tensor-core peak {peak} TFLOP/s", "",
             "| dtype | D | causal | S | B×H | "
             + ("ours (hopper) | hopper, no overlap | hopper, symbolic | hopper, varlen | " if hop else "")
             + "ours (tc) | ours (simt) | tc, symbolic | simt, symbolic | tc, varlen "
             "| simt, varlen | flash | cuDNN | flex | best ours % peak | tc/flash | tc/cuDNN | tc/flex | "
             + ("hopper/flash | hopper/cuDNN | hopper/flex | " if hop else "")
             + ("hopper fp8 | fp8/fp16 | " if f8 else "") + "valid |",
             "|" + "---|" * ((26 if hop else 19) + (2 if f8 else 0))]
    for key, row in rows.items():
        sp = AttentionSpec.from_dict(row["spec"])
        t = row["tflops"]
        best = max([t[x] for x in ("fused_tc", "fused_simt", "fused_hopper") if x in t], default=None)

        def ratio(peer, ours="fused_tc", t=t):
            return t[ours] / t[peer] if ours in t and t.get(peer) else None

        valid = all(v.get("passed") for v in row.get("validation", {}).values()) and bool(row.get("validation"))
        lines.append(f"| {sp.dtype} | {sp.head_dim} | {sp.causal} | {sp.seq_q} | {sp.batch}×{sp.heads} | "
                     + (f"{f(t.get('fused_hopper'))} | {f(t.get('hopper_seq'))} | {f(t.get('hopper_dyn'))} | "
                        f"{f(t.get('hopper_varlen'))} | " if hop else "")
                     + f"{f(t.get('fused_tc'))} | {f(t.get('fused_simt'))} | {f(t.get('tc_dyn'))} | "
                     f"{f(t.get('simt_dyn'))} | {f(t.get('tc_varlen'))} | {f(t.get('simt_varlen'))} | "
                     f"{f(t.get('flash'))} | {f(t.get('cudnn'))} | "
                     f"{f(t.get('flex'))} | {f(100 * best / peak if best and peak else None)} | "
                     f"{f(ratio('flash'), '{:.2f}')} | {f(ratio('cudnn'), '{:.2f}')} | {f(ratio('flex'), '{:.2f}')} | "
                     + "".join(f"{f(ratio(p_, 'fused_hopper'), '{:.2f}')} | " for p_ in ("flash", "cudnn", "flex")
                               if hop)
                     + (f"{f(t.get('hopper_fp8'))} | {f(ratio('fused_hopper', 'hopper_fp8'), '{:.2f}')} | "
                        if f8 else "")
                     + f"{valid} |")
    if unproven:
        lines += ["", f"First runs of kernels not yet run on a GPU, each in a child process: "
                      f"{len(unproven) - len(smoked)}/{len(unproven)} passed"]
        lines += [f"- {d}: {why}" for d, why in smoked.items()]
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--payload", default=str(Path(__file__).resolve().parent))
    p.add_argument("--out", default=os.environ.get("OUT", "gpu_check_out"))
    p.add_argument("--budget", type=float, default=300.0, help="seconds for the whole check (peers past it are skipped)")
    p.add_argument("--min-ms", type=float, default=30.0, help="per timing round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--no-flex", action="store_true", help="skip FlexAttention (its compiles take the longest)")
    p.add_argument("--smoke", nargs="+", default=None, help=argparse.SUPPRESS)  # the child of smoke()
    a = p.parse_args(argv)
    if a.smoke:
        return smoke_child(Path(a.payload), a.smoke)
    t_start = time.time()
    import torch

    import tvm_attention
    import tvm_ffi

    payload, out = Path(a.payload), Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    info = json.loads((payload / "payload.json").read_text())
    if not torch.cuda.is_available():
        print("gpu_device_check: torch sees no CUDA GPU", file=sys.stderr)
        return 2
    major, minor = torch.cuda.get_device_capability()
    arch, device_name = f"sm_{major}{minor}", torch.cuda.get_device_name()
    from tvm_attention.spec import AttentionSpec
    from tvm_attention.validate import TOLERANCES

    every = [k for k in info["kernels"] if k["arch"] == arch and "error" not in k]
    unproven = [k for k in every if k["kernel"] in UNPROVEN]
    smoked = smoke(Path(a.payload), unproven) if unproven else {}
    for d, why in smoked.items():
        print(f"first run of {d}: {why}", flush=True)
    every = [k for k in every if k["dir"] not in smoked]
    variant = [k for k in every if AttentionSpec.from_dict(k["spec"]).variants]  # checked on their own
    fp8 = [k for k in every if k["spec"].get("q_dtype")]  # fp8 inputs: a column of their 16-bit shape's row
    goal = [k for k in every if "twin" in k]  # the modifier goal's: columns of the plain shape's row
    casc = [k for k in every if "cascade" in k]  # the cascade's prefix and suffix kernels: a table of their own
    mla = [k for k in every if "mla" in k]  # the MLA goal's: a table of their own
    masked = [k for k in every if "mask_goal" in k]  # the mask goals': a table of their own
    backs = [k for k in every if k.get("backward")]  # the backward goal's: a table of their own
    variant = [k for k in variant if k not in goal + casc + mla + masked + backs]
    ready = [k for k in every if k not in variant + fp8 + goal + casc + mla + masked + backs]
    varlen = [k for k in ready if k["spec"].get("layout", "bhsd") == "varlen"]
    cached = [k for k in ready if k["spec"].get("layout", "bhsd") in ("kvcache", "paged")]
    built = [k for k in ready if not k["spec"].get("dynamic") and k not in varlen + cached]
    symbolic = [k for k in ready if k["spec"].get("dynamic") and k not in varlen + cached]
    if not ready:
        print(f"gpu_device_check: the payload has no kernels for {arch} ({device_name}); it has {info['archs']}",
              file=sys.stderr)
        return 2
    peak = next((v for key, v in PEAKS.items() if key in device_name), None)
    manifests = [json.loads((payload / k["dir"] / "manifest.json").read_text()) for k in every]
    preload_runtime(payload, manifests)
    print(f"# {device_name} ({arch}), torch {torch.__version__}, tvm-ffi {tvm_ffi.__version__}, {len(built)} kernels; "
          f"dense fp16 peak {peak} TFLOP/s", flush=True)

    torch_dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
    rows: dict[str, dict] = {}  # one per shape

    def serves(k, kernel, spec):  # the symbolic build of ``kernel`` that serves a static shape
        s = AttentionSpec.from_dict(k["spec"])
        return k["kernel"] == kernel and "column" not in k and (s.dtype, s.head_dim, s.causal, s.heads) == \
            (spec.dtype, spec.head_dim, spec.causal, spec.heads)

    def run(name, k, spec, row, q, kk, vv, seed):
        # validate and time build ``k`` as ``name`` on (q, kk, vv); a varlen build (a value of
        # VARLEN_NAMES) takes the batch packed (B sequences of seq_q rows and seq_kv keys) and is
        # checked against the static kernel's output of the same inputs
        try:
            kernel = tvm_attention.load(payload / k["dir"])
            if name in VARLEN_NAMES.values():
                pack = lambda x: x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3]).contiguous()  # noqa: E731
                cu = lambda s: torch.arange(0, spec.batch + 1, device="cuda", dtype=torch.int32) * s  # noqa: E731
                args = [pack(q), pack(kk), pack(vv), cu(spec.seq_q), cu(spec.seq_kv)]
                o = kernel(*args)
                same = row.get("outputs", {}).get(k["kernel"])
                if same is not None:
                    err = float((o.view(spec.batch, spec.seq_q, spec.heads, -1).transpose(1, 2).double()
                                 - same.double()).abs().max())
                    row.setdefault("validation", {})[name] = {"passed": err <= TOLERANCES[spec.dtype][0],
                                                              "max_abs_err": err, "against": k["kernel"]}
            else:
                row.setdefault("validation", {})[name] = validate(torch, spec, kernel, q, kk, vv, seed=seed)
                if name in VARLEN_NAMES:  # the varlen build of the same shape is checked against it
                    row.setdefault("outputs", {})[name] = kernel(q, kk, vv)
                args, o = [q, kk, vv], torch.empty_like(q)
            ffi = [tvm_ffi.from_dlpack(x) for x in (*args, o)]
            fn = kernel.function
            with tvm_ffi.use_torch_stream():
                secs = cuda_time(torch, lambda: fn(*ffi), a.min_ms, a.rounds)
            row["tflops"][name] = flops(spec) / secs / 1e12
        except Exception as e:  # noqa: BLE001 - recorded in the row, the check goes on
            row["errors"][name] = f"{type(e).__name__}: {e}"
            traceback.print_exc()

    for i, k in enumerate(built):
        spec = AttentionSpec.from_dict(k["spec"])
        key = spec.short_name()
        row = rows.setdefault(key, {"spec": k["spec"], "tflops": {}, "errors": {}})
        gen = torch.Generator(device="cuda").manual_seed(i)
        q = torch.randn(spec.q_shape, device="cuda", dtype=torch_dtype[spec.dtype], generator=gen)
        kk = torch.randn(spec.kv_shape, device="cuda", dtype=torch_dtype[spec.dtype], generator=gen)
        vv = torch.randn(spec.kv_shape, device="cuda", dtype=torch_dtype[spec.dtype], generator=gen)
        run(k.get("column", k["kernel"]), k, spec, row, q, kk, vv, seed=i)
        if "column" in k:
            continue  # another form of a kernel (HOPPER_VARIANTS): its own column, nothing else
        dyn = next((s for s in symbolic if serves(s, k["kernel"], spec)), None)
        name = DYN_NAMES.get(k["kernel"])
        if dyn is not None and name not in row["tflops"] and name not in row["errors"]:
            run(name, dyn, spec, row, q, kk, vv, seed=i)  # the same shape through the symbolic kernel
        packed = next((s for s in varlen if serves(s, k["kernel"], spec)), None)
        name = VARLEN_NAMES.get(k["kernel"])
        if packed is not None and name not in row["tflops"] and name not in row["errors"]:
            run(name, packed, spec, row, q, kk, vv, seed=i)
        row.pop("outputs", None)
        if "peers_done" not in row:
            row["peers_done"] = True
            for peer, fn in peers(torch, spec, q, kk, vv).items():
                if fn is None or (peer == "flex" and a.no_flex):
                    row["errors"][peer] = "not available" if fn is None else "skipped (--no-flex)"
                    continue
                if time.time() - t_start > a.budget:
                    row["errors"][peer] = f"skipped: past the {a.budget:.0f} s budget"
                    continue
                try:
                    row["tflops"][peer] = flops(spec) / cuda_time(torch, fn, a.min_ms, a.rounds) / 1e12
                except Exception as e:  # noqa: BLE001
                    row["errors"][peer] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        v = row.get("validation", {}).get(k["kernel"], {})
        print(f"{k['kernel']:10s} {key:40s} {row['tflops'].get(k['kernel'], float('nan')):7.1f} TFLOP/s "
              f"valid={v.get('passed')} err={v.get('max_abs_err')}  peers: "
              + ", ".join(f"{p_} {row['tflops'][p_]:.1f}" for p_ in ("flash", "cudnn", "flex") if p_ in row["tflops"]),
              flush=True)

    for i, k in enumerate(fp8):  # beside the 16-bit builds of the same shape: the fp8 goal's ratio
        spec = AttentionSpec.from_dict(k["spec"])
        row = rows.setdefault(dataclasses.replace(spec, q_dtype=None, kv_dtype=None).short_name(),
                              {"spec": k["spec"], "tflops": {}, "errors": {}})
        try:
            kernel = tvm_attention.load(payload / k["dir"])
            x = fp8_inputs(torch, spec, torch_dtype[spec.dtype], "cuda", torch.Generator(device="cuda").manual_seed(i))
            row.setdefault("validation", {})["hopper_fp8"] = validate_fp8(torch, spec, kernel, x, seed=i)
            o = torch.empty(spec.o_shape, device="cuda", dtype=torch_dtype[spec.dtype])
            ffi = [tvm_ffi.from_dlpack(t) for t in (*x, o)]
            fn = kernel.function
            with tvm_ffi.use_torch_stream():
                secs = cuda_time(torch, lambda: fn(*ffi), a.min_ms, a.rounds)
            row["tflops"]["hopper_fp8"] = flops(spec) / secs / 1e12
        except Exception as e:  # noqa: BLE001 - recorded in the row, the check goes on
            row["errors"]["hopper_fp8"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        print(f"fp8        {k['dir']:40s} {row['tflops'].get('hopper_fp8', float('nan')):7.1f} TFLOP/s "
              f"{row.get('validation', {}).get('hopper_fp8')}", flush=True)

    modifier_goal(torch, goal, rows, payload, torch_dtype, a.min_ms, a.rounds, a.no_flex)
    cascades = cascade_goal(torch, casc, payload, torch_dtype, a.min_ms, a.rounds)
    mask_runs = mask_goals(torch, masked, payload, a.min_ms, a.rounds)
    awkward = check_symbolic(torch, symbolic, payload, torch_dtype)
    ragged = check_varlen(torch, varlen, payload, torch_dtype)
    caches = check_cache(torch, cached, payload, torch_dtype)
    variants = check_variants(torch, variant, payload)
    decode = []  # each KV-cache kernel at its representative decode step, next to a streaming read
    stream = stream_read(torch, a.min_ms, a.rounds) if cached or mla else None
    latent = mla_goal(torch, mla, payload, a.min_ms, a.rounds, peak, stream)
    for i, (k, (batch, keys)) in enumerate((k, step) for k in cached for step in DECODE_STEPS):
        spec = AttentionSpec.from_dict(k["spec"])
        batch, keys = batch or spec.batch, keys or spec.seq_kv
        entry = {"kernel": k["kernel"], "dir": k["dir"], "spec": k["spec"], "batch": batch, "keys": keys}
        try:
            kernel = tvm_attention.load(payload / k["dir"])
            x = cache_inputs(torch, spec, spec.seq_q, [keys] * batch, torch_dtype[spec.dtype], "cuda",
                             torch.Generator(device="cuda").manual_seed(i))
            entry["validation"] = validate_cache(torch, spec, kernel, x)
            o = torch.empty_like(x[0])
            ffi = [tvm_ffi.from_dlpack(t) for t in (*x, o)]
            fn = kernel.function
            with tvm_ffi.use_torch_stream():
                secs = cuda_time(torch, lambda: fn(*ffi), a.min_ms, a.rounds)
            read = 2 * batch * keys * spec.kv_heads * spec.head_dim * spec.kv_itemsize  # K and V once
            entry.update(us=secs * 1e6, gbps=read / secs / 1e9, of_stream=read / secs / stream)
        except Exception as e:  # noqa: BLE001 - recorded, the check goes on
            entry["error"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        decode.append(entry)
        print(f"decode {k['dir']} B{batch} × {keys}: {entry.get('gbps', float('nan')):.0f} GB/s, "
              f"{100 * entry.get('of_stream', float('nan')):.0f}% of a streaming read", flush=True)

    # the backward last: its kernels never ran on a GPU, and a fault would poison the CUDA context
    backward = backward_goal(torch, backs, payload, a.min_ms, a.rounds)
    lines = prefill_table({k: r for k, r in rows.items() if r["tflops"].keys() - {"tc_mod", "flex_mod"}
                           or r["errors"].keys() - {"tc_mod", "flex_mod"}}, device_name, arch, peak, unproven, smoked)
    lines += modifier_lines(rows)
    lines += cascade_lines(cascades)
    lines += mask_lines(mask_runs)
    lines += backward_lines(backward)
    lines += ["", f"Symbolic kernels at awkward shapes (batch, seq_q, seq_kv): "
              f"{sum(c['passed'] for c in awkward)}/{len(awkward)} valid"]
    lines += [f"- {c['kernel']} {tuple(c['shape'])}: {c.get('error') or c.get('max_abs_err')}"
              for c in awkward if not c["passed"]]
    lines += ["", f"Varlen kernels on ragged batches: {sum(c['passed'] for c in ragged)}/{len(ragged)} valid"]
    lines += [f"- {c['kernel']} {c['seqlens'][:4]}: {c.get('error') or c.get('max_abs_err')}"
              for c in ragged if not c["passed"]]
    lines += ["", f"KV-cache kernels on mixed caches: {sum(c['passed'] for c in caches)}/{len(caches)} valid"]
    lines += [f"- {c['kernel']} {c['case']}: {c.get('error') or c.get('max_abs_err')}" for c in caches
              if not c["passed"]]
    lines += ["", f"Builds with attention variants on their layouts' cases: "
                  f"{sum(c['passed'] for c in variants)}/{len(variants)} valid"]
    lines += [f"- {c['kernel']} {c['case']}: {c.get('error') or c.get('max_abs_err')}" for c in variants
              if not c["passed"]]
    if decode:
        lines += decode_table(decode, stream)
    lines += mla_lines(latent, stream, peak)
    table = "\n".join(lines)
    imported = sorted(m for m in sys.modules if m == "tvm" or m.startswith("tvm.") or m.startswith("tvm_attention.build"))
    report = {"device": device_name, "arch": arch, "peak_tflops": peak, "torch": torch.__version__, "rows": rows,
              "first_runs": {"kernels": [k["dir"] for k in unproven], "failed": smoked},
              "symbolic": awkward, "varlen": ragged, "cache": caches, "decode": decode, "variants": variants,
              "cascade": cascades, "mla": latent, "masks": mask_runs, "backward": backward, "stream_read_bytes_per_s": stream,
              "seconds": round(time.time() - t_start, 1), "imported_tvm": imported}
    (out / "check.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "check.md").write_text(table + "\n")
    print("\n" + table)
    print(f"\ntotal {time.time() - t_start:.0f} s; tvm imported: {imported or 'no'}")
    failed = [key for key, row in rows.items()
              if any(not v.get("passed") for v in row.get("validation", {}).values())
              or any(k in row["errors"] for k in ("fused_tc", "fused_simt", "fused_hopper", "hopper_seq", "hopper_fp8",
                                                  "tc_mod",
                                                  *DYN_NAMES.values(),
                                                  *VARLEN_NAMES.values()))]
    bad_decode = [e for e in decode + cascades + latent + mask_runs + backward
                  if "error" in e or not e.get("validation", {}).get("passed")]
    return 1 if failed or smoked or imported or bad_decode or not all(c["passed"] for c in awkward + ragged + caches + variants) else 0


if __name__ == "__main__":
    sys.exit(main())
