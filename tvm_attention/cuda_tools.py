"""Offline CUDA tooling: the generated source, ptxas's resource report, an occupancy estimate.

``tvm.compile`` for CUDA stops at CUDA C source (it is compiled when the module is loaded on a
GPU), so to know registers, spills and shared memory without a GPU we run ``nvcc --fatbin`` on
that source with ptxas in verbose mode, with the flags TVM itself uses at load time
(``-O3 --use_fast_math``, ptxas's ``--register-usage-level=10``). The same run gives the fatbin a
CUDA artifact ships: the report describes the binary that runs.
"""
from __future__ import annotations

import collections
import functools
import os
import re
import shutil
import subprocess
import tempfile
from typing import Any, NamedTuple

from .tvm_internals import ptxas_option_flags

#: Per-SM limits for the occupancy estimate (CUDA programming guide, compute capability table);
#: ``block_shared``: the most shared memory one block may take, dynamic shared memory opted in
#: beyond the 48 KiB of static shared memory (``cudaFuncAttributeMaxDynamicSharedMemorySize``,
#: which TVM's CUDA runtime sets at launch); ``sms``: streaming multiprocessors of the arch's
#: largest data-center part (A100 108, A40 84, L40S 142, H100 SXM and H200 132), what split-KV
#: sizes a decode grid by (:func:`split_tasks_for`).
SM_LIMITS = {
    "sm_80": dict(max_warps=64, max_blocks=32, registers=65536, shared=167936, block_shared=166912, sms=108),
    "sm_86": dict(max_warps=48, max_blocks=16, registers=65536, shared=102400, block_shared=101376, sms=84),
    "sm_89": dict(max_warps=48, max_blocks=24, registers=65536, shared=102400, block_shared=101376, sms=142),
    "sm_90": dict(max_warps=64, max_blocks=32, registers=65536, shared=233472, block_shared=232448, sms=132),
}
#: static shared memory per block: a kernel needing more declares it dynamic (``shared.dyn``)
STATIC_SHARED_BYTES = 48 * 1024


def split_tasks_for(target) -> int:
    """Thread blocks a split-KV decode grid aims for on ``target``: two per SM, as
    FlashAttention-2's ``num_splits_heuristic`` aims (``num_SMs * 2``); an arch not in the table
    counts as an A100's 108 SMs."""
    arch = str(target.attrs.get("arch", ""))
    return 2 * SM_LIMITS.get(arch, SM_LIMITS["sm_80"])["sms"]


def block_shared_limit(target) -> int:
    """The most shared memory a block may take on ``target`` (its arch's opt-in limit; the
    target's static limit for an arch not in the table)."""
    arch = str(target.attrs.get("arch", ""))
    if arch in SM_LIMITS:
        return SM_LIMITS[arch]["block_shared"]
    return int(target.attrs["max_shared_memory_per_block"])


def shared_scope(nbytes: int) -> str:
    """The scope of a kernel's shared tiles: ``shared`` up to the static limit, ``shared.dyn``
    (one dynamic allocation, sized at launch) beyond it."""
    return "shared.dyn" if nbytes > STATIC_SHARED_BYTES else "shared"
REGISTER_ALLOC_UNIT = 256  # registers are allocated per warp in units of 256
SHARED_ALLOC_UNIT = 128
SHARED_PER_BLOCK_RESERVED = 1024  # the runtime reserves 1 KiB of shared memory per block


class NvccNotFound(RuntimeError):
    pass


def find_nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root and os.path.isfile(os.path.join(root, "bin", "nvcc")):
            return os.path.join(root, "bin", "nvcc")
    return None


def kernel_source(module) -> str:
    """The CUDA C source of a built CUDA module (the device module imported by the host one)."""
    for m in module.imports:
        if m.kind == "cuda":
            return m.inspect_source()
    raise ValueError("module has no CUDA device code")


_PATTERNS = {
    "registers": r"Used (\d+) registers",
    "stack_frame_bytes": r"(\d+) bytes stack frame",
    "spill_store_bytes": r"(\d+) bytes spill stores",
    "spill_load_bytes": r"(\d+) bytes spill loads",
    "shared_bytes": r"(\d+) bytes smem",
    "barriers": r"used (\d+) barriers",
}


def nvcc_flags() -> list[str]:
    """The flags TVM's runtime compiles a CUDA module with (``tvm.support.nvcc``, the
    ``TVM_CUDA_COMPILE_MODE=nvcc`` path), so that the report describes the code that runs:
    ``-O3 --use_fast_math`` and ptxas's ``--register-usage-level=10`` (TVM's default; at nvcc's
    own default ptxas capped registers lower and spilled where TVM's build does not)."""
    ptxas = ptxas_option_flags()
    if ptxas is None:  # another TVM: its flags are unknown, keep ptxas verbose at least
        ptxas = ["-v"]
    if "-v" not in ptxas:
        ptxas = ["-v", *ptxas]
    fast = [] if os.environ.get("TVM_CUDA_NVCC_NO_FAST_MATH") else ["--use_fast_math"]
    return ["-O3", *fast, "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
            "-U__CUDA_NO_BFLOAT16_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
            "-U__CUDA_NO_BFLOAT162_OPERATORS__", "-U__CUDA_NO_BFLOAT162_CONVERSIONS__",
            "--expt-relaxed-constexpr", f"--ptxas-options={','.join(ptxas)}"]


#: PTX that only the arch-specific target of its arch assembles (``sm_90a``: the Hopper kernel's
#: warpgroup products and register reallocation)
ARCH_SPECIFIC = ("wgmma.", "setmaxnreg.")


def nvcc_arch(arch: str, source: str) -> str:
    """The arch nvcc compiles ``source`` for: ``arch``, or its arch-specific form (``sm_90`` ->
    ``sm_90a``) where the source uses instructions only that form has. An ``sm_90a`` binary runs on
    sm_90 devices only (H100, H200), which is what ``sm_90`` names for the others as well."""
    if arch == "sm_90" and any(ins in source for ins in ARCH_SPECIFIC):
        return "sm_90a"
    return arch


class _Compiled(NamedTuple):
    """One nvcc run of a kernel source: ptxas's verbose log, the PTX, and the fatbin (SASS + PTX)."""

    log: str
    ptx: str
    fatbin: bytes


#: the last few compiles of this process (``ptxas_report`` at build, ``compile_fatbin`` at export:
#: the same source, compiled once); fatbins are a few hundred KiB
_COMPILED: collections.OrderedDict[tuple, _Compiled] = collections.OrderedDict()
_COMPILED_MAX = 16


def _arch_flags(arch: str) -> list[str]:
    """nvcc's flags for ``arch``: ``-arch=sm_XY`` (SASS and PTX of that arch), or for an
    arch-specific ``sm_XYa`` its SASS and PTX alone (``-arch=sm_90a`` also emits generic
    ``compute_90`` PTX, which ptxas cannot assemble from wgmma or setmaxnreg)."""
    if arch.endswith("a"):
        n = arch[len("sm_"):]
        return [f"-gencode=arch=compute_{n},code=[sm_{n},compute_{n}]"]
    return [f"-arch={arch}"]


def _compile(source: str, arch: str) -> _Compiled:
    """``source`` compiled for ``arch`` by nvcc, once per process for the same source, arch,
    flags and nvcc: a fatbin with ``nvcc_flags()`` (those TVM's runtime JITs with, ptxas's
    verbose report included), its PTX kept. Raises ``NvccNotFound`` without nvcc."""
    import hashlib

    nvcc = find_nvcc()
    if nvcc is None:
        raise NvccNotFound("nvcc not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin)")
    arch = nvcc_arch(arch, source)
    flags = nvcc_flags()
    key = (hashlib.sha256(source.encode()).hexdigest(), arch, tuple(flags), nvcc)
    if key in _COMPILED:
        _COMPILED.move_to_end(key)
        return _COMPILED[key]
    with tempfile.TemporaryDirectory() as tmp:
        cu, out = os.path.join(tmp, "kernel.cu"), os.path.join(tmp, "kernel.fatbin")
        with open(cu, "w") as f:
            f.write(source)
        cmd = [nvcc, "--fatbin", *_arch_flags(arch), *flags, "-w", "--keep", "--keep-dir", tmp, "-o", out, cu]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"nvcc failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        ptx = ""
        for name in sorted(os.listdir(tmp)):
            if name.endswith(".ptx"):
                with open(os.path.join(tmp, name)) as f:
                    ptx += f.read()
        with open(out, "rb") as f:
            done = _Compiled(proc.stderr + proc.stdout, ptx, f.read())
    _COMPILED[key] = done
    while len(_COMPILED) > _COMPILED_MAX:
        _COMPILED.popitem(last=False)
    return done


def ptxas_report(source: str, arch: str, threads_per_block: int | None = None,
                 dynamic_shared: int = 0) -> dict[str, Any]:
    """Compile ``source`` for ``arch`` with nvcc and return ptxas's numbers (and occupancy, with
    ``dynamic_shared`` bytes of dynamic shared memory, which ptxas does not see, added to its
    static ``shared_bytes``). The binary it describes is the one :func:`compile_fatbin` returns
    for the same source (one nvcc run serves both)."""
    try:
        compiled = _compile(source, arch)
    except NvccNotFound:
        raise NvccNotFound("nvcc not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin): no ptxas report") from None
    report: dict[str, Any] = {"arch": arch, "nvcc_arch": nvcc_arch(arch, source), "nvcc": _nvcc_version(find_nvcc()),
                              "flags": " ".join(nvcc_flags())}
    for key, pattern in _PATTERNS.items():
        match = re.findall(pattern, compiled.log)
        report[key] = max(int(x) for x in match) if match else 0
    report["spills"] = report["spill_store_bytes"] + report["spill_load_bytes"]
    # ptxas's performance notes (C75xx): wgmma serialized, warpgroup waits it injected
    report["ptxas_notes"] = sorted(set(re.findall(r"\(C75\d\d\)[^\n]*", compiled.log)))
    report["wgmma_serialized"] = any("serialized" in n for n in report["ptxas_notes"])
    try:
        sass = sass_instruction_counts(compiled.fatbin)
    except RuntimeError as e:  # the inspection failed, not the build: said in the report
        report["sass_error"] = str(e)
    else:
        if sass is not None:
            report["sass_instructions"] = sass
    report["ptx_instructions"] = ptx_instruction_counts(compiled.ptx)
    report["dynamic_shared_bytes"] = dynamic_shared
    if threads_per_block:
        report["threads_per_block"] = threads_per_block
        report.update(occupancy(arch, report["registers"], report["shared_bytes"] + dynamic_shared,
                                threads_per_block))
    return report


def compile_fatbin(source: str, arch: str) -> bytes:
    """The CUDA source of a build compiled offline to a fatbin for ``arch`` (SASS and PTX), with
    the flags TVM's runtime would JIT it with (``nvcc_flags``, ptxas's options included: the
    binary :func:`ptxas_report` describes): what a CUDA artifact carries so that a GPU machine
    loads it without a compiler (``tvm_attention.runtime.provide_cuda_binary``)."""
    try:
        return _compile(source, arch).fatbin
    except NvccNotFound:
        raise NvccNotFound("nvcc not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin): no precompiled binary") from None


#: PTX instructions worth counting in a kernel (static occurrences in the PTX text)
PTX_INSTRUCTIONS = ("mma.sync", "ldmatrix", "cp.async.cg", "cp.async.wait_group", "bar.sync", "shfl.sync",
                    "ld.local", "st.local", "wgmma.mma_async", "cp.async.bulk.tensor", "mbarrier.try_wait",
                    "setmaxnreg")


def ptx_instruction_counts(ptx: str) -> dict[str, int]:
    """Static count of each of :data:`PTX_INSTRUCTIONS` in ``ptx`` (tensor-core use, async copies,
    barriers, shuffles, and local-memory traffic that would mean a fragment left registers)."""
    lines = [ln.strip() for ln in ptx.splitlines()]
    return {ins: sum(1 for ln in lines if ln.startswith(ins)) for ins in PTX_INSTRUCTIONS}


#: SASS opcodes worth counting in a fatbin (``cuobjdump --dump-sass``): tensor-core products (Hopper's
#: warpgroup ``HGMMA``, its fp8 form ``QGMMA``, Ampere's ``HMMA``), TMA loads (``UTMALDG``), cp.async
#: (``LDGSTS``), ldmatrix
#: (``LDSM``), mbarrier operations (``SYNCS``), register reallocation, local memory
SASS_INSTRUCTIONS = ("HGMMA", "QGMMA", "HMMA", "UTMALDG", "LDGSTS", "LDSM", "SYNCS", "USETMAXREG", "LDL", "STL")


def find_cuobjdump() -> str | None:
    """``cuobjdump`` on PATH, in the CUDA toolkit, or from the ``nvidia-cuda-cuobjdump`` wheel."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    nvcc = find_nvcc()
    candidates = [os.path.join(os.path.dirname(nvcc), "cuobjdump")] if nvcc else []
    try:
        import nvidia  # the wheels' namespace package (nvidia/cu13/bin/cuobjdump)

        for root in nvidia.__path__:
            candidates += sorted(str(p) for p in __import__("pathlib").Path(root).glob("cu*/bin/cuobjdump"))
    except ImportError:
        pass
    return next((c for c in candidates if os.path.isfile(c) and os.access(c, os.X_OK)), None)


def sass_instruction_counts(fatbin: bytes) -> dict[str, int] | None:
    """Static count of each of :data:`SASS_INSTRUCTIONS` in a fatbin's SASS (None without
    cuobjdump; RuntimeError with its message when it fails: cuobjdump 13.5 disassembles
    through nvdisasm, the ``nvidia-cuda-nvdisasm`` wheel). What runs, not what the PTX asked
    for: ptxas may lower or serialize."""
    tool = find_cuobjdump()
    if tool is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.fatbin")
        with open(path, "wb") as f:
            f.write(fatbin)
        proc = subprocess.run([tool, "--dump-sass", path], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"{tool} --dump-sass failed: {(proc.stderr or proc.stdout).strip()[-300:]}")
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)", proc.stdout)
    return {name: sum(1 for op in ops if op == name) for name in SASS_INSTRUCTIONS}


def occupancy(arch: str, registers: int, shared_bytes: int, threads: int) -> dict[str, Any]:
    """Theoretical occupancy: resident blocks per SM limited by warps, registers, shared memory."""
    lim = SM_LIMITS[arch]
    warps = -(-threads // 32)
    by_warps = lim["max_warps"] // warps
    regs_per_warp = -(-max(registers, 1) * 32 // REGISTER_ALLOC_UNIT) * REGISTER_ALLOC_UNIT
    by_regs = lim["registers"] // (regs_per_warp * warps)
    smem = -(-(shared_bytes + SHARED_PER_BLOCK_RESERVED) // SHARED_ALLOC_UNIT) * SHARED_ALLOC_UNIT
    by_smem = lim["shared"] // smem if shared_bytes else lim["max_blocks"]
    blocks = max(0, min(by_warps, by_regs, by_smem, lim["max_blocks"]))
    limiter = min((("warps", by_warps), ("registers", by_regs), ("shared memory", by_smem),
                   ("blocks", lim["max_blocks"])), key=lambda x: x[1])[0]
    return {
        "blocks_per_sm": blocks,
        "active_warps_per_sm": blocks * warps,
        "occupancy": round(blocks * warps / lim["max_warps"], 3),
        "occupancy_limited_by": limiter,
    }


@functools.lru_cache(maxsize=None)
def _nvcc_version(nvcc: str) -> str:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"release ([\d.]+)", out)
    return m.group(1) if m else "?"


def cuda_device_available() -> bool:
    from .target import local_cuda_arch  # TVM loads only to ask for the local GPU

    return local_cuda_arch() is not None
