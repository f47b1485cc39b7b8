"""Target resolution: from what a user types to a ``tvm.target.Target`` that emits good code.

``"llvm"`` (or ``"cpu"``) means *this* CPU: TVM's bare ``{"kind": "llvm"}`` (and even
``"mcpu": "native"``) emits SSE-only code, so we name the host CPU (e.g. ``znver4``) to get
AVX-512, and record the core count so the parallel runtime is sized for it.
"""
from __future__ import annotations

import json
import numbers
from typing import Any, Mapping

import tvm
from tvm.target import Target

from .hostcpu import (ARM_MACHINES, HostCPUError, _llvm_cpu_features, available_cores,  # noqa: F401
                      check_runnable, cpu_override, extra_features, isa_subset, missing_features)


class TargetError(ValueError):
    """An unknown or malformed target; the message names what was wrong."""


def host_cpu() -> str:
    """The CPU the default target names: ``TVM_ATTENTION_HOST_CPU`` when set (the suite runs as
    an AVX2 host would with ``znver3``), else LLVM's name for this host's CPU."""
    return cpu_override() or tvm.target.codegen.llvm_get_system_cpu()


def _hidden_features(mcpu: str) -> list[str]:
    """ISA features LLVM gives ``mcpu`` that this host does not offer (a VM may report a CPU
    model and hide its AVX-512): the default target turns them off rather than emit them."""
    return missing_features(_llvm_cpu_features(mcpu))


def host_mattr(mcpu: str) -> list[str]:
    """The default target's ``mattr`` for this host's model ``mcpu``: the model's features the
    host lacks turned off (``-f``), and the ISA features the host offers beyond the model turned
    on (``+f``: /proc/cpuinfo's, AMX included), so the code may use what the CPU really has and
    nothing it lacks. Under ``TVM_ATTENTION_HOST_CPU`` the host has the named model's features
    at most: nothing is added."""
    return [f"-{f}" for f in _hidden_features(mcpu)] + [f"+{f}" for f in extra_features(_llvm_cpu_features(mcpu))]


#: Per-architecture CUDA limits we put in the target (MetaSchedule and verify_gpu_code read them).
#: max_shared_memory_per_block is the 48 KiB a kernel gets without opting in to more.
CUDA_ARCHS = {
    "sm_80": {"max_threads_per_block": 1024, "max_shared_memory_per_block": 49152,
              "registers_per_block": 65536, "thread_warp_size": 32},
    "sm_86": {"max_threads_per_block": 1024, "max_shared_memory_per_block": 49152,
              "registers_per_block": 65536, "thread_warp_size": 32},
    "sm_89": {"max_threads_per_block": 1024, "max_shared_memory_per_block": 49152,
              "registers_per_block": 65536, "thread_warp_size": 32},
    "sm_90": {"max_threads_per_block": 1024, "max_shared_memory_per_block": 49152,
              "registers_per_block": 65536, "thread_warp_size": 32},
}
UNSUPPORTED_KINDS = ("nvptx", "rocm", "vulkan", "metal", "opencl", "webgpu")
#: The most cores an LLVM target may name (``num-cores``): more than any CPU has, and small enough
#: for what the count sizes: split-KV's tasks (4 per core) and MetaSchedule's parallel extents (16
#: jobs per core) are C ints, and it names the tuning logs' folder (``<mcpu>-<n>c``). TVM itself
#: takes any int64, 0 and negatives included.
MAX_NUM_CORES = 1 << 16


def _check_num_cores(value: Any, name: str = "num-cores") -> None:
    """Raise :class:`TargetError` unless ``value`` is an int (NumPy's too, not a bool) in ``[1,
    MAX_NUM_CORES]``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 1 <= value <= MAX_NUM_CORES:
        raise TargetError(f"{name} must be an int in [1, {MAX_NUM_CORES}] (the CPU cores the kernel runs on), "
                          f"got {value!r}")


def local_cuda_arch() -> str | None:
    """``sm_XY`` of GPU 0 when this machine has a CUDA device TVM can use, else None."""
    try:
        dev = tvm.cuda(0)
        if not tvm.runtime.enabled("cuda") or not dev.exist:
            return None
        return "sm_" + str(dev.compute_version).replace(".", "")
    except Exception:  # no CUDA runtime at all
        return None


def resolve_target(
    target: str | Mapping[str, Any] | Target = "llvm", num_cores: int | None = None, arch: str | None = None
) -> Target:
    """Resolve ``target`` to a Target.

    Accepted forms: ``"llvm"``/``"cpu"`` (the host CPU), ``"cuda"`` (with ``arch`` such as
    ``"sm_90"``, or the local GPU's), a JSON object string or dict such as ``{"kind": "llvm",
    "mcpu": "znver4"}`` or ``{"kind": "cuda", "arch": "sm_80"}``, or a ``Target``. LLVM targets
    without ``mcpu`` get the host CPU; ``num-cores`` defaults to the cores available to this
    process. CUDA targets get the architecture's limits and the host CPU as host. A ``num-cores``
    (or ``num_cores``) that is not an int in ``[1, MAX_NUM_CORES]`` is a :class:`TargetError`.
    """
    if num_cores is not None:
        _check_num_cores(num_cores, "num_cores")
    if isinstance(target, Target):
        for t in (target, target.host):  # built by the caller: TVM took any int64
            if t is not None and "num-cores" in t.attrs:
                _check_num_cores(int(t.attrs["num-cores"]), f"target {t.kind.name}: num-cores")
        return target
    if isinstance(target, str):
        text = target.strip()
        if text in ("llvm", "cpu", "host"):
            config: dict[str, Any] = {"kind": "llvm"}
        elif text == "cuda":
            config = {"kind": "cuda"}
        elif text.startswith("{"):
            try:
                config = json.loads(text)
            except json.JSONDecodeError as e:
                raise TargetError(f"target {text!r} is not valid JSON: {e}") from None
        elif text in UNSUPPORTED_KINDS:
            raise TargetError(
                f"target {text!r} is recognised but not supported by tvm-attention yet; "
                "supported: llvm (the local CPU), cuda"
            )
        else:
            raise TargetError(
                f"unknown target {text!r}; use 'llvm' (the local CPU), 'cuda' (with --arch), or a JSON "
                'target such as \'{"kind": "llvm", "mcpu": "znver4"}\''
            )
    elif isinstance(target, Mapping):
        config = dict(target)
    else:
        raise TargetError(f"target must be a string, dict or Target, got {type(target).__name__}")
    if not isinstance(config, dict) or "kind" not in config:
        raise TargetError(f"target {config!r} has no 'kind'")
    kind = config["kind"]
    if kind == "cuda":
        if arch is not None:
            config["arch"] = arch
        if "arch" not in config:
            local = local_cuda_arch()
            if local is None:
                raise TargetError(
                    "target cuda: no GPU on this machine to take the architecture from; name it "
                    f"with --arch (one of {', '.join(CUDA_ARCHS)})"
                )
            config["arch"] = local
        if config["arch"] not in CUDA_ARCHS:
            raise TargetError(f"unsupported CUDA arch {config['arch']!r}; supported: {', '.join(CUDA_ARCHS)}")
        for key, value in CUDA_ARCHS[config["arch"]].items():
            config.setdefault(key, value)
        config.setdefault("host", {"kind": "llvm", "mcpu": host_cpu(), "num-cores": num_cores or available_cores()})
        if isinstance(config["host"], Mapping) and "num-cores" in config["host"]:
            _check_num_cores(config["host"]["num-cores"], "target cuda: host's num-cores")
    elif kind == "llvm":
        if arch is not None:
            raise TargetError("--arch applies to cuda targets only")
        if "mcpu" not in config:
            config["mcpu"] = host_cpu()
            mattr = host_mattr(config["mcpu"])
            if mattr:
                config.setdefault("mattr", mattr)
        config.setdefault("num-cores", num_cores or available_cores())
        _check_num_cores(config["num-cores"], "target llvm: num-cores")
    else:
        raise TargetError(
            f"target kind {kind!r} is not supported yet; supported: llvm (the local CPU), cuda"
        )
    try:
        return Target(config)
    except Exception as e:  # TVM raises ValueError/TVMError with the list of valid keys
        raise TargetError(f"invalid target {config!r}: {e}") from None


def is_cuda(target: Target) -> bool:
    return target.kind.name == "cuda"


def vector_lanes(target: Target, dtype: str = "float32") -> int:
    """SIMD lanes for ``dtype`` on an LLVM target: 16 with AVX-512, 8 with AVX2, else 4."""
    bits = tvm.DataType(dtype).bits
    features = target_features(target)
    if "avx512f" in features:
        width = 512
    elif "avx2" in features or "avx" in features:
        width = 256
    else:
        width = 128
    return width // bits


def target_features(target: Target) -> set[str]:
    """The ISA features LLVM enables for ``target`` (e.g. {'avx512f', 'avx2', ...})."""
    return {str(k) for k in tvm.target.codegen.llvm_get_cpu_features(target)}


def cpu_features(target: Target) -> list[str]:
    """The ISA features code built for an LLVM ``target`` may use (sorted; what the manifest's
    ``cpu_features`` records and what the host must have to run it). [] for CUDA targets."""
    if is_cuda(target):
        return []
    return isa_subset(target_features(target) | ({"aarch64"} if is_aarch64(target) else set()))


def is_aarch64(target: Target) -> bool:
    """Whether ``target`` generates aarch64 code (its ``mtriple``): an x86 host neither loads nor
    links it as its own (``cross_compiler``)."""
    return str(target.attrs.get("mtriple", "")).startswith(("aarch64", "arm64"))


def foreign_arch(target: Target) -> bool:
    """Whether ``target``'s code is for another architecture than this host's (aarch64 code on an
    x86 host): built and exported, never loaded or run here."""
    import platform  # the host's machine name: asked only of an aarch64 target

    return is_aarch64(target) and platform.machine().lower() not in ARM_MACHINES


#: the cross toolchain an aarch64 build is linked with on another host (Debian's g++-aarch64-linux-gnu)
AARCH64_CXX = "aarch64-linux-gnu-g++"


def library_compiler(target: Target):
    """``export_library``'s ``fcompile`` for ``target``: None (the host's g++) for code this host
    links as its own; for aarch64 code on another host, the cross toolchain (a ``TargetError``
    naming the package where it is missing)."""
    import shutil

    if not foreign_arch(target):
        return None
    if shutil.which(AARCH64_CXX) is None:
        raise TargetError(f"target {target.attrs.get('mtriple')}: an aarch64 library is linked with {AARCH64_CXX} on "
                          "this host, which has none (Debian: apt-get install g++-aarch64-linux-gnu)")
    from tvm.support import cc

    return cc.cross_compiler(AARCH64_CXX)


def runnable_here(target: Target) -> bool:
    """True when code built for ``target`` can run on this host (CUDA: a GPU is present)."""
    if is_cuda(target):
        return local_cuda_arch() is not None
    return not missing_features(cpu_features(target))


def check_target_runnable(target: Target, what: str = "") -> None:
    """Raise :class:`HostCPUError` when LLVM ``target``'s code would need CPU features this host
    lacks (SIGILL). ``what`` names the thing that would run."""
    if not is_cuda(target):
        mcpu = target.attrs["mcpu"] if "mcpu" in target.attrs else "generic"
        check_runnable(cpu_features(target), what or f"code built for mcpu={mcpu}")


def target_to_json(target: Target) -> dict[str, Any]:
    """A plain JSON-able dict of ``target`` (round-trips through ``Target(dict)``)."""
    return json.loads(str(target))
