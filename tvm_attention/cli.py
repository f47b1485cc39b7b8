"""``tvm-attention``: build, validate, inspect and run fused attention kernels.

Thin: parses flags into an AttentionSpec and calls the rooms (build, artifact, loader, validate).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from .layouts import LAYOUTS, get_layout, in_words, layouts_where
from .loader import ArtifactError, check_artifact, confirm_spec, load, read_manifest
from .quant import KV_SCALES
from .spec import AttentionSpec, SpecError
from .threads import num_threads, set_num_threads
from .validate import validate_callable

DEFAULT_SPEC = dict(batch=1, heads=8, seq_q=1024, head_dim=64, dtype="float32", causal=False)
DEFAULT_OUT = "artifacts"


# Representative values of a dim given as plain ``dyn`` (what the build validates, times and looks
# up tuning logs at; ``dyn:N`` picks another) are the layout entry's ``cli_defaults``.
#: the layouts that take batch and lengths at call time (``always_dynamic``), in words
PER_CALL_LAYOUTS = in_words(layouts_where("always_dynamic"))


def _dim(text: str):
    """``--batch``/``--seq-q``/``--seq-kv``: an int, ``dyn`` or ``dyn:N`` (symbolic, representative N)."""
    t = str(text).strip().lower()
    if t == "dyn" or t.startswith("dyn:"):
        rep = t[4:]
        if t.startswith("dyn:") and not (rep.isdigit() and int(rep) > 0):
            raise argparse.ArgumentTypeError(f"{text!r}: expected dyn or dyn:N with N a positive int")
        return ("dyn", int(rep) if rep else None)
    try:
        return int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected an int, dyn, or dyn:N") from None


def _length(text: str) -> int:
    """``bench --seq``: a sequence length, a positive int."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected an int") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"{text}: a sequence length is a positive int")
    return n


class _Given(argparse.Action):
    """argparse's ``store`` that also notes its flag in ``namespace.given`` (the parser's default:
    ``()``): a mode of a command that does not use the flag refuses it when the user gave it,
    even at its default value, and one that uses it only when given can tell."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.given = (*getattr(namespace, "given", ()), self.option_strings[0])


def _add_spec_flags(p: argparse.ArgumentParser, defaults: dict | None = None) -> None:
    """The flags that make an AttentionSpec, in groups; ``defaults`` (``run``'s default spec) makes
    every one optional, else --heads and --head-dim are required and --batch, --seq-q are required
    with the bhsd layout (the other layouts take them at call time)."""
    d = defaults or {}
    dyn = " (or dyn / dyn:N: symbolic, any value at call time; N is the representative value)"
    needed = "" if d else "; required with --layout bhsd (the other layouts take it at call time)"
    g = p.add_argument_group("layout")
    g.add_argument("--layout", default="bhsd", choices=list(LAYOUTS),
                   help="; ".join(f"{n}: {e.cli_help}" for n, e in LAYOUTS.items()) + ". "
                        f"{PER_CALL_LAYOUTS} take batch and lengths at call time "
                        "(ints are representative)")
    g.add_argument("--page-size", type=int, default=None,
                   help="paged layout: keys per page (compiled in; default 16)")
    g.add_argument("--return-lse", action="store_true", default=False,
                   help="the kernel also returns lse: each row's natural log-sum-exp, float32 "
                        "((B, H, Sq); varlen (H, total_q)); -inf for a row that sees no key")
    g.add_argument("--device-checks", action="store_true", default=False,
                   help=f"CUDA builds with index arrays ({', '.join(n for n, e in LAYOUTS.items() if e.index_args)}, "
                        "--kv-start): a check kernel validates "
                        "them on the device and the call gains a last output index_error (1,) int32, 0 when valid "
                        "(its bits: docs/cuda.md); CPU builds always check on the host and refuse it")
    g = p.add_argument_group("shape" + ("" if d else " (--heads and --head-dim always required)"))
    g.add_argument("--batch", type=_dim, default=d.get("batch"), metavar="B", help="batch" + dyn + needed)
    g.add_argument("--heads", type=int, default=d.get("heads"), required=not d, metavar="H", help="query heads")
    g.add_argument("--kv-heads", type=int, default=None, metavar="KH",
                   help="K/V heads (default: --heads); heads %% KH == 0 (GQA/MQA)")
    g.add_argument("--seq-q", type=_dim, default=d.get("seq_q"), metavar="SQ", help="query length" + dyn + needed)
    g.add_argument("--seq-kv", type=_dim, default=None, metavar="SKV", help="key length (default: --seq-q)" + dyn)
    g.add_argument("--head-dim", type=int, default=d.get("head_dim"), required=not d, metavar="D", help="head dimension")
    g.add_argument("--head-dim-v", type=int, default=None, metavar="DV",
                   help="head dimension of v and o (default: --head-dim); DeepSeek's unabsorbed prefill is 192 / 128")
    g.add_argument("--dtype", default=d.get("dtype", "float32"),
                   help="float32, bfloat16 or float16: inputs, caches and output (softmax and accumulation are float32; on CPU only the fused "
                        "family takes the half dtypes)")
    g = p.add_argument_group(f"KV cache ({in_words(layouts_where('is_cache'))} layouts)")
    g.add_argument("--append", action="store_true", default=d.get("append", False),
                   help="the kernel takes k_new, v_new (batch, kv_heads, seq_q, D) last (mla layouts: kv_new (batch, "
                        "seq_q, D), the new latent rows), writes them into the cache at "
                        "cache_seqlens[b]... (quantized for an 8-bit cache) and attends to them in the same call; "
                        "cache_seqlens is the length before the append")
    g.add_argument("--kv-dtype", default=d.get("kv_dtype"), metavar="DTYPE",
                   help="an 8-bit K/V cache: float8_e4m3fn, float8_e5m2 or int8 (q and o keep --dtype); the kernel "
                        "then takes k_scale, v_scale (kv_heads,) float32 after the variant arguments "
                        "(tvm_attention.quantize_kv makes both; mla layouts: one kv_scale)")
    g.add_argument("--kv-scale", default=d.get("kv_scale", "head"), choices=KV_SCALES,
                   help="with --kv-dtype: one scale per kv head (default), per token (k_scale/v_scale shaped as the "
                        "cache without head_dim) or per group of 32 elements of head_dim (llama.cpp's Q8_0); finer "
                        "scales follow outliers at 4 bytes each (docs/serving.md)")
    g.add_argument("--q-dtype", default=d.get("q_dtype"), metavar="DTYPE",
                   help="fp8 inputs: q stored as float8_e4m3fn too, with --kv-dtype float8_e4m3fn (FlashAttention-3's "
                        "fp8 forward; o keeps --dtype); the kernel then takes q_scale (heads,) float32 before "
                        "k_scale. Built by the Hopper kernel (--target cuda --arch sm_90 --schedule fused_hopper)")
    g.add_argument("--qk-int8", action="store_true", default=d.get("qk_int8", False),
                   help="with --kv-dtype int8: round each query row to int8 (scale max|q|/127) and take QK^T as "
                        "integer dot products, as llama.cpp does; changes the numerics (docs/semantics.md)")
    # the attention variants (docs/semantics.md); each is compiled in
    g = p.add_argument_group("mask and variants (each compiled in; docs/semantics.md)")
    g.add_argument("--causal", action="store_true", default=d.get("causal", False),
                   help="bottom-right causal mask: query i sees key j iff j <= i + Skv - Sq")
    g.add_argument("--scale", type=float, default=None, help="softmax scale (default 1/sqrt(D))")
    g.add_argument("--window", type=_window, default=None, metavar="L[,R]",
                   help="sliding window: a row at position p sees keys p-L .. p+R (-1: unbounded; --window -1,R "
                        "is taken as --window=-1,R). L alone is (L, -1), or (L, 0) with --causal; FlashAttention's "
                        "window_size. transformers' sliding_window=W is --window W-1 --causal")
    g.add_argument("--softcap", type=float, default=None, metavar="C",
                   help="logit softcap: the scaled score x becomes C*tanh(x/C) before masking (Gemma-2)")
    g.add_argument("--alibi", action="store_true", default=False,
                   help="ALiBi: the score gains -slope_h*|p - j|; the kernel takes alibi_slopes (H,) float32")
    g.add_argument("--sinks", action="store_true", default=False,
                   help="attention sinks: the kernel takes sinks (H,) float32 logits that join each row's softmax "
                        "denominator (gpt-oss)")
    g.add_argument("--kv-start", action="store_true", default=False,
                   help="left padding: the kernel takes kv_start (B,) int32; keys before kv_start[b] are hidden "
                        f"(FlashAttention's cache_leftpad; {in_words(layouts_where('packed', False))})")
    # user-written modifiers (tvm_attention.modifiers; docs/semantics.md#user-written-modifiers)
    g = p.add_argument_group("user-written modifiers (docs/semantics.md#user-written-modifiers)")
    g.add_argument("--score-mod", default=None, metavar="SRC",
                   help="score modifier score_mod(score, b, h, q_idx, kv_idx): Python source (a lambda or a def), "
                        "or FILE.py:NAME (the def NAME in FILE.py); compiled into the tile")
    g.add_argument("--mask-mod", default=None, metavar="SRC",
                   help="mask modifier mask_mod(b, h, q_idx, kv_idx) -> visible, joined with the spec's mask; as "
                        "--score-mod")
    g.add_argument("--mod-tensor", action="append", default=[], type=_mod_tensor, metavar="NAME:DTYPE:DIMS",
                   help="an extra tensor the modifiers read by NAME (a call argument): DTYPE int32 or float32, "
                        "DIMS comma-separated (ints or batch, heads, kv_heads, seq_q, seq_kv: the sizes of its "
                        "validation inputs; every dim is taken at call time). Repeat for more")
    g.add_argument("--key-bounds", action="store_true", default=False,
                   help="the kernel takes key_lo, key_hi (B, positions) int32: a row at position p sees only keys "
                        "key_lo[b,p] <= j < key_hi[b,p] (non-decreasing in p), and whole key tiles outside a row "
                        "tile's bounds are skipped (a block mask given at call time)")
    g.add_argument("--custom-mask", action="store_true", default=False,
                   help="the kernel takes custom_mask (bytes,) uint8 and mask_indptr (B+1,) int32: FlashInfer's "
                        "packed bits, row i of sequence b sees key j only where bit i*keys_b + j of its bytes is "
                        "set (ANDed with causal, the window and the bounds; the loader packs a boolean mask)")


def _mod_tensor(text: str) -> tuple[str, str, tuple]:
    """``--mod-tensor NAME:DTYPE:DIM,DIM``."""
    parts = str(text).split(":")
    if len(parts) != 3 or not parts[2]:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME:DTYPE:DIMS (e.g. doc:int32:batch,seq_kv)")
    dims = tuple(int(d) if d.strip().lstrip("-").isdigit() else d.strip() for d in parts[2].split(","))
    return parts[0], parts[1], dims


def _modifier_source(text: str | None, flag: str) -> str | None:
    """``--score-mod``/``--mask-mod``: source text, or ``FILE.py:NAME`` (that function's source)."""
    if text is None:
        return None
    head, _, name = text.rpartition(":")
    if head.endswith(".py") and name.isidentifier():
        import ast
        from pathlib import Path

        path = Path(head)
        if not path.is_file():
            raise SpecError(f"{flag} {text}: no file {head}")
        src = path.read_text()
        for node in ast.parse(src).body:
            if isinstance(node, ast.FunctionDef) and node.name == name:
                return ast.get_source_segment(src, node)
        raise SpecError(f"{flag} {text}: {head} defines no function {name!r}")
    return text


#: Options whose value may begin with "-": ``--window -1,23`` (left unbounded).
NEGATIVE_VALUE_OPTIONS = ("--window",)


def _join_negative_values(argv: list[str]) -> list[str]:
    """``--window -1,23`` as ``--window=-1,23``. argparse takes a token that begins with "-" for an
    option unless it is a plain negative number (``-1`` parses, ``-1,23`` does not: "expected one
    argument"), so without this only the ``=`` form of a window open on the left would parse. No
    flag here is spelled "-" and a digit, so such a token after ``--window`` is its value; nothing
    after a bare ``--`` is touched."""
    args, out, i = list(argv), [], 0
    while i < len(args):
        if args[i] == "--":
            return out + args[i:]
        if args[i] in NEGATIVE_VALUE_OPTIONS and i + 1 < len(args) and re.match(r"-\d", args[i + 1]):
            out.append(f"{args[i]}={args[i + 1]}")
            i += 2
        else:
            out.append(args[i])
            i += 1
    return out


def _window(text: str) -> tuple[int, int]:
    """``--window L[,R]``: ``(L, None)`` for L alone (its right bound follows --causal)."""
    parts = str(text).split(",")
    try:
        vals = [int(x) for x in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected L or L,R (ints, -1 unbounded)") from None
    if len(vals) not in (1, 2) or any(v < -1 for v in vals):
        raise argparse.ArgumentTypeError(f"{text!r}: expected L or L,R (ints >= -1; -1 unbounded)")
    return (vals[0], vals[1] if len(vals) == 2 else None)


def _spec_from_args(a: argparse.Namespace) -> AttentionSpec:
    dims, dynamic = {}, []
    layout = get_layout(a.layout)
    per_call = bool(layout.always_dynamic)  # batch and lengths are per call
    defaults = layout.cli_defaults
    for name, flag in (("batch", "--batch"), ("seq_q", "--seq-q"), ("seq_kv", "--seq-kv")):
        v = getattr(a, name)
        if name == "seq_kv" and v is None and not per_call:
            v = a.seq_q  # default: like seq_q (dyn too when seq_q is)
        if per_call and v is None:
            v = ("dyn", None)
        if v is None and name != "seq_kv":
            raise SpecError(f"{flag} is required with --layout {a.layout} (an int, dyn or dyn:N)")
        if isinstance(v, tuple):
            dynamic.append(name)
            v = v[1] or defaults[name]
            if v is None:  # seq_kv: dyn -> seq_q's representative
                v = dims["seq_q"]
        # varlen: every one is symbolic (the spec says so); an int is its representative value
        dims[name] = v
    return AttentionSpec(
        batch=dims["batch"], heads=a.heads, kv_heads=a.kv_heads, seq_q=dims["seq_q"], seq_kv=dims["seq_kv"],
        head_dim=a.head_dim, dtype=a.dtype, causal=a.causal, scale=a.scale, layout=a.layout,
        dynamic=tuple(dynamic), return_lse=a.return_lse,
        page_size=a.page_size, window=_window_of(a), softcap=a.softcap or None,
        alibi=a.alibi, sinks=a.sinks, kv_start=a.kv_start,
        score_mod=_modifier_source(a.score_mod, "--score-mod"), mask_mod=_modifier_source(a.mask_mod, "--mask-mod"),
        mod_tensors=tuple(a.mod_tensor), key_bounds=a.key_bounds, kv_dtype=a.kv_dtype,
        append=a.append, device_checks=a.device_checks, qk_int8=a.qk_int8, kv_scale=a.kv_scale,
        head_dim_v=a.head_dim_v, custom_mask=a.custom_mask, q_dtype=a.q_dtype,
    )


def _window_of(a: argparse.Namespace) -> tuple[int, int] | None:
    """``--window``'s (left, right): L alone means (L, 0) with --causal, else (L, -1); --causal
    with R > 0 is an error (the spec names it)."""
    if a.window is None:
        return None
    left, right = a.window
    if right is None:
        right = 0 if a.causal else -1
    return (left, right)


def _add_build_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("build")
    g.add_argument("--target", default="llvm",
                   help="'llvm' (this CPU, default), 'cuda', or a JSON target such as "
                        "'{\"kind\": \"llvm\", \"mcpu\": \"haswell\"}'")
    g.add_argument("--arch", default=None, help="CUDA architecture for --target cuda: sm_80, sm_86, sm_89, sm_90")
    g.add_argument("--schedule", default="fused", choices=SCHEDULE_CHOICES,
                   help="fused (default; on CUDA: tensor cores for fp16/bf16 on sm_80+, else CUDA cores), "
                        "materialized (global S×S baseline), rowcache (two-pass, row buffer); CUDA only: "
                        "fused_tc (tensor cores) or fused_simt (CUDA cores) explicitly, fused_hopper (sm_90: TMA, "
                        "wgmma, warp specialization)")
    g.add_argument("--knobs", default=None,
                   help='hand-schedule knob overrides as JSON, e.g. \'{"block_n": 128}\' (no tuning log is read)')
    g.add_argument("--threads", type=int, default=None, help="runtime threads (default: all cores)")
    g.add_argument("--seed", type=int, default=0, help="seed of the validation inputs")
    g.add_argument("--no-log", action="store_true",
                   help="ignore tuning logs: always use the hand schedule")
    g.add_argument("--no-cache", action="store_true",
                   help="build even when the build cache holds this build, and neither read nor write the cache "
                        "(default: reuse it; it is builds/ in the user cache, see docs/cli.md)")
    g.add_argument("--allow-unfused", action="store_true",
                   help="export a fused-schedule build even if it fails the fusion audit (default: error, nothing written)")
    g.add_argument("--from-log", default=None, metavar="DIR",
                   help="use the best record of this tuning log (default: your tune's log in the user cache, then "
                        "the committed tuning_logs/<target>/<spec>/, when either has a record)")


SCHEDULE_CHOICES = ["fused", "materialized", "rowcache", "fused_tc", "fused_simt", "fused_hopper"]


def _build_and_export(a: argparse.Namespace, spec: AttentionSpec, out: Path):
    from .artifact import export  # TVM loads only for the commands that compile
    from .pipeline import build_best  # TVM loads only for the commands that compile

    from .target import resolve_target  # TVM loads only for the commands that compile

    set_num_threads(a.threads)
    try:
        knobs = json.loads(a.knobs) if a.knobs else None
    except json.JSONDecodeError as e:
        raise ValueError(f"--knobs is not valid JSON: {e}") from None
    if knobs is not None and not isinstance(knobs, dict):
        raise ValueError(f"--knobs must be a JSON object such as '{{\"block_n\": 128}}', got {a.knobs}")
    target = resolve_target(a.target, arch=a.arch)
    built, validation = build_best(
        spec, schedule=a.schedule, target=target, knobs=knobs, use_log=not a.no_log,
        log_dir=a.from_log, seed=a.seed, say=lambda m: print(m, file=sys.stderr), cache=not a.no_cache,
    )
    if built.cache_entry:
        print(f"from the build cache: {built.cache_entry} (--no-cache builds it again)", file=sys.stderr)
    if a.schedule == "fused" and not built.audit.fused and not a.allow_unfused:
        raise AuditFailed(
            f"the fused schedule failed the fusion audit; nothing exported (--allow-unfused exports it "
            f"anyway)\n{built.audit.format()}"
        )
    manifest = export(built, out, validation)
    return built, validation, manifest


class AuditFailed(RuntimeError):
    """A fused-schedule build whose lowered IR failed the fusion audit."""


def _schedule_line(built) -> str:
    info = built.schedule_info()
    line = f"{built.schedule} ({built.source})"
    kernel = getattr(built.knobs, "FAMILY", None)
    if kernel and built.target.kind.name == "cuda":
        line += f" [{kernel}]"
    if info.get("knobs"):
        line += " " + json.dumps(info["knobs"])
    sel = built.selection
    if sel:
        line += (f"  [timed here: tuned {sel['tuned_s'] * 1e3:.3f} ms vs hand {sel['hand_s'] * 1e3:.3f} ms, "
                 f"kept {sel['kept']}]")
    return line


def log_line(schedule: dict) -> str:
    """Which tuning log a build used (its manifest's ``schedule``), for ``build``, ``run`` and
    ``inspect``: the folder of the record it replays, the log whose record lost to the hand
    schedule when timed here, or the folders looked in when none had a record."""
    if schedule.get("log_dir"):
        return f"{schedule['log_dir']} (its best validated record)"
    sel = schedule.get("selection") or {}
    if sel.get("tuned_log"):
        return f"{sel['tuned_log']}: its record ran slower here than the hand schedule, which was kept"
    if schedule.get("logs_searched"):
        return f"none: no record for this spec and target in {', '.join(schedule['logs_searched'])} (make one: tvm-attention tune)"
    return "none: the hand schedule was asked for (--no-log or --knobs)" if schedule.get("source") == "hand" else "?"


def cmd_build(a: argparse.Namespace) -> int:
    spec = _spec_from_args(a)
    out = Path(a.out)
    built, validation, _ = _build_and_export(a, spec, out)
    print(f"spec: {spec.short_name()}  target: {built.target}")
    print(f"schedule: {_schedule_line(built)}")
    print(f"log: {log_line(built.schedule_info())}")
    print(built.audit.format())
    if built.resources is not None:
        print(format_resources(built.resources))
    print(validation.format())
    print(f"artifact: {out}")
    return 0


def format_resources(r: dict) -> str:
    if "unavailable" in r:
        return f"resources: unavailable ({r['unavailable']})"
    text = (f"resources ({r['arch']}, nvcc {r['nvcc']}): {r['registers']} registers/thread, "
            f"spills {r['spill_store_bytes']} B stored / {r['spill_load_bytes']} B loaded, "
            f"stack frame {r['stack_frame_bytes']} B, shared {r['shared_bytes']} B/block"
            + (f" + {r['dynamic_shared_bytes']} B dynamic" if r.get("dynamic_shared_bytes") else ""))
    if "occupancy" in r:
        text += (f", {r['threads_per_block']} threads/block, occupancy {r['occupancy']:.0%} "
                 f"({r['blocks_per_sm']} blocks/SM, limited by {r['occupancy_limited_by']})")
    if r.get("ptx_instructions"):
        text += "\n  PTX: " + ", ".join(f"{k} {v}" for k, v in r["ptx_instructions"].items() if v)
    if r.get("sass_instructions"):
        text += "\n  SASS: " + ", ".join(f"{k} {v}" for k, v in r["sass_instructions"].items() if v)
    if r.get("wgmma_serialized"):
        text += "\n  WARNING: ptxas serialized the wgmma products: " + "; ".join(r.get("ptxas_notes", []))
    return text


def cmd_run(a: argparse.Namespace) -> int:
    from .target import check_target_runnable, is_cuda, resolve_target  # TVM loads only for the commands that compile
    from .timing import time_built  # TVM loads only for the commands that compile

    target = resolve_target(a.target, arch=a.arch)
    if is_cuda(target):
        raise ValueError("`run` times the kernel on this machine's CPU; build for a GPU with `tvm-attention build "
                         "--target cuda ...` (and run it where the GPU is: `validate`, or serving code)")
    check_target_runnable(target, f"`run` with --target {a.target}")  # a JSON llvm target this host can run is fine
    spec = _spec_from_args(a)
    out = Path(a.out) if a.out else default_out(a.schedule, spec, a.knobs)
    replaced = out.exists()
    built, validation, _ = _build_and_export(a, spec, out)
    t = time_built(built, spec)
    peaks = machine_peaks(built.target, spec)

    def dim(n: str) -> str:
        v = getattr(spec, n)
        return f"dyn (timed at {v})" if n in spec.dynamic else str(v)

    print(f"spec:       {spec.short_name()}  (layout {spec.layout} B={dim('batch')} H={spec.heads} KH={spec.kv_heads} "
          f"Sq={dim('seq_q')} Skv={dim('seq_kv')} D={spec.head_dim}{f' Dv={spec.v_dim}' if spec.head_dim_v else ''} "
          f"{spec.dtype} causal={spec.causal})")
    print(f"schedule:   {_schedule_line(built)}")
    print(f"log:        {log_line(built.schedule_info())}")
    print(f"target:     {built.target}  threads: {num_threads()}")
    print(built.audit.format())
    print(validation.format())
    print(f"time:       {t.median_s * 1e3:.3f} ms per call (median of {t.repeats}, std {t.std_s * 1e3:.3f} ms)")
    gflops = t.gflops(spec)
    print(f"throughput: {gflops:.1f} GFLOP/s  (4·B·H·Sq·Skv·D{', halved for causal' if spec.causal else ''})")
    for name, peak in peaks:
        print(f"peak:       {gflops / peak:.0%} of {name} ({peak:.0f} GFLOP/s on {num_threads()} threads, "
              f"measured just now)")
    print(f"artifact:   {out.resolve()}{'  (replaced the one an earlier run left there)' if replaced else ''}")
    return 0


def default_out(schedule: str, spec: AttentionSpec, knobs: str | None) -> Path:
    """``run``'s artifact folder: ``artifacts/<schedule>_<spec>``; with ``--knobs`` a digest of the
    knobs joins the name, so a knob experiment never replaces the default build's artifact."""
    name = f"{schedule}_{spec.short_name()}"
    if knobs:
        import hashlib

        try:
            canon = json.dumps(json.loads(knobs), sort_keys=True)
        except json.JSONDecodeError:
            canon = knobs  # _build_and_export names the JSON error
        name = f"{schedule}-knobs-{hashlib.sha256(canon.encode()).hexdigest()[:8]}_{spec.short_name()}"
    return Path(DEFAULT_OUT) / name


def machine_peaks(target, spec: AttentionSpec) -> list[tuple[str, float]]:
    """The compute roofs a ``run`` is judged against, measured now for ``target``'s ISA on the
    runtime's threads: the FMA peak, and for bfloat16 the AVX512-BF16 dot-product peak where the
    target has it (the bf16 kernels multiply with it). The README's results give the same
    fraction, so the two compare."""
    from .bench.cpu import bf16_dot_peak, fma_peak  # TVM loads only for the commands that compile

    peaks = [("the FMA peak", fma_peak(target=target).gflops)]
    if spec.dtype == "bfloat16":
        dot = bf16_dot_peak(target=target)
        if dot:
            peaks.append(("the bf16 dot-product peak", dot["gflops"]))
    return peaks


def cmd_tune(a: argparse.Namespace) -> int:
    import os
    import signal

    if a.backward:  # its flags' checks first: a refused flag costs no compiler import
        _check_tune_backward_flags(a)
    printed: list[str] = []

    def progress(m: str) -> None:
        printed.append(m)
        print(m, flush=True)

    def ctrl_c(*_) -> None:
        # Ctrl-C while tune() does not handle it (imports and set-up before, exit after): one
        # line and 130, never a KeyboardInterrupt traceback. tune() handles it in between.
        if not any(m.startswith("interrupted") for m in printed):  # os.write: print may be mid-line
            os.write(1, b"interrupted: nothing new was saved; rerun the same command to resume\n")
        os._exit(130)

    try:
        previous = signal.signal(signal.SIGINT, ctrl_c)
        restore = lambda: signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)  # noqa: E731
    except ValueError:  # not the main thread: Ctrl-C is the caller's business
        restore = lambda: None  # noqa: E731
    from .tune.driver import knob_summary, tune  # TVM loads only for the commands that compile

    from .target import resolve_target  # TVM loads only for the commands that compile

    spec = _spec_from_args(a)
    target = resolve_target(a.target, arch=a.arch)
    if a.backward:
        restore()
        return tune_backward_cmd(a, spec, target)
    if spec.dynamic:
        # Symbolic kernels are tuned at their representative shape: the knobs are tile sizes and
        # register blocks, the same at every length, and MetaSchedule measures concrete shapes.
        # A paged decode step is tuned as itself (its page order is measured in pages).
        from .task_mods import tuning_spec

        rep = tuning_spec(spec, target, a.schedule)
        if rep is spec:
            progress(f"{spec.short_name()} is symbolic ({', '.join(spec.dynamic)}): tuning its paged decode kernel "
                     f"at the representative step (batch {spec.batch}, seq_q {spec.seq_q}, {spec.seq_kv} keys per "
                     f"sequence in shuffled pages of {spec.page_size}); paged builds of this configuration use that log")
        else:
            progress(f"{spec.short_name()} is symbolic ({', '.join(spec.dynamic)}): tuning at the representative "
                     f"shape {rep.short_name()}; dynamic builds of this configuration use that log")
        spec = rep
    if a.runner is not None or a.import_timings is not None:
        try:
            return _tune_by_files(a, spec, target, progress)
        finally:
            restore()
    try:
        result = tune(spec, target=target, schedule=a.schedule, trials=a.trials, work_dir=a.work_dir,
                      search=a.search, warm_start=a.warm_start,
                      per_round=a.per_round, seed=a.seed, threads=a.threads,
                      rpc_tracker=a.rpc_tracker, rpc_key=a.rpc_key, rpc_workers=a.rpc_workers,
                      progress=progress)
    except BaseException:
        restore()
        raise
    if result.interrupted:  # tune() printed the one line (what is saved, how to resume); the
        return 130  # quiet handler stays until exit, for a second Ctrl-C racing the exit
    restore()
    if result.best_task is not None and result.best_secs < 1e9:
        print(f"best: {result.best_secs * 1e3:.3f} ms, {spec.flops() / result.best_secs / 1e9:.1f} GFLOP/s "
              f"({result.best_task}) {knob_summary(result.best_knobs)}")
    print(f"log: {result.work_dir}  ({result.trials_total} trials, {result.trials_new} new)")
    return 130 if result.interrupted else 0


#: ``tune``'s flags that only the forward's search uses, with how ``--backward`` tells they were
#: given (a default is not given; ``_Given`` notes the flags whose default is a value)
FORWARD_SEARCH_FLAGS = (("--trials", "given"), ("--search", "given"), ("--per-round", "given"), ("--seed", "given"),
                        ("--schedule", "given"), ("--threads", "threads"), ("--warm-start", "warm_start"),
                        ("--rpc-tracker", "rpc_tracker"), ("--rpc-key", "rpc_key"), ("--rpc-workers", "rpc_workers"),
                        ("--runner", "runner"), ("--import-timings", "import_timings"), ("--wheel", "wheel"))


def _check_tune_backward_flags(a: argparse.Namespace) -> None:
    """``tune --backward``'s flags, before anything loads: the backward's search measures each of
    its knob points once on this machine (``tvm_attention.tune.backward``: no trial budget, rounds,
    cost model, seed, schedule family or thread count of the forward's), so each of the forward's
    search flags given is refused by name, never ignored; a ``--work-dir`` that is, or lies under,
    a file is named with the flag."""
    given = getattr(a, "given", ())
    others = [flag for flag, dest in FORWARD_SEARCH_FLAGS
              if (flag in given if dest == "given" else getattr(a, dest, None) not in (None, False))]
    if others:
        raise SpecError(f"tune --backward measures every knob point on this machine, once each; {', '.join(others)} "
                        f"{'is' if len(others) == 1 else 'are'} for the forward's search")
    if a.work_dir is not None:
        work = Path(a.work_dir)
        blocker = next((d for d in (work, *work.parents) if d.exists()), None)
        if blocker is not None and not blocker.is_dir():
            raise ValueError(f"--work-dir {a.work_dir}: {blocker} is a file, not a folder (the search's log is a "
                             "folder of JSON files)")


def tune_backward_cmd(a: argparse.Namespace, spec: AttentionSpec, target) -> int:
    """``tune --backward``: the backward's knobs (tiles, the dQ strategy) searched with MetaSchedule
    (``tvm_attention.tune.backward``), one task per point; the log under ``--work-dir``, default
    ``<cache>/tuning_logs/backward/<target>/<spec>/``. Other searches' flags are refused by name
    (:func:`_check_tune_backward_flags`, before :func:`cmd_tune` loads the compiler)."""
    from .logs import target_key  # the log folder's target part
    from .paths import cache_dir  # the per-user cache
    from .tune.backward import tune_backward  # TVM loads only for the commands that compile

    work = a.work_dir or cache_dir() / "tuning_logs" / "backward" / target_key(target) / spec.short_name()
    found = tune_backward(spec, work, target)
    print("| block_m | block_n | block_m_dq | dq_chunks | ms |\n|---|---|---|---|---|")
    for kn, secs in sorted(found.seconds.items(), key=lambda x: (x[1] is None, x[1] or 0)):
        print(f"| {kn.block_m} | {kn.block_n} | {kn.block_m_dq} | {kn.dq_chunks} | "
              f"{'failed' if secs is None else format(secs * 1e3, '.3f')} |")
    k = found.knobs
    print(f"best: block_m={k.block_m} block_n={k.block_n} block_m_dq={k.block_m_dq} dq_chunks={k.dq_chunks} "
          f"(tvm_attention.backward.BackwardKnobs); log: {found.work_dir}")
    return 0


def _tune_by_files(a: argparse.Namespace, spec: AttentionSpec, target, progress) -> int:
    """``tune --runner dir:PATH`` (write the candidates into a payload for a device reachable only
    by files) and ``tune --import-timings PATH`` (commit the timings it brought back)."""
    from .tune import dirrunner  # TVM loads only for the commands that compile

    if a.runner is not None and a.import_timings is not None:
        raise ValueError("--runner dir:PATH writes a payload, --import-timings PATH reads one back: one at a time")
    if a.rpc_tracker is not None:
        raise ValueError("--rpc-tracker measures over the network; --runner dir: / --import-timings go by files")
    if a.import_timings is not None:
        dirrunner.import_timings(spec, target, a.import_timings, schedule=a.schedule, work_dir=a.work_dir,
                                 progress=progress)
        return 0
    dirrunner.export_payload(spec, target, dirrunner.parse_runner(a.runner), schedule=a.schedule, trials=a.trials,
                             work_dir=a.work_dir, per_round=a.per_round, seed=a.seed, threads=a.threads,
                             search=a.search, warm_start=a.warm_start, wheel=a.wheel, progress=progress)
    return 0


#: ``bench``'s flags that each choose a benchmark instead of the length sweep: ``bench.modes``'
#: and those the CLI runs itself
BENCH_MODES = ("decode", "halfprec", "mla", "masks", "backward")


def cmd_bench(a: argparse.Namespace) -> int:
    import datetime

    from .bench.modes import MODES  # the standard library only

    # one benchmark at a time, said before anything loads: the first one dispatched would run
    # alone and the others be dropped without a word
    chosen = [m for m in dict.fromkeys((*MODES, *BENCH_MODES)) if getattr(a, m, False)]
    if len(chosen) > 1:
        raise ValueError("choose one of " + ", ".join("--" + m.replace("_", "-") for m in chosen)
                         + ": each runs a benchmark of its own")
    from .bench import (  # the bench package loads only for its commands
        Interrupted, Progress, ctrl_c_ignored, fmt_duration, mark_interrupted)
    from .bench.cpu import measure_ceilings  # TVM loads only for the commands that compile
    from .bench.plots import missing_note, plots_available  # TVM loads only for the commands that compile
    from .bench.sweep import points, run_sweep, write_outputs  # TVM loads only for the commands that compile
    from .bench import modes  # the bench package loads only for its commands
    from .target import host_cpu  # TVM loads only for the commands that compile

    if (code := modes.run(a)) is not None:  # --serving, --variant-costs, --loader
        return code
    threads = set_num_threads(a.threads)
    if a.decode:
        return bench_decode(a, threads)
    if a.halfprec:
        return bench_halfprec(a, threads)
    if a.mla:
        return bench_mla(a, threads)
    if a.masks:
        return bench_masks(a, threads)
    if a.backward:
        return bench_backward(a, threads)
    plots = not a.no_plots
    if plots and not plots_available():  # said before the sweep, not found missing after it
        print(missing_note("the sweep runs, its plots are skipped"), flush=True)
        plots = False
    if a.tiny:
        seqs, dims, causals, variants, tokens = [256, 512], [64], [False], a.variants or ["fused", "materialized"], None
        heads = 2
    else:
        seqs, dims, tokens, heads = a.seq, a.head_dim, (None if a.no_tokens else a.tokens), a.heads
        causals = {"both": [False, True], "yes": [True], "no": [False]}[a.causal]
        variants = a.variants or ["fused", "fused-tuned", "materialized", "numpy", "torch"]
    meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "cpu": host_cpu(),
            "threads": threads, "heads": heads, "variants": variants}
    print(f"# {meta['date']} cpu={meta['cpu']} threads={threads}", flush=True)
    try:
        meta.update(measure_ceilings(threads, say=lambda m: print(m, flush=True)))
    except KeyboardInterrupt:
        print("interrupted before the first measurement: nothing written", flush=True)
        return 130
    pts = points(seqs, dims, causals, heads, 1, tokens, dtypes=a.dtype)
    progress = Progress(len(pts) * len(variants) + (MEMORY_SCALING_UNITS if a.memory_scaling else 0))
    print(f"{progress.total} measurements: {len(pts)} point{'s' * (len(pts) != 1)} × {len(variants)} "
          f"variant{'s' * (len(variants) != 1)}"
          + (f" + {MEMORY_SCALING_UNITS} of --memory-scaling" if a.memory_scaling else ""), flush=True)
    results, interrupted = [], False
    try:
        results += run_sweep(pts, variants, threads, repeat=a.repeat, say=lambda m: print(m, flush=True),
                             skip_materializing_above=a.max_materialized, progress=progress)
        if a.memory_scaling:
            results += memory_scaling(threads, a.repeat, say=lambda m: print(m, flush=True), progress=progress)
        meta.update(measure_ceilings(threads, say=print, earlier=meta))  # the better of start and end
    except KeyboardInterrupt as e:  # keep what was measured; the closing roofs are skipped (the start's stand)
        results += e.partial if isinstance(e, Interrupted) else []
        interrupted = True
        mark_interrupted(meta, progress.done, progress.total)
        print(f"\ninterrupted after {progress.done} of {progress.total} measurements "
              f"({fmt_duration(progress.elapsed)})", flush=True)
    if not results:
        print("nothing was measured: nothing written", flush=True)
        return 130
    with ctrl_c_ignored():  # a second Ctrl-C cannot leave a file half written
        paths = write_outputs(results, a.out, meta)
    print(paths["md"].read_text())
    if interrupted:  # no plots: the sweep was stopped, the tables are what it measured
        print(f"partial results (interrupted after {progress.done} of {progress.total}): "
              f"{', '.join(str(p) for p in paths.values())}")
        return 130
    if plots:
        from .bench.plots import write_plots  # TVM loads only for the commands that compile

        try:
            for name, series in write_plots(results, meta, Path(a.out)).items():
                print(f"plot: {Path(a.out) / name}  ({', '.join(series)})")
        except KeyboardInterrupt:
            print(f"interrupted while plotting; the tables are complete: "
                  f"{', '.join(str(p) for p in paths.values())}", flush=True)
            return 130
    print(f"results: {', '.join(str(p) for p in paths.values())}")
    return 0


def _bench_report(a: argparse.Namespace, module, run) -> int:
    """``bench --decode`` / ``--halfprec``: ``run()``'s report written by ``module.write``; after
    Ctrl-C the points measured so far, marked partial, and exit 130."""
    from .bench import Interrupted, ctrl_c_ignored  # the bench package loads only for its commands

    try:
        report, code = run(), 0
    except Interrupted as e:
        report, code = e.partial, 130
        print(f"\ninterrupted after {e.completed} of {e.total} points", flush=True)
        if not report["rows"]:
            print("no point was measured: nothing written", flush=True)
            return code
    except KeyboardInterrupt:  # before the first point (the roofs)
        print("\ninterrupted before the first point: nothing written", flush=True)
        return 130
    with ctrl_c_ignored():  # a second Ctrl-C cannot leave a file half written
        paths = module.write(report, a.out)
    print(paths["md"].read_text())
    print(f"{'partial results' if code else 'results'}: {', '.join(str(p) for p in paths.values())}")
    return code


def bench_decode(a: argparse.Namespace, threads: int) -> int:
    """``bench --decode``: decode points (kvcache and paged vs torch SDPA, against the measured
    streaming-read roof); ``--tiny``: one small point per layout."""
    import dataclasses

    from .bench import decode  # TVM loads only for the commands that compile

    cfg = decode.quick_config() if a.tiny else decode.Config()
    over = {"batches": a.decode_batch, "caches": a.decode_cache, "dtypes": a.decode_dtype}
    cfg = dataclasses.replace(cfg, **{k: tuple(v) for k, v in over.items() if v})
    return _bench_report(a, decode, lambda: decode.run(cfg, threads, say=lambda m: print(m, flush=True)))


def bench_halfprec(a: argparse.Namespace, threads: int) -> int:
    """``bench --halfprec``: bf16 prefill (AVX512-BF16 dot products) against our fp32 and torch
    SDPA in both dtypes, with the FMA and bf16 dot-product peaks; ``--tiny``: one small point."""
    from .bench import halfprec  # TVM loads only for the commands that compile

    cfg = halfprec.quick_config() if a.tiny else halfprec.Config()
    return _bench_report(a, halfprec, lambda: halfprec.run(cfg, threads, say=lambda m: print(m, flush=True)))


def bench_mla(a: argparse.Namespace, threads: int) -> int:
    """``bench --mla``: MLA decode (H=128, 576 / 512) against the compute roofs, torch SDPA and
    llama.cpp, and a Dqk 192 / Dv 128 prefill against a D=192 build; ``--tiny``: small points."""
    from .bench import mla  # TVM loads only for the commands that compile

    cfg = mla.quick_config() if a.tiny else mla.Config()
    return _bench_report(a, mla, lambda: mla.run(cfg, threads, say=lambda m: print(m, flush=True)))


def bench_masks(a: argparse.Namespace, threads: int) -> int:
    """``bench --masks``: a custom mask hiding 90 % of the key tiles against an all-ones one, and a
    tree verify of 64 drafts against a causal append step; ``--tiny``: small points."""
    from .bench import masks  # TVM loads only for the commands that compile

    cfg = masks.quick_config() if a.tiny else masks.Config()
    return _bench_report(a, masks, lambda: masks.run(cfg, threads, say=lambda m: print(m, flush=True)))


def bench_backward(a: argparse.Namespace, threads: int) -> int:
    """``bench --backward``: our fused forward + backward against torch SDPA's at B1 H8, fp32 and
    bf16, D 64 / 128, S 1k-8k, causal and not, with the FMA peak and what eager FlexAttention's
    backward does; ``--tiny``: one small fp32 point each way. ``--seq`` given: its lengths instead
    (with ``--tiny`` too), in the timed points and the memory rows."""
    import dataclasses

    from .bench import backward  # TVM loads only for the commands that compile

    cfg = backward.quick_config() if a.tiny else backward.Config()
    if "--seq" in getattr(a, "given", ()):  # its default is the sweep's lengths, not this benchmark's
        cfg = dataclasses.replace(cfg, seqs=tuple(a.seq))
    return _bench_report(a, backward, lambda: backward.run(cfg, threads, say=lambda m: print(m, flush=True)))


#: ``--memory-scaling``'s measurements: fused and materialized at two lengths.
MEMORY_SCALING_UNITS = 4


def memory_scaling(threads: int, repeat: int, say=print, progress=None):
    """Fused at S = 32768 and 65536 (B=1, H=1, D=64); materialized only where its S×S buffer
    fits this machine's free memory (else recorded as skipped, with what it would need).
    ``progress``: the sweep's count (MEMORY_SCALING_UNITS more); Ctrl-C raises
    ``bench.Interrupted`` with what was measured."""
    import psutil

    from .bench import Interrupted, Progress  # the bench package loads only for its commands
    from .bench.sweep import Result, run_sweep  # TVM loads only for the commands that compile

    progress = progress if progress is not None else Progress(MEMORY_SCALING_UNITS)
    out = []
    try:
        for s in (32768, 65536):
            spec = AttentionSpec(batch=1, heads=1, seq_q=s, head_dim=64)
            out += run_sweep([("memory", spec)], ["fused"], threads, repeat=min(repeat, 2), say=say,
                             progress=progress)
            need = 4 * s * s  # the score buffer alone (P shares its memory after lowering)
            free = psutil.virtual_memory().available
            if need * 1.5 > free:
                out.append(Result(spec, "memory", "materialized", error=f"skipped: S×S scores need "
                                  f"{need / 2**30:.0f} GiB, {free / 2**30:.0f} GiB free"))
                progress.advance()
                say(f"{progress.tag()} [memory B=1 S={s} D=64] materialized=({out[-1].error})")
            else:
                out += run_sweep([("memory", spec)], ["materialized"], threads, repeat=1, say=say,
                                 progress=progress)
    except KeyboardInterrupt as e:
        raise Interrupted(out + (e.partial if isinstance(e, Interrupted) else []), progress.done,
                          progress.total) from None
    return out


def cmd_compare(a: argparse.Namespace) -> int:
    from .bench.compare import compare, compare_plot, format_compare  # TVM loads only for the commands that compile
    from .bench.plots import missing_note, plots_available  # TVM loads only for the commands that compile

    set_num_threads(a.threads)
    spec = _spec_from_args(a)
    plot = a.plot
    if plot and not plots_available():  # said before any build, not found missing after them
        print(missing_note(f"the comparison runs, its plot ({plot}) is skipped"), flush=True)
        plot = None
    entries = compare(spec, a.schedules, repeat=a.repeat)
    print(format_compare(spec, entries))
    for e in entries:
        if e.trace_summary:
            print(f"\n{e.label} trace (sampling decisions):")
            for line in e.trace_summary:
                print("   " + line.strip())
    if plot:
        labels = compare_plot(spec, entries, Path(plot))
        print(f"plot: {plot} ({', '.join(labels)})")
    return 0 if all(e.error is None for e in entries) else 1


def cmd_validate(a: argparse.Namespace) -> int:
    kernel = load(a.dir, num_threads=a.threads)
    result = validate_callable(kernel.spec, kernel, seed=a.seed)
    print(f"artifact: {a.dir}  spec: {kernel.spec.short_name()}")
    print(result.format())
    return 0 if result.passed else 1


def cmd_inspect(a: argparse.Namespace) -> int:
    m = read_manifest(a.dir)
    spec_status = "not checked (the library failed the checks below)"
    try:
        lib = check_artifact(a.dir, m)
        spec_status = confirm_spec(a.dir, m, lib)
        problem = None
    except ArtifactError as e:
        problem = str(e)
    audit = m.get("audit", {})
    print(f"artifact:   {a.dir}")
    print(f"spec:       {AttentionSpec.from_dict(m['spec']).short_name()}")
    print(f"entry:      {m['entry']} in {m['library']}  layout {m.get('layout')}")
    print(f"spec check: {spec_status}")
    print("args:       " + ", ".join(f"{x['name']}{tuple(x['shape'])}:{x['dtype']}" for x in m["args"]))
    print(f"target:     {json.dumps(m.get('target'))}")
    print(f"schedule:   {json.dumps(m.get('schedule'))}")
    print(f"log:        {log_line(m.get('schedule') or {})}")
    print(f"tvm:        {m.get('tvm_version')}")
    big = audit.get("largest_allocation") or {}
    biggest = (f"largest buffer {big.get('name')} {big.get('elements')} elements ({big.get('scope')})" if big
               else "no buffer")
    print(f"audit:      {str(audit.get('verdict')).upper()}  ({biggest}; one Sq×Skv score matrix would be "
          f"{audit.get('score_matrix_elements')} elements)")
    for r in audit.get("reasons", []):
        print(f"            - {r}")
    if "resources" in m:
        print(format_resources(m["resources"]))
    v = m.get("validation", {})
    if v.get("ran", True):
        used = v.get("tolerance_used")
        margin = f", the worst at {used:.1%} of its bound" if isinstance(used, float) and used == used else ""
        print(f"validation: {'PASS' if v.get('passed') else 'FAIL'}  max abs err {v.get('max_abs_err')} (criterion: "
              f"|out - ref| <= atol + rtol·|ref| per element, atol {v.get('atol')}, rtol {v.get('rtol')}{margin})")
    else:
        print(f"validation: NOT RUN ({v.get('reason')})")
    if problem:
        print(f"tvm-attention inspect: error: {problem}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    try:
        return a.func(a)
    except (SpecError, ValueError, RuntimeError) as e:
        print(f"tvm-attention {a.command}: error: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:
        if not (e.name or "").split(".")[0] in COMPILER_MODULES:
            raise
        # The runtime-only install (tvm-ffi, NumPy, ml_dtypes: what serving needs) has no compiler.
        print(f"tvm-attention {a.command}: error: `{a.command}` compiles kernels, which needs the full install "
              f"(apache-tvm, the compiler: pip install tvm-attention); this environment lacks the module "
              f"{e.name!r}, as the runtime-only install does. It loads and calls exported artifacts "
              f"(tvm_attention.load), and `validate` and `inspect` work on them", file=sys.stderr)
        return 2


#: Commands whose process never meets a torch tensor. Run as the program (:func:`entry`), they keep
#: torch out of it: tvm-ffi imports torch whenever it is installed, a second or more of CPU and
#: hundreds of MB for nothing here (``bench`` and ``compare`` time torch SDPA beside ours).
TORCHLESS_COMMANDS = ("build", "run", "tune", "validate", "inspect")


def entry() -> int:
    """The ``tvm-attention`` program (and ``python -m tvm_attention.cli``): :func:`main` in a
    process of its own, without torch for :data:`TORCHLESS_COMMANDS` (``import torch`` raises
    ImportError there, which tvm-ffi expects where torch is absent). :func:`main` called from a
    Python program leaves that program's imports alone."""
    argv = sys.argv[1:]
    if argv and argv[0] in TORCHLESS_COMMANDS:
        sys.modules.setdefault("torch", None)  # type: ignore[arg-type]
    return main(argv)


#: Modules of the full install that the runtime-only install lacks (the compiler and the tuner's).
COMPILER_MODULES = ("tvm", "xgboost", "psutil", "cloudpickle", "tornado")


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Each option's default in its help (where it has one worth saying and its text does not
    already say it); descriptions keep their line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        d = action.default
        if (not action.option_strings or "default" in text or d is None or d is False or d == []
                or d is argparse.SUPPRESS):
            return text
        shown = " ".join(str(x) for x in d) if isinstance(d, (list, tuple)) else str(d)
        return f"{text} (default: {shown.replace('%', '%%')})"


class _Parser(argparse.ArgumentParser):
    """argparse with a "did you mean" for a mistyped flag, command or choice (what Python 3.14's
    ``suggest_on_error`` does, for every Python we support) and the help formatter above."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}{self.suggestion(message)}\n")

    def suggestion(self, message: str) -> str:
        import difflib

        m = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if m:
            close = difflib.get_close_matches(m.group(1), re.findall(r"'([^']*)'", m.group(2)), n=1, cutoff=0.5)
            return f"; did you mean {close[0]!r}?" if close else ""
        m = re.search(r"unrecognized arguments: (.*)", message)
        if not m:
            return ""
        flags = [o for action in self._actions for o in action.option_strings if o.startswith("--")]
        hints = []
        for token in m.group(1).split():
            name = token.split("=")[0]
            close = difflib.get_close_matches(name, flags, n=1, cutoff=0.6) if name.startswith("-") else []
            if close:
                hints.append((close[0], name))
        if len(hints) == 1:
            return f"; did you mean {hints[0][0]}?"
        return "; did you mean " + ", ".join(f"{c} (for {n})" for c, n in hints) + "?" if hints else ""


def version_line() -> str:
    """``--version``: ours and the TVM pair it runs with (from the installed distributions, so it
    works without the compiler)."""
    from importlib import metadata

    from . import __version__  # the package's own version, read only for --version

    def installed(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    return (f"tvm-attention {__version__} (apache-tvm {installed('apache-tvm')}, apache-tvm-ffi "
            f"{installed('apache-tvm-ffi')}, Python {sys.version.split()[0]})")


DESCRIPTION = """Build, audit, validate, export and run fused attention kernels, O = softmax(Q·Kᵀ·scale + mask)·V,
generated with Apache TVM for this CPU (or offline for CUDA).

Start with: tvm-attention run (the main job, on a default spec). Every command and flag: docs/cli.md."""

RUN_DESCRIPTION = """The main job: build the default spec (float32, B=1, H=8, Sq=Skv=1024, D=64, not causal) for this
CPU, or the spec the flags give; audit its lowered IR for fusion; validate it against the float64 NumPy
reference; time it; and export it to artifacts/<schedule>_<spec>/ (--out to choose). Takes every build
flag, each with a default (below). The target must be one this machine can run: llvm (the default, this
CPU) or a JSON llvm target whose CPU features this host has."""

BUILD_DESCRIPTION = f"""Build one kernel, audit it, validate it and export it to --out (a .so, its manifest and the
lowered IR). --heads, --head-dim and --out are required, and with the default layout (bhsd) also --batch
and --seq-q; {PER_CALL_LAYOUTS} take batch and lengths at call time. A tuning log's best record is
used when one exists for the spec and target (docs/cli.md)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (``sys.argv[1:]`` by default) parsed: its command's function is ``func``."""
    parser = build_parser()
    args = _join_negative_values(sys.argv[1:] if argv is None else argv)
    a, extra = parser.parse_known_args(args)
    if extra:  # name the command's flags (argparse would print the top-level usage)
        parser.commands[a.command].error(f"unrecognized arguments: {' '.join(extra)}")
    return a


def _add_tune_parser(sub) -> None:
    """``tune``'s parser: the spec, the search and measuring elsewhere."""
    p = sub.add_parser("tune", help="MetaSchedule search (XGBoost cost model); resumable JSON database",
                       description="Search the schedule space of one spec with MetaSchedule and record every "
                                   "measured trial in a resumable JSON log; `build` and `run` then use its best "
                                   "record. Ctrl-C keeps what was measured (docs/tuning.md).")
    _add_spec_flags(p)
    g = p.add_argument_group("search")
    g.add_argument("--target", default="llvm", help="'llvm' (this CPU, default), 'cuda', or a JSON target")
    g.add_argument("--arch", default=None, help="CUDA architecture for --target cuda (default: the local GPU's)")
    g.add_argument("--schedule", default="fused", choices=["fused", "materialized", "rowcache", "fused_hopper"],
                   action=_Given, help="the schedule family whose space is searched (fused_hopper: CUDA sm_90)")
    g.add_argument("--trials", type=int, default=64, action=_Given,
                   help="total measured trials in the log (resume counts them)")
    g.add_argument("--work-dir", default=None,
                   help="tuning log folder (default: <cache>/tuning_logs/<target>/<spec>/, where <cache> is "
                        "$TVM_ATTENTION_CACHE_DIR, else $XDG_CACHE_HOME/tvm-attention, else ~/.cache/tvm-attention); "
                        "one tune at a time per folder")
    g.add_argument("--per-round", type=int, default=8, action=_Given, help="candidates measured per round")
    g.add_argument("--search", default="xgb", choices=["xgb", "random"], action=_Given,
                   help="xgb: evolutionary search ranked by the XGBoost cost model (default); random: "
                        "candidates sampled at random from the same spaces (the baseline)")
    g.add_argument("--warm-start", default=None, metavar="DIR",
                   help="train the cost model first on another spec's tuning log (same target)")
    g.add_argument("--seed", type=int, default=0, action=_Given,
                   help="seed of the search (and of the validation inputs)")
    g.add_argument("--threads", type=int, default=None, help="runtime threads when measuring (default: all cores)")
    g.add_argument("--backward", action="store_true",
                   help="search the backward's knobs instead (docs/backward.md): each point measured once; the "
                        "forward search's flags (--trials, --search, --per-round, --seed, --schedule, --threads, "
                        "--warm-start, measuring elsewhere) are refused with it")
    g = p.add_argument_group("measuring elsewhere (docs/tuning.md)")
    g.add_argument("--rpc-tracker", default=None, metavar="HOST:PORT",
                   help="measure on the devices registered with this RPC tracker (builds stay local)")
    g.add_argument("--rpc-key", default=None, help="device key registered with the tracker")
    g.add_argument("--rpc-workers", type=int, default=None,
                   help="measurements in flight at once (default: one per registered server)")
    g.add_argument("--runner", default=None, metavar="dir:PATH",
                   help="measure on a device reachable only by files: build the next candidates (--trials minus "
                        "the log's records) into the payload PATH and stop; run PATH/run.sh there, bring its "
                        "timings.json back into PATH, then rerun with --import-timings PATH (docs/tuning.md)")
    g.add_argument("--import-timings", default=None, metavar="PATH",
                   help="commit the timings.json of the payload PATH (written by --runner dir:PATH) to the log")
    g.add_argument("--wheel", action="store_true", help="--runner dir: also carry tvm-ffi's cp312 wheel (no package index)")
    p.set_defaults(func=cmd_tune, given=())


def build_parser() -> "_Parser":
    """The whole command line; ``.commands`` maps each command to its parser."""
    parser = _Parser(prog="tvm-attention", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=version_line(),
                        help="print the versions of tvm-attention, apache-tvm and apache-tvm-ffi, and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("build", help="build, audit, validate and export one kernel", description=BUILD_DESCRIPTION,
                       usage="%(prog)s [--layout L] --batch B --seq-q SQ --heads H --head-dim D --out DIR [options]\n"
                             f"       ({PER_CALL_LAYOUTS} take batch and lengths at call time: there "
                             "--batch and --seq-q are optional)")
    _add_spec_flags(p)
    _add_build_flags(p)
    p.add_argument("--out", required=True, help="artifact directory to write")
    p.set_defaults(func=cmd_build)

    p = sub.add_parser("run", help="the main job: build the default spec on this CPU, audit, validate, time, export",
                       description=RUN_DESCRIPTION,
                       usage="%(prog)s [options]   (every flag optional: the default spec is float32, B=1, H=8, "
                             "S=1024, D=64)")
    _add_spec_flags(p, DEFAULT_SPEC)
    _add_build_flags(p)
    p.add_argument("--out", default=None,
                   help=f"artifact directory (default: {DEFAULT_OUT}/<schedule>_<spec>, with a digest of --knobs "
                        f"when given)")
    p.set_defaults(func=cmd_run)

    _add_tune_parser(sub)

    p = sub.add_parser("bench", help="sweep sequence length for every variant side by side; table, CSV/JSON, plots",
                       description="Time every variant of every point side by side in one process, against the "
                                   "FMA peak and streaming-read bandwidth measured in the same run; write a "
                                   "Markdown table, CSV, JSON and plots to --out (docs/benchmarks.md). --decode, "
                                   "--halfprec, --serving, --variant-costs and --loader run other benchmarks.")
    p.add_argument("--seq", type=_length, nargs="+", default=[256, 512, 1024, 2048, 4096, 8192, 16384],
                   action=_Given, help="sequence lengths (Sq = Skv) of the sweep, and of --backward when given")
    p.add_argument("--head-dim", type=int, nargs="+", default=[64, 128], help="head dimensions of the sweep")
    p.add_argument("--dtype", nargs="+", default=["float32"], choices=["float32", "bfloat16", "float16"],
                   help="input/output dtypes of the sweep (torch SDPA runs in the same dtype)")
    p.add_argument("--causal", choices=["both", "yes", "no"], default="both",
                   help="causal points, non-causal points, or both")
    p.add_argument("--heads", type=int, default=8, help="heads of every point (batch 1 in the length sweep)")
    p.add_argument("--tokens", type=int, default=16384, help="constant-token mode: batch = TOKENS / S")
    p.add_argument("--no-tokens", action="store_true", help="skip the constant-token mode")
    p.add_argument("--variants", nargs="+", default=None,
                   choices=["fused", "fused-tuned", "fused-dyn", "materialized", "rowcache", "numpy", "torch"],
                   help="what to time at each point (default: fused fused-tuned materialized numpy torch); "
                        "fused-dyn: the fused hand schedule with batch, seq_q, seq_kv symbolic, timed at each point")
    p.add_argument("--max-materialized", type=int, default=None, metavar="S",
                   help="skip materialized and NumPy past S×S (they allocate the score matrix)")
    p.add_argument("--memory-scaling", action="store_true",
                   help="also run the fused kernel at S=32768 and 65536 (H=1, D=64)")
    p.add_argument("--tiny", action="store_true", help="two short lengths, fused vs materialized (CI)")
    p.add_argument("--decode", action="store_true",
                   help="decode points instead: one new token per sequence against a KV cache (kvcache and paged "
                        "layouts, GQA 32:8 and MHA, D 128/64), GB/s of K/V read, fraction of the streaming-read "
                        "bandwidth measured in the same run, torch SDPA (enable_gqa) side by side")
    p.add_argument("--decode-batch", type=int, nargs="+", default=None, help="--decode: batches (default 1 4 16)")
    p.add_argument("--halfprec", action="store_true",
                   help="half-precision prefill instead: bf16 (AVX512-BF16 dot products), bf16 with fp32 products, "
                        "fp16 and fp32 against torch SDPA fp32/bf16 at S=4096, H=8, D 64/128, with the FMA and "
                        "bf16 dot-product peaks of this CPU")
    p.add_argument("--mla", action="store_true",
                   help="MLA instead: DeepSeek-V3's latent-attention decode (H=128, latent 576, V 512; bf16 and fp32, "
                        "batch 4 and 16 × 4k) against the FMA and bf16 dot-product peaks, torch SDPA and llama.cpp, "
                        "and a Dqk 192 / Dv 128 prefill against a D=192 build")
    p.add_argument("--masks", action="store_true", help="custom masks, tree verify, the cascade (docs/benchmarks.md)")
    p.add_argument("--backward", action="store_true",
                   help="forward + backward against torch SDPA's (docs/benchmarks.md); --seq: its lengths")
    kv8 = ["float8_e4m3fn", "float8_e5m2", "int8", "int8_qk8"]
    p.add_argument("--decode-dtype", nargs="+", default=None,
                   choices=["float32", "bfloat16", "float16"] + kv8 + [f"{d}_{g}" for d in kv8 for g in ("token", "group")],
                   help="--decode: cache dtypes, each point measured in each (default float32); an 8-bit one "
                        "with bfloat16 q and o; int8_qk8: int8 with --qk-int8; _token, _group: with per-token or "
                        "per-group scales (--kv-scale)")
    p.add_argument("--decode-cache", type=int, nargs="+", default=None,
                   help="--decode: cache lengths (default 1024 4096 16384 32768)")
    from .bench.modes import add_flags  # the standard library only: parsing loads no benchmark
    add_flags(p)
    p.add_argument("--repeat", type=int, default=3, help="timed repeats per point (the median is reported)")
    p.add_argument("--threads", type=int, default=None, help="runtime threads (default: all cores)")
    p.add_argument("--out", default="bench_out", help="output folder")
    p.add_argument("--no-plots", action="store_true", help="skip the PNGs (no matplotlib needed)")
    p.set_defaults(func=cmd_bench, given=())

    p = sub.add_parser("compare", help="several schedules of one spec side by side",
                       description="Build several schedules of one spec and time them side by side in this "
                                   "process (docs/benchmarks.md).")
    _add_spec_flags(p)
    p.add_argument("schedules", nargs="+",
                   help='fused, materialized, rowcache, fused-tuned, fused-dyn (batch, seq_q, seq_kv symbolic; '
                        'next to fused the ratio static/dynamic time is printed), or NAME:{"knob": value}')
    p.add_argument("--repeat", type=int, default=5, help="timed repeats per schedule (the median is reported)")
    p.add_argument("--threads", type=int, default=None, help="runtime threads (default: all cores)")
    p.add_argument("--plot", default=None, help="write a bar chart PNG here")
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("validate", help="rerun an artifact on fresh random inputs vs the NumPy reference",
                       description="Load an exported artifact (checking its library against the manifest) and "
                                   "compare it on fresh random inputs with the float64 NumPy reference; exit 1 "
                                   "when it is wrong.")
    p.add_argument("dir", help="the artifact folder (what build, run or --out wrote)")
    p.add_argument("--seed", type=int, default=1, help="seed of the random inputs (the build validated with 0)")
    p.add_argument("--threads", type=int, default=None, help="runtime threads (default: all cores)")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("inspect", help="print an artifact's manifest summary and audit",
                       description="Print an artifact's spec, arguments, target, schedule, tuning log, audit "
                                   "verdict and validation, and check its library against the manifest.")
    p.add_argument("dir", help="the artifact folder")
    p.set_defaults(func=cmd_inspect)

    parser.commands = dict(sub.choices)
    return parser


if __name__ == "__main__":
    sys.exit(entry())
