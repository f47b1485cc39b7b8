#!/usr/bin/env python3
"""Check the generated CUDA kernels for shared-memory races, on the CPU (no GPU needed).

    python scripts/smem_race_check.py                     # every configuration, both kernels
    python scripts/smem_race_check.py --kernel fused_tc --quick
    python scripts/smem_race_check.py --faults            # also: each barrier / cp.async wait removed

Each configuration (``cuda_race.CONFIGS``, ``scripts/cuda_race.py``: small tiles and lengths, tails, GQA,
causal or not, static and symbolic, tensor-core stages 1-4 and m_tiles 1-2; the varlen, kvcache
and paged layouts with given ``cu_seqlens``/``cache_seqlens``/``block_table`` contents: ragged
and empty sequences, shuffled pages, decode steps and prefill chunks) is built for sm_90 as the
build path builds it, and every thread block of its grid is run thread by thread from the final
lowered device IR (``scripts/cuda_race.py``: what is modelled and what is not).
One line per configuration: its build, the threads per block, the most barrier intervals of a
block, the shared accesses checked and the verdict; the findings follow a RACE line. Exit
status 1 when any configuration has a race, 2 when the checker cannot model a kernel.

``--faults`` then removes each ``__syncthreads`` of each kernel in turn, and each
``cp.async.wait_group`` helper, and says whether the checker reports a race. A removal it does
not report is a barrier the kernel does not need at that shape (not an error of this script).
"""
from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import cuda_race  # noqa: E402 - beside this script (a development tool, not shipped)


def describe(cfg: cuda_race.RaceConfig) -> str:
    s = cfg.spec
    knobs = " ".join(f"{k}={v}" for k, v in cfg.knobs.items())
    layout = s.get("layout", "bhsd")
    if layout == "varlen":
        cq, ck = cfg.data["CQ"], cfg.data["CK"]
        seqs = " ".join(f"{cq[i + 1] - cq[i]}x{ck[i + 1] - ck[i]}" for i in range(len(cq) - 1))
        shape = f"varlen seqs {seqs}"
    elif layout in ("kvcache", "paged"):
        n = cfg.lengths
        shape = f"{layout} B{n['batch']} seq_q={n['seq_q']} cache_seqlens={','.join(map(str, cfg.data['CS']))}"
        if layout == "paged":
            shape += f" page={s['page_size']} pages={n['num_pages']} shuffled"
    elif cfg.lengths:
        dims = {"batch": s["batch"], "seq_q": s["seq_q"], "seq_kv": s["seq_kv"], **cfg.lengths}
        shape = f"B{dims['batch']} {dims['seq_q']}x{dims['seq_kv']} (symbolic {','.join(s['dynamic'])})"
    else:
        shape = f"B{s['batch']} {s['seq_q']}x{s['seq_kv']}"
    return (f"{cfg.kernel} {knobs} | {shape} H{s['heads']}/{s['kv_heads']} D{s['head_dim']} {s['dtype']} "
            f"{'causal' if s['causal'] else 'full'}")


def faults(cfg: cuda_race.RaceConfig, built) -> list[str]:
    """Each barrier, then each cp.async wait helper, removed: caught or not."""
    func = cuda_race.device_function(built)
    out = []
    for k in range(cuda_race.barrier_sites(func)):
        report = cuda_race.check_config(cfg, built, func=cuda_race.drop_barrier(func, k))
        out.append(f"__syncthreads #{k}: {'caught' if not report.ok else 'not caught (not needed at this shape)'}")
    for name in sorted(set(re.findall(r'"(attn_cp_wait\d)"', func.script()))):
        report = cuda_race.check_config(cfg, built, func=cuda_race.drop_helper_calls(func, name))
        out.append(f"{name}: {'caught' if not report.ok else 'NOT CAUGHT'}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kernel", choices=["fused_tc", "fused_simt", "all"], default="all")
    ap.add_argument("--quick", action="store_true", help="the tests' subset of configurations")
    ap.add_argument("--faults", action="store_true", help="also remove each barrier and cp.async wait")
    ap.add_argument("--max-findings", type=int, default=5, help="findings printed per configuration")
    args = ap.parse_args(argv)
    status = 0
    for cfg in cuda_race.configs(args.kernel, args.quick):
        t0 = time.time()
        built = cfg.build()
        try:
            report = cuda_race.check_config(cfg, built)
        except cuda_race.NotModelled as e:
            print(f"{cfg.name:36s} {describe(cfg)} | NOT MODELLED: {e}", flush=True)
            status = max(status, 2)
            continue
        print(f"{cfg.name:36s} {describe(cfg)} | {report.summary()} ({time.time() - t0:.1f} s)", flush=True)
        for race in report.races[:args.max_findings]:
            print("    - " + race.format().replace("\n", "\n    "))
        if not report.ok:
            status = max(status, 1)
        if args.faults:
            for line in faults(cfg, built):
                print(f"    fault: {line}", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
