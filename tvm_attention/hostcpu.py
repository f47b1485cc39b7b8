"""What this host's CPU can execute, without the compiler (the serving path imports this too).

A library compiled for ``mcpu=znver4`` holds AVX-512 instructions; run on a Zen 3 (AVX2 only) it
dies with SIGILL, which no Python code can catch. So every place that would execute code checks
the target's ISA features against the host's first, and an artifact records the features its
code needs (the manifest's ``cpu_features``) so that ``load`` can check them with tvm-ffi alone.

Features are named as LLVM names them (``avx512f``, ``avx512bf16``, ``fma``...). Only the
instruction-set extensions that code generation can emit are compared (:data:`ISA_FEATURES`);
LLVM's tuning flags (``fast-scalar-fsqrt``...) and system instructions (``rdpru``, ``pku``...,
which a VM may hide) are not.

``TVM_ATTENTION_HOST_CPU`` (e.g. ``znver3``) makes this process behave as that CPU would: the
default target names it, and the host is taken to have only its features (intersected with the
real ones). The test suite runs this way to check what an AVX2 host does, on any host.
"""
from __future__ import annotations

import functools
import os
import platform
from typing import Iterable

HOST_CPU_ENV = "TVM_ATTENTION_HOST_CPU"

#: LLVM feature name -> the flag Linux's /proc/cpuinfo shows for it: the ISA extensions that
#: generated code may use. A target feature outside this table is not checked.
ISA_FEATURES = {
    "sse": "sse", "sse2": "sse2", "sse3": "pni", "ssse3": "ssse3", "sse4.1": "sse4_1",
    "sse4.2": "sse4_2", "sse4a": "sse4a", "avx": "avx", "avx2": "avx2", "fma": "fma",
    "f16c": "f16c", "bmi": "bmi1", "bmi2": "bmi2", "lzcnt": "abm", "popcnt": "popcnt",
    "movbe": "movbe", "adx": "adx", "aes": "aes", "pclmul": "pclmulqdq", "sha": "sha_ni",
    "cx16": "cx16", "gfni": "gfni", "vaes": "vaes", "vpclmulqdq": "vpclmulqdq",
    "avxvnni": "avx_vnni", "avx512f": "avx512f", "avx512bw": "avx512bw", "avx512cd": "avx512cd",
    "avx512dq": "avx512dq", "avx512vl": "avx512vl", "avx512bf16": "avx512_bf16",
    "avx512vnni": "avx512_vnni", "avx512ifma": "avx512ifma", "avx512vbmi": "avx512vbmi",
    "avx512vbmi2": "avx512_vbmi2", "avx512bitalg": "avx512_bitalg",
    "avx512vpopcntdq": "avx512_vpopcntdq", "avx512vp2intersect": "avx512_vp2intersect",
    "avx512fp16": "avx512_fp16", "amx-tile": "amx_tile", "amx-bf16": "amx_bf16", "amx-int8": "amx_int8",
    # Arm (aarch64: /proc/cpuinfo's "Features"); "aarch64" names the architecture itself, so that
    # an x86 host (which has none of these) refuses to run an aarch64 build (issue 66)
    "aarch64": "aarch64", "neon": "asimd", "sve": "sve", "sve2": "sve2", "bf16": "bf16", "i8mm": "i8mm",
    "dotprod": "asimddp", "fullfp16": "asimdhp",
}
#: the architecture pseudo-feature of each machine name an aarch64 host reports (``platform.machine``)
ARM_MACHINES = ("aarch64", "arm64")


#: The checked features of CPU models the override is used with, as LLVM 22 gives them (read
#: with ``tvm.target.codegen.llvm_get_cpu_features``): a serving process, which has no compiler
#: to ask, still behaves as that CPU. Other names need the compiler.
KNOWN_CPUS = {
    "haswell": "avx avx2 bmi bmi2 cx16 f16c fma lzcnt movbe pclmul popcnt sse sse2 sse3 sse4.1 sse4.2 ssse3",
    "x86-64-v3": "avx avx2 bmi bmi2 cx16 f16c fma lzcnt movbe popcnt sse sse2 sse3 sse4.1 sse4.2 ssse3",
    "znver3": "adx aes avx avx2 bmi bmi2 cx16 f16c fma lzcnt movbe pclmul popcnt sha sse sse2 sse3 sse4.1 sse4.2 "
              "sse4a ssse3 vaes vpclmulqdq",
    "znver4": "adx aes avx avx2 avx512bf16 avx512bitalg avx512bw avx512cd avx512dq avx512f avx512ifma avx512vbmi "
              "avx512vbmi2 avx512vl avx512vnni avx512vpopcntdq bmi bmi2 cx16 f16c fma gfni lzcnt movbe pclmul popcnt "
              "sha sse sse2 sse3 sse4.1 sse4.2 sse4a ssse3 vaes vpclmulqdq",
}


class HostCPUError(RuntimeError):
    """Code built for a CPU feature this host lacks would be executed; the message names it."""


def isa_subset(features: Iterable[str]) -> list[str]:
    """The checked ISA features among ``features`` (LLVM names), sorted: what a manifest records."""
    return sorted(f for f in features if f in ISA_FEATURES)


@functools.lru_cache(maxsize=1)
def _cpuinfo_flags() -> frozenset[str] | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags") or line.startswith("Features"):  # x86, aarch64
                    flags = set(line.split(":", 1)[1].split())
                    if platform.machine().lower() in ARM_MACHINES:
                        flags.add("aarch64")
                    return frozenset(flags)
    except OSError:
        pass
    return None


def available_cores() -> int:
    """Cores this process may run on (affinity-aware), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - non-Linux
        return max(1, os.cpu_count() or 1)


def cpu_override() -> str | None:
    """The CPU named by ``TVM_ATTENTION_HOST_CPU``, or None."""
    name = os.environ.get(HOST_CPU_ENV, "").strip()
    return name or None


@functools.lru_cache(maxsize=8)
def _llvm_cpu_features(cpu: str) -> frozenset[str]:
    """The ISA features LLVM gives ``mcpu=cpu`` (needs the compiler)."""
    try:
        import tvm  # only for an override that names a CPU model KNOWN_CPUS lacks
        from tvm.target import Target
    except ImportError:
        raise HostCPUError(f"{HOST_CPU_ENV}={cpu!r}: without apache-tvm only {', '.join(KNOWN_CPUS)} are known") from None

    known = {str(c) for c in tvm.target.codegen.llvm_get_cpu_archlist(Target({"kind": "llvm"}))}
    if cpu not in known:  # LLVM would fall back to "generic" with a warning
        raise HostCPUError(f"{HOST_CPU_ENV}={cpu!r} is not a CPU LLVM knows (e.g. znver3, haswell, znver4)")
    target = Target({"kind": "llvm", "mcpu": cpu})
    return frozenset(str(k) for k in tvm.target.codegen.llvm_get_cpu_features(target))


def host_features() -> frozenset[str]:
    """The ISA features (LLVM names) code may use on this host.

    Read from /proc/cpuinfo (what the CPU, or the VM, really offers); restricted to the features
    of ``TVM_ATTENTION_HOST_CPU`` when that is set. Without /proc/cpuinfo (not Linux) LLVM's
    features of the host CPU model are used (needs the compiler)."""
    flags = _cpuinfo_flags()
    if flags is not None:
        real = frozenset(name for name, flag in ISA_FEATURES.items() if flag in flags)
    else:  # pragma: no cover - non-Linux hosts
        import tvm

        real = _llvm_cpu_features(tvm.target.codegen.llvm_get_system_cpu())
    cpu = cpu_override()
    if cpu is not None:
        model = frozenset(KNOWN_CPUS[cpu].split()) if cpu in KNOWN_CPUS else _llvm_cpu_features(cpu)
        real = real & model
    return real


def extra_features(model: Iterable[str]) -> list[str]:
    """The checked features this host offers beyond ``model``'s (LLVM's features of a CPU model;
    sorted): a VM may name a model older than its CPU (LLVM calls a Sapphire Rapids VM
    ``rocketlake``, which has no AVX512-BF16, AVX512-FP16, AVX-VNNI or AMX)."""
    have = set(model)
    return sorted(f for f in host_features() if f in ISA_FEATURES and f not in have)


def missing_features(required: Iterable[str]) -> list[str]:
    """The checked features of ``required`` that this host lacks (sorted; [] when it can run)."""
    have = host_features()
    return [f for f in isa_subset(required) if f not in have]


def describe_host() -> str:
    cpu = cpu_override()
    return f"this host (as {HOST_CPU_ENV}={cpu})" if cpu else "this host's CPU"


def check_runnable(required: Iterable[str], what: str) -> None:
    """Raise :class:`HostCPUError` naming the missing features when ``what`` (code built for
    ``required``) cannot run here."""
    missing = missing_features(required)
    if missing:
        raise HostCPUError(
            f"{what} needs CPU features {', '.join(missing)}, which {describe_host()} lacks; running it "
            "would kill the process with SIGILL (build for this CPU, or run it on one that has them)"
        )
