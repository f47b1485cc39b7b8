"""``tvm-attention bench``'s other benchmarks, beside the length sweep and ``--decode`` /
``--halfprec`` / ``--mla``: ``--serving``, ``--variant-costs``, ``--loader`` and ``--kv-accuracy``. Their flags (:func:`add_flags`,
called by the CLI's parser) and the runs they start (:func:`run`). Every benchmark of the project
has one front door, ``tvm-attention bench``; the code that measures lives in this package.

Importing this module loads no benchmark (the standard library only): the CLI's parser calls
:func:`add_flags` for every command line.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys

#: the ``bench`` flags that each choose one benchmark instead of the length sweep
MODES = ("decode", "halfprec", "mla", "serving", "variant_costs", "loader", "kv_accuracy")


def add_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("other benchmarks (each instead of the length sweep; docs/benchmarks.md)")
    g.add_argument("--serving", action="store_true",
                   help="serving ratios side by side: symbolic vs static shapes, varlen vs dense, the loader's "
                        "overhead per call; serving.md/json under --out (--tiny: short lengths, few rounds)")
    g.add_argument("--variant-costs", action="store_true",
                   help="each attention variant (window, softcap, ALiBi, sinks, kv_start, user-written modifiers) "
                        "against the same kernel without it, prefill and decode, against its speed goal; "
                        "variants.md/json under --out (--tiny: small shapes, one round)")
    g.add_argument("--loader", action="store_true",
                   help="what a call through tvm_attention.load costs over the bare exported function at a kvcache "
                        "decode step (GQA 32:8, D 128, 1 thread; batch --decode-batch, default 1, keys "
                        "--decode-cache, default 256); printed, no files")
    g.add_argument("--kv-accuracy", action="store_true",
                   help="what each 8-bit cache dtype and scale granularity (per kv head, token, group of 32) costs "
                        "in accuracy on a decode step against a cache with outliers, the float64 reference's and "
                        "our kernel's; kv_accuracy.md/json under --out (--tiny: a small cache)")
    g.add_argument("--only", nargs="+", default=None, metavar="PAIR",
                   help="--variant-costs: only these pairs (window_prefill, window_decode, softcap_prefill, ...: "
                        "the rows of docs/results/variants.md; default: every pair)")
    g.add_argument("--rounds", type=int, default=None,
                   help="--serving, --variant-costs, --loader: alternated rounds per comparison")
    g.add_argument("--calls", type=int, default=None,
                   help="--serving, --loader: calls per measurement of the loader's per-call cost")


def run(a: argparse.Namespace) -> int | None:
    """The exit code of the benchmark ``a`` chooses with ``--serving``, ``--variant-costs``,
    ``--loader`` or ``--kv-accuracy``; None when it chooses none of them (the sweep, ``--decode``, ``--halfprec``);
    2 when it chooses several."""
    chosen = [m for m in MODES if getattr(a, m, False)]
    if len(chosen) > 1:
        print("tvm-attention bench: choose one of " + ", ".join("--" + m.replace("_", "-") for m in chosen),
              file=sys.stderr)
        return 2
    if not chosen or chosen[0] in ("decode", "halfprec", "mla"):  # the CLI runs these itself
        return None
    return {"serving": _serving, "variant_costs": _variant_costs, "loader": _loader,
            "kv_accuracy": _kv_accuracy}[chosen[0]](a)


def _kv_accuracy(a: argparse.Namespace) -> int:
    from . import kv_accuracy  # TVM loads only for the benchmarks that compile

    cfg = kv_accuracy.quick_config() if a.tiny else kv_accuracy.Config()
    report = kv_accuracy.run(cfg, say=lambda m: print(m, flush=True))
    paths = kv_accuracy.write(report, a.out)
    print()
    print(kv_accuracy.markdown(report))
    print(f"results: {paths['md']}, {paths['json']}")
    return 0


def _serving(a: argparse.Namespace) -> int:
    from . import serving  # TVM loads only for the benchmarks that compile

    cfg = serving.quick_config() if a.tiny else serving.full_config()
    over = {k: v for k, v in (("rounds", a.rounds), ("calls", a.calls)) if v is not None}
    cfg = dataclasses.replace(cfg, **over)
    report = serving.run(cfg, threads=a.threads, quick=a.tiny, say=lambda m: print(m, flush=True))
    paths = serving.write(report, a.out)
    print()
    print(serving.markdown(report))
    print(f"\nresults: {paths['md']}, {paths['json']}")
    return 0


def _variant_costs(a: argparse.Namespace) -> int:
    from . import variants  # TVM loads only for the benchmarks that compile

    only = tuple(a.only or ())
    unknown = [n for n in only if n not in variants.GOALS]
    if unknown:
        print(f"tvm-attention bench --only: unknown pair(s) {', '.join(unknown)}; known: "
              f"{', '.join(variants.GOALS)}", file=sys.stderr)
        return 2
    cfg = variants.quick_config() if a.tiny else variants.Config()
    if a.rounds:
        cfg = dataclasses.replace(cfg, rounds=a.rounds)
    report = variants.run(cfg, threads=a.threads, only=only)
    paths = variants.write(report, a.out)
    print(f"wrote {paths['md']}")
    return 0


def _loader(a: argparse.Namespace) -> int:
    from . import loader_calls  # TVM loads only for the benchmarks that compile

    calls = a.calls or (50 if a.tiny else loader_calls.CALLS)
    rounds = a.rounds or (2 if a.tiny else loader_calls.ROUNDS)
    for batch, cache in itertools.product(a.decode_batch or [loader_calls.BATCH],
                                          a.decode_cache or [loader_calls.CACHE]):
        loader_calls.run(batch, cache, calls, rounds)
    return 0
