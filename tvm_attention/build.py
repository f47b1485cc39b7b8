"""The one build path every room uses: spec → PrimFunc → schedule → lowering → audit → codegen."""
from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import weakref
from typing import Any

import tvm
import tvm_ffi
from tvm import s_tir
from tvm.target import Target

from . import build_cache
from .audit import AuditReport, audit, list_allocations, probe_spec
from .cuda_tools import NvccNotFound, kernel_source, ptxas_report
from .lowering import ArgBounds, LoweredModule, codegen, lower_final
from .layouts import SEQUENCE_DIMS
from .schedules import check, get_schedule
from .schedules._knobs import KnobError
from .spec import ENTRY, MAX_SEQ_LEN, AttentionSpec
from .target import (check_target_runnable, cpu_features, foreign_arch, is_cuda, library_compiler, resolve_target,
                     vector_lanes)
from .task_mods import tuning_spec
from .workloads import WORKLOADS, amx
from .workloads.index_checks import with_device_index_checks, with_index_checks


@dataclasses.dataclass
class BuiltKernel:
    """A compiled attention kernel with everything needed to audit, run and export it."""

    spec: AttentionSpec
    schedule: str  # "fused" | "materialized"
    source: str  # "hand" (knobs) or "tuned" (a MetaSchedule trace)
    knobs: Any  # the family's knob dataclass (hand) or None
    target: Target
    lowered: LoweredModule
    module: tvm.runtime.Module
    audit: AuditReport
    entry: str = ENTRY
    trace: str | None = None
    log_dir: str | None = None  # the tuning log a tuned build came from
    record_secs: list[float] | None = None  # its measured run times there
    resources: dict[str, Any] | None = None  # CUDA: ptxas report (see cuda_tools.ptxas_report)
    selection: dict[str, Any] | None = None  # tuned vs hand timed side by side at build time
    #: the tuning logs looked in when none had a usable record (the hand schedule was built)
    logs_searched: list[str] | None = None
    #: the build cache's entry this build was loaded from (None: built here; ``build_cache``)
    cache_entry: str | None = None
    _library: tuple[str, Any] | None = dataclasses.field(default=None, repr=False, compare=False)
    _data_alignment: int | None = dataclasses.field(default=None, repr=False, compare=False)


    def schedule_info(self) -> dict[str, Any]:
        info: dict[str, Any] = {"name": self.schedule, "source": self.source}
        if self.knobs is not None:
            info["family"] = type(self.knobs).__name__
            info["knobs"] = self.knobs.to_dict()
        if self.trace is not None:
            info["trace"] = self.trace
        if self.log_dir is not None:
            info["log_dir"] = self.log_dir
            info["tuned_run_secs"] = self.record_secs
        if self.selection is not None:
            info["selection"] = self.selection
        if self.logs_searched is not None:
            info["logs_searched"] = self.logs_searched
        return info

    @property
    def data_alignment(self) -> int:
        """Byte alignment the kernel needs of every argument's data: what its PrimFunc declared
        (``attn.data_alignment``: 16 for the CPU kernels, ``spec.DATA_ALIGNMENT``), else TVM's
        default of 64 (the CUDA kernels)."""
        if self._data_alignment is not None:  # a cached build's, recorded (its IR stays unparsed)
            return self._data_alignment
        for fn in self.lowered.host.functions.values():
            if fn.attrs is not None and "attn.data_alignment" in fn.attrs:
                return int(fn.attrs["attn.data_alignment"])
        return 64

    @property
    def cpu_features(self) -> list[str]:
        """ISA features the generated CPU code may use (the manifest's ``cpu_features``)."""
        return cpu_features(self.target)

    def check_runnable(self) -> None:
        """Raise :class:`~tvm_attention.hostcpu.HostCPUError` when this build's code cannot run
        on this host (built for a CPU with features this one lacks): never SIGILL."""
        check_target_runnable(self.target, f"{self.spec.short_name()} [{self.schedule}] built for "
                                           f"mcpu={self.target.attrs.get('mcpu', 'generic')}")

    @property
    def library(self) -> str | None:
        """The shared library of a CPU build: written once (to a folder of its own, removed with
        the build), then what it is called through, timed through and exported (copied). LLVM
        turns the module into machine code either way, for its JIT or for the library; doing it
        once saved about 5 s per exported build (B1 H2 S128 D96: JIT 5.4 s, library 5.4 s), and
        validation then runs the very file that ships. None for CUDA (the module as built)."""
        if is_cuda(self.target) or foreign_arch(self.target):  # another architecture's code: never loaded here
            return None
        if self._library is None:
            folder = tempfile.mkdtemp(prefix="tvm-attention-lib-")
            weakref.finalize(self, shutil.rmtree, folder, True)
            path = os.path.join(folder, "attention.so")
            self.module.export_library(path)
            self._library = (path, tvm.runtime.load_module(path))
        return self._library[0]

    def export_library(self, path: str) -> None:
        """Write the build's shared library to ``path``: a copy of :attr:`library` when a call
        has made it, else written anew (a build never run here, e.g. cross-compiled for another
        CPU, is never loaded)."""
        if self._library is not None:
            shutil.copy2(self._library[0], path)
        else:  # an aarch64 build on another host: linked by the cross toolchain
            compiler = library_compiler(self.target)
            if compiler is None:
                self.module.export_library(path)
            else:
                self.module.export_library(path, fcompile=compiler)

    @property
    def runtime_module(self) -> tvm.runtime.Module:
        """The module calls and timings go through: the loaded :attr:`library` (CPU), else the
        module as built."""
        return self.module if self.library is None else self._library[1]

    @property
    def function(self):
        """The entry function, ready to call on this host (checked: see ``check_runnable``)."""
        self.check_runnable()
        return self.runtime_module[self.entry]

    def run(self, q, k, v, o) -> None:
        """Call the kernel on TVM tensors (or 64-byte-aligned NumPy arrays): writes ``o``."""
        self.function(q, k, v, o)


def build_kernel(
    spec: AttentionSpec,
    schedule: str = "fused",
    target: str | Target = "llvm",
    knobs: Any = None,
    cache: bool = False,
) -> BuiltKernel:
    """Build ``spec`` with the hand schedule ``schedule`` (default knobs: the target preset).

    Steps: PrimFunc from the workload registry → schedule by name → final lowering → audit →
    codegen of that same lowered IR. ``cache``: load the build from the build cache when it holds
    it, else build and store it there (``build_cache``: CPU targets this host runs).
    """
    target = resolve_target(target) if not isinstance(target, Target) else target
    refuse_device_checks(spec, target)  # before the schedule: a named error, at once
    family = get_schedule(schedule, target)
    knobs = resolve_knobs(family, spec, target, knobs)
    check(family, knobs, spec, target)

    def make() -> BuiltKernel:
        mod = _schedule_module(family, spec, knobs, target)
        # A symbolic build's IR shows what grows with a length: no probe needed.
        probe = None if spec.dynamic else (lambda: _probe(family, spec, knobs, target))
        return build_from_module(spec, schedule, mod, target, source="hand", knobs=knobs, probe=probe,
                                 probe_at=_probe_at(family, spec, target))

    if not (build_cache.enabled(cache) and build_cache.cacheable(target)):
        return make()
    return cached_build(build_cache.hand_key(spec, schedule, target, knobs), spec, schedule, target, make)


def cached_build(key: tuple[str, dict], spec: AttentionSpec, schedule: str, target: Target, make) -> BuiltKernel:
    """The build of ``key`` (``build_cache.hand_key``/``tuned_key``) from the build cache, else
    ``make()``'s, stored there. A hit runs the stored library and keeps the stored audit, knobs
    and lowered IR (parsed when first read)."""
    hit = build_cache.lookup(key[0], target, spec)
    if hit is not None:
        m = hit.meta
        built = BuiltKernel(spec, schedule, m["source"], m["knobs"], target, hit.lowered, hit.module, m["audit"],
                            trace=m["trace"], cache_entry=str(hit.entry))
        built._library, built._data_alignment = (str(hit.library), hit.module), m["data_alignment"]
        build_cache.adopt(hit, built)
        return built
    built = make()
    build_cache.store(key[0], key[1], built.library, built.lowered,
                      {"source": built.source, "knobs": built.knobs, "audit": built.audit, "trace": built.trace,
                       "data_alignment": built.data_alignment})
    return built


def resolve_knobs(family, spec: AttentionSpec, target: Target, knobs: Any):
    """``knobs`` as the family's dataclass: None → the target preset; a dict → overrides on top
    of the preset; anything else is an error naming what was passed."""
    preset = family.preset(spec, target)
    if knobs is None:
        return preset
    if isinstance(knobs, dict):
        # a family whose preset depends on a knob the overrides name (the fused CPU family's
        # product form: tiles of 128 rows for AMX, 32 for FMAs) starts from that form's preset
        for_form = getattr(family, "preset_for_overrides", None)
        if for_form is not None:
            preset = for_form(spec, target, knobs)
        return type(preset).from_dict({**preset.to_dict(), **knobs})
    if isinstance(knobs, type(preset)):
        return knobs
    raise KnobError(
        f"knobs must be a JSON object of knob overrides such as {{\"block_n\": 128}}, got "
        f"{type(knobs).__name__} {knobs!r}"
    )


def _schedule_module(family, spec: AttentionSpec, knobs: Any, target: Target) -> tvm.IRModule:
    sch = s_tir.Schedule(family.workload(spec, knobs))
    with target:
        sch = family.apply(sch, knobs, spec)
    return sch.mod


def _probe_at(family, spec: AttentionSpec, target: Target) -> AttentionSpec:
    """Where the audit's probe lowers the schedule (a static decode kernel keeps its seq_q)."""
    return probe_spec(spec, keep_seq_q=not spec.dynamic and family.is_static_decode(spec, target))


def _probe(family, spec: AttentionSpec, knobs: Any, target: Target):
    """Allocations of the same schedule lowered at ``probe_spec(spec)`` (the audit's growth
    rule), or a string saying why there are none.

    No ``family.check`` here: the probe is only lowered, never run, and a limit that refuses the
    doubled length (rowcache's row bytes) is exactly the growth the probe must see."""
    pspec = _probe_at(family, spec, target)
    try:
        return list_allocations(lower_final(with_checks(_schedule_module(family, pspec, knobs, target), pspec, target),
                                            target))
    # The schedule not fitting the other lengths (a knob's limit, a length past int32 indexing:
    # ValueError; TVM's scheduling and lowering errors: RuntimeError) only means "no probe", and the
    # audit says so. Anything else (TypeError, AttributeError...) is a bug of a generator: it raises.
    except (KnobError, ValueError, RuntimeError) as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def build_from_module(
    spec: AttentionSpec,
    schedule: str,
    mod: tvm.IRModule,
    target: Target,
    source: str,
    knobs: Any = None,
    trace: str | None = None,
    probe: Any = None,
    probe_at: AttentionSpec | None = None,
) -> BuiltKernel:
    """Lower, audit and compile an already scheduled module.

    ``probe``: a callable returning the allocations of the same schedule at other lengths (see
    ``audit``), or None when there is no way to rebuild the schedule there.
    """
    func = mod["main"]
    workload = str(func.attrs["attn.workload"]) if func.attrs is not None and "attn.workload" in func.attrs else schedule
    mod = with_checks(mod, spec, target)
    lowered = lower_final(mod, target, arg_bounds(spec))
    probe_allocs = probe() if probe is not None else "the schedule has no knobs to rebuild it at other lengths"
    report = audit(lowered, spec, WORKLOADS[workload][1], probe=probe_allocs, probe_at=probe_at)
    module = codegen(lowered)
    module.import_module(_spec_module(spec, target))
    built = BuiltKernel(spec, schedule, source, knobs, target, lowered, module, report, trace=trace)
    if target.kind.name == "cuda":
        built.resources = cuda_resources(built)
    return built


def arg_bounds(spec: AttentionSpec) -> list[ArgBounds]:
    """What the exported function checks of each argument's shape, as the caller passes it
    (``lowering.with_shape_bounds``): its name in the layout's call order, every dim and the
    element count within int32, a sequence's rows or keys (``layouts.SEQUENCE_DIMS``) at most
    ``MAX_SEQ_LEN``, and each compiled-in dim its value."""
    why = f"the longest sequence a kernel takes is {MAX_SEQ_LEN} rows or keys"
    lay = spec.layout_info
    return [ArgBounds(a.name, {i: MAX_SEQ_LEN for i, d in enumerate(a.dims) if d in SEQUENCE_DIMS}, why,
                      tuple(info["shape"]))
            for a, info in zip(lay.all_args(spec), lay.arg_specs(spec))]


def refuse_device_checks(spec: AttentionSpec, target: Target) -> None:
    """``spec.device_checks`` is a CUDA build option: a ValueError naming it on any other target
    (CPU kernels always check their index arrays on the host, and can raise)."""
    if spec.device_checks and target.kind.name != "cuda":
        raise ValueError(f"device_checks: {spec.short_name()} is built for {target.kind.name} (a CPU), whose kernels "
                         "always check their index arrays on the host; the option is for CUDA builds (--target cuda)")


def with_checks(mod: tvm.IRModule, spec: AttentionSpec, target: Target) -> tvm.IRModule:
    """The index checks of ``spec``'s build on ``target``: host asserts on the CPU (always); on
    CUDA, with ``spec.device_checks``, the device check kernel and its ``index_error`` output
    (device code cannot raise: without the option CUDA index arrays are trusted, or checked by
    the loader)."""
    refuse_device_checks(spec, target)
    if target.kind.name == "llvm":
        return with_amx_permission(with_index_checks(mod, spec))
    if spec.device_checks:
        return with_device_index_checks(mod, spec)
    return mod


def with_amx_permission(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` whose ``main``, when its products run on AMX tiles (``attn.dot_bf16`` 2, or the
    decode nests' ``attn.decode_dot`` 6), first asks Linux for the tile state
    (``workloads.amx.permit_prologue``: once per process, before any parallel loop) and raises a
    ValueError if the kernel refuses: a C++ caller needs nothing, and a refusal is an error,
    never the SIGILL of a tile instruction without it."""
    func = mod["main"]
    attrs = func.attrs or {}
    if int(attrs.get("attn.dot_bf16", 0)) != amx.REAL and int(attrs.get("attn.decode_dot", 0)) != amx.DECODE_REAL:
        return mod
    # only where a tile runs (a static decode step keeps its decode nest alone: no AMX, and no
    # import of the AMX functions the prologue would call)
    tiles = []
    tvm_ffi.structural_walk(func.body, [(tvm.s_tir.SBlock, lambda b: tiles.append(b.name_hint.startswith("tile_config")))])
    if not any(tiles):
        return mod
    stmt = amx.permit_prologue("AMX: Linux refused this process the tile state (arch_prctl ARCH_REQ_XCOMP_PERM "
                               "for XTILEDATA): the CPU or kernel has no AMX, or a seccomp policy forbids it")
    out = tvm.IRModule(dict(mod.functions))
    out["main"] = func.with_body(tvm.tirx.SeqStmt([stmt, func.body]))
    return out


def _spec_module(spec: AttentionSpec, target: Target) -> tvm.runtime.Module:
    """A host module holding ``attention_spec_hash() -> int64``, which returns
    ``spec.fingerprint()``: the library describes itself, so a loader can refuse a manifest that
    says otherwise. Compiled apart and imported (``export_library`` links it into the same
    ``.so``): lowered in one IRModule with the kernel, it made the kernel's codegen lose its
    parallel loops' speed (2048² causal prefill: 55 ms against 24)."""
    body = tvm.tirx.Return(tvm.tirx.IntImm("int64", spec.fingerprint()))
    func = tvm.tirx.PrimFunc([], body, ret_type=tvm.ir.PrimType("int64"))
    func = func.with_attr("global_symbol", spec.SPEC_FUNCTION)
    host = Target(target.host) if target.kind.name == "cuda" else target
    return codegen(lower_final(tvm.IRModule({spec.SPEC_FUNCTION: func}), host))


def cuda_resources(built: BuiltKernel) -> dict[str, Any]:
    """ptxas's report for a CUDA build (or why there is none: no nvcc here)."""
    threads = getattr(built.knobs, "threads", None)
    source = kernel_source(built.module)
    # a dynamic shared allocation (buf_dyn_shmem) holds the family's shared tiles
    family = get_schedule(built.schedule, built.target) if "extern __shared__" in source else None
    dynamic = family.shared_bytes(built.knobs, built.spec) if family is not None else 0
    try:
        return ptxas_report(source, str(built.target.attrs["arch"]), threads, dynamic)
    except NvccNotFound as e:
        return {"unavailable": str(e)}


def knobs_of(family, sch: s_tir.Schedule, spec: AttentionSpec, target: Target):
    """The knobs a scheduled tile kernel of ``family`` chose (its ``attn.*`` annotations and
    attrs); what a trace leaves out (a decode-only kernel's main-nest knobs) is the preset's."""
    return family.knobs_of(sch, vector_lanes(target), family.preset(spec, target))  # float32 lanes: CPU kernels compute in float32


def build_from_record(spec: AttentionSpec, schedule: str, target: str | Target, workload, record,
                      cache: bool = False) -> BuiltKernel:
    """Replay a tuning record's trace on its workload and build it (``source="tuned"``).

    A symbolic (or varlen) ``spec`` is tuned at its representative static shape (a paged decode
    step: its own kernel specialized there, ``tune.paged``): the trace is replayed there, its
    knobs read back, and the symbolic kernel built with them. ``cache``: as ``build_kernel``'s
    (the key holds the trace and the workload module)."""
    target = resolve_target(target)
    if build_cache.enabled(cache) and build_cache.cacheable(target):
        key = build_cache.tuned_key(spec, schedule, target, workload.mod, record.trace)
        built = cached_build(key, spec, schedule, target, lambda: _build_from_record(spec, schedule, target,
                                                                                     workload, record))
        built.record_secs = [float(x) for x in record.run_secs]
        return built
    return _build_from_record(spec, schedule, target, workload, record)


def _build_from_record(spec: AttentionSpec, schedule: str, target: Target, workload, record) -> BuiltKernel:
    sch = s_tir.Schedule(workload.mod)
    record.trace.apply_to_schedule(sch, remove_postproc=False)
    family = get_schedule(schedule, target)
    tuned_at = tuning_spec(spec, target, schedule)
    knobs = knobs_of(family, sch, tuned_at, target)
    if knobs is not None:
        knobs = family.for_layout(knobs, spec, target, tuned_at)
    if spec.dynamic:
        if knobs is None:
            raise ValueError(f"a tuned {schedule} trace cannot be replayed on a symbolic kernel (no knobs to read)")
        check(family, knobs, spec, target)
        built = build_from_module(spec, schedule, _schedule_module(family, spec, knobs, target), target,
                                  source="tuned", knobs=knobs, trace=str(record.trace))
        built.record_secs = [float(x) for x in record.run_secs]
        return built
    # A tuned fused/rowcache trace is a point of the hand schedule's space: its knobs rebuild it
    # at the probe's lengths. Other traces (MetaSchedule's own spaces) cannot be replayed there.
    probe = (lambda: _probe(family, spec, knobs, target)) if knobs is not None else None
    built = build_from_module(spec, schedule, sch.mod, target, source="tuned", knobs=knobs,
                              trace=str(record.trace), probe=probe, probe_at=_probe_at(family, spec, target))
    built.record_secs = [float(x) for x in record.run_secs]
    return built
