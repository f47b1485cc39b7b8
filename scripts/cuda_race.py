"""A shared-memory race checker for the generated CUDA kernels, run on the CPU.

It interprets the final lowered device function (the IR CUDA codegen receives: TVM's barriers
are in it) for the threads of one thread block at a time, with concrete ``threadIdx``,
``blockIdx``, lengths and index arrays, and records every shared-memory access as (allocation,
byte, thread, barrier interval, read or write, IR site). A *barrier interval* is the code
between two ``__syncthreads`` (``tvm_storage_sync("shared")``): interval 0 runs from the
kernel's start to the first barrier a thread passes, interval ``i`` from its ``i``-th barrier to
the next. Threads run one after another (no value passes between threads: shared memory's
contents are not simulated, so the order does not matter); the verdict compares what each
interval's threads touched. Within one interval:

* a byte written by one thread and read or written by another thread is a race (threads of one
  warp too: nothing orders two lanes' shared accesses without a barrier);
* ``cp.async`` (the tensor-core kernel's ``attn_cp_async16`` helper, 16 bytes): the copy
  writes its destination at an unknown time between its issue and the ``cp.async.wait_group``
  of its thread that completes its commit group (``wait_group n``: all but the ``n`` newest
  groups; copies not yet committed are not waited for). So its bytes count as written by the
  issuing thread in every interval from the issue to that wait: another thread touching them
  there is a race (a stage read before the wait and the barrier after it; a stage still being
  read by another warp when the next copy into it is issued), and the issuing thread touching
  them between issue and wait is one too. A copy never waited for is reported (the block's
  shared memory may be reused after it exits);
* ``ldmatrix`` (``attn_ldsm_x4``, ``.trans``) reads shared memory for the whole warp: lane
  ``l < 8·n`` (``.x1/.x2/.x4``) supplies one row address and its 16 bytes are read, counted as
  that lane's read; ``mma.sync`` and shuffles touch registers only.

Device helpers called through ``T.cuda.func_call`` are modelled from their inline PTX
(``source_code``): ``cp.async.{ca,cg}.shared.global`` (dst, src), ``commit_group``,
``wait_group n``/``wait_all``, ``ldmatrix``, ``mma.sync``. A helper whose source touches shared
memory otherwise, or an unknown call given a shared pointer, stops the check (``NotModelled``),
as do ``__syncwarp`` and any branch, loop bound or shared index that depends on an unknown
value. Values: the kernel's scalar arguments are the given lengths (a symbolic build's
``batch``, ``seq_q``, ``seq_kv``; varlen's ``total_q``, ``batch_plus_1``; the caches'
``max_len``, ``num_pages``, ``max_pages``), integer index arguments have the given contents
(``index_data`` by buffer name: varlen's ``cu_seqlens_q/k`` are ``CQ``/``CK``, the caches'
``cache_seqlens`` ``CS``, paged ``block_table`` ``BT``, row-major), and integer registers (local
buffers: varlen's ``seq``, the caches' ``k_len``) keep what a thread stores in them, so a
block's sequence, its key-tile count, its row guards and its page addresses are concrete. Every
other load (the float data, shared memory, global memory but the index arguments) yields
"unknown": masking in our kernels is by index and lengths, so nothing else depends on data. A
read of an index argument out of its bounds is reported and stops that thread (what follows
would depend on an unknown value). Also checked: every thread passes the same barriers in the
same order; the lanes of a warp run the same warp-collective operations (ldmatrix, mma,
shuffles); shared (and, where its size is known, global: K/V reads through ``block_table``
included) accesses stay in bounds; cp.async addresses and ldmatrix rows are 16-byte aligned.

Faults to show it can fail: ``drop_barrier(func, k)`` removes the ``k``-th ``__syncthreads``
of the lowered function, ``drop_helper_calls(func, "attn_cp_wait0")`` its cp.async waits.
``CONFIGS`` are the builds ``scripts/smem_race_check.py`` and ``tests/test_smem_race.py`` check.

Not modelled: global memory races (the grid's blocks write disjoint outputs; not checked),
floating-point values, the memory model beyond barriers and cp.async groups (no
``__threadfence``, atomics or ``bar.arrive``), other blocks than the ones checked and other
shapes and index arrays than the ones given (a race that needs a longer sequence, another tile
count or another page order is not seen), and what nvcc does with the code (the IR is checked,
not the PTX).

A development tool, not part of the package: nothing in ``tvm_attention/`` imports it (it checks
the generated kernels; a user of the library never runs it). It lives beside its command-line
front end ``scripts/smem_race_check.py``, which imports it as ``cuda_race`` from this folder.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import random
import re
from typing import Any, Callable

import tvm
import tvm_ffi

from tvm_attention.spec import AttentionSpec
from tvm_attention.target import resolve_target

__all__ = ["CONFIGS", "NotModelled", "Race", "RaceConfig", "RaceReport", "barrier_sites", "check_built",
           "check_config", "check_function", "configs", "device_function", "drop_barrier", "drop_helper_calls"]

WARP = 32
SHARED_SCOPES = ("shared", "shared.dyn")
MAX_RACES = 20  # distinct races kept per report (by kind, buffer, interval and the two sites)


class NotModelled(Exception):
    """The kernel does something the checker does not model: its verdict would be unsound."""


class _IndexOutOfBounds(Exception):
    """A thread read an index argument out of bounds (reported in its block): what it would
    compute from that value is unknown, so the thread stops there."""


class _Unknown:
    __slots__ = ()

    def __repr__(self) -> str:
        return "?"


U = _Unknown()  # a value the checker does not simulate (anything loaded from memory)


# --------------------------------------------------------------------------------------------
# Findings


@dataclasses.dataclass
class Race:
    """One finding. ``threads`` are linear thread ids (``x + Dx·(y + Dy·z)``), ``interval`` the
    barrier interval, ``sites`` the two IR statements (first thread's, second thread's)."""

    kind: str
    buffer: str = ""
    byte: int = -1
    threads: tuple = ()
    interval: int = -1
    interval_desc: str = ""
    sites: tuple = ()
    block: tuple = ()
    count: int = 1  # bytes (or events) this finding stands for
    dims: tuple = (0, 0, 0)  # the block's (Dx, Dy, Dz), to name threads

    def thread_name(self, t: int) -> str:
        dx, dy, _ = self.dims
        if not dx:
            return f"thread {t}"
        return f"thread {t} (tx={t % dx}, ty={t // dx % dy}, warp {t // WARP}, lane {t % WARP})"

    def format(self) -> str:
        where = f" in {self.buffer} at byte {self.byte}" if self.buffer else ""
        thr = " and ".join(self.thread_name(t) for t in self.threads)
        txt = f"{self.kind}{where}"
        if thr:
            txt += f" between {thr}" if len(self.threads) > 1 else f" by {thr}"
        if self.interval >= 0:
            txt += f", barrier interval {self.interval} ({self.interval_desc})"
        txt += f", block {self.block}" if self.block else ""
        for s in self.sites:
            txt += f"\n      {s}"
        if self.count > 1:
            txt += f"\n      ({self.count} bytes/events like it)"
        return txt


@dataclasses.dataclass
class RaceReport:
    """What one check did (``threads`` per block, ``intervals`` the most barrier intervals of a
    block, ``accesses`` the shared accesses recorded over all blocks) and what it found."""

    function: str
    blocks: list
    threads: int
    intervals: int = 0
    accesses: int = 0
    races: list = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.races

    def summary(self) -> str:
        verdict = "ok" if self.ok else f"RACE ({len(self.races)} finding(s))"
        return (f"blocks={len(self.blocks)} threads={self.threads} intervals={self.intervals} "
                f"accesses={self.accesses} {verdict}")

    def format(self) -> str:
        return "\n".join([self.summary()] + ["  - " + r.format() for r in self.races])


# --------------------------------------------------------------------------------------------
# Compile-time descriptions


@dataclasses.dataclass(eq=False)
class _Root:
    """One allocation: a shared/local buffer, or a global kernel argument."""

    name: str
    scope: str
    nbytes: Any = None  # int, a closure giving the size at run time, or None (unknown)
    values: tuple | None = None  # an index argument's given contents (elements): loads read them


@dataclasses.dataclass(eq=False)
class _Buf:
    """A buffer view: its allocation, byte offset in it and element size."""

    root: _Root
    base: int
    elem: int
    name: str

    @property
    def scope(self) -> str:
        return self.root.scope


@dataclasses.dataclass(eq=False)
class _Ptr:
    buf: _Buf
    byte: int


@dataclasses.dataclass(eq=False)
class _Site:
    """An IR statement or load that touches shared memory or synchronizes (for reports)."""

    index: int
    what: str
    node: Any
    landing: Any = None  # a cp.async site's twin for the intervals its copies are in flight

    def __str__(self) -> str:
        return f"site {self.index} {self.what}: {_text(self.node)}"


def _text(node) -> str:
    """A one-line rendering of a statement or expression (without helpers' source code)."""
    if node is None:
        return ""
    k = type(node).__name__
    if k == "BufferStore":
        idx = ", ".join(str(i) for i in node.indices)
        text = f"{node.buffer.name}[{idx}] = {node.value}"
    elif k == "Evaluate":
        text = str(node.value)
    else:
        text = str(node)
    text = re.sub(r",\s*source_code=(\"(?:[^\"\\]|\\.)*\"|'(?:[^'\\]|\\.)*')", "", " ".join(text.split()))
    return text if len(text) <= 200 else text[:197] + "..."


def _dtype_bytes(dt) -> int:
    return max(1, dt.bits * dt.lanes // 8)


def _is_float(e) -> bool:
    ty = e.ty
    return isinstance(ty, tvm.ir.PrimType) and str(ty.dtype).split("x")[0].startswith(("float", "bfloat"))


def _lanes(e) -> int:
    ty = e.ty
    return ty.dtype.lanes if isinstance(ty, tvm.ir.PrimType) else 1


def _bytes_per_index(value, index) -> int:
    """Bytes one lane of ``index`` covers when ``value`` is loaded or stored there (a vector
    access with a Ramp index: one element per lane; a scalar index: the whole vector)."""
    return max(1, value.ty.dtype.bits // 8) * _lanes(value) // max(1, _lanes(index))


_CHILD_FIELDS = ("a", "b", "value", "body", "base", "stride", "condition", "true_value", "false_value")
_LEAVES = ("IntImm", "FloatImm", "StringImm", "Var")


_INT_OPS: dict[str, Callable] = {
    "Add": lambda a, b: a + b, "Sub": lambda a, b: a - b, "Mul": lambda a, b: a * b,
    "FloorDiv": lambda a, b: a // b, "FloorMod": lambda a, b: a % b,
    "Div": lambda a, b: int(a / b) if isinstance(a, int) and isinstance(b, int) else a / b,
    "Mod": lambda a, b: int(math.fmod(a, b)) if isinstance(a, int) and isinstance(b, int) else math.fmod(a, b),
    "Min": min, "Max": max,
    "EQ": lambda a, b: a == b, "NE": lambda a, b: a != b, "LT": lambda a, b: a < b,
    "LE": lambda a, b: a <= b, "GT": lambda a, b: a > b, "GE": lambda a, b: a >= b,
    "BitwiseAnd": lambda a, b: a & b, "BitwiseOr": lambda a, b: a | b, "BitwiseXor": lambda a, b: a ^ b,
    "LShift": lambda a, b: a << b, "RShift": lambda a, b: a >> b,
}
_COMPOSITES = (*_INT_OPS, "And", "Or", "Not", "Select", "Cast", "Ramp", "Broadcast", "Let")  # children: _CHILD_FIELDS
_CALL_INT_OPS = {"tirx.shift_right": "RShift", "tirx.shift_left": "LShift", "tirx.bitwise_and": "BitwiseAnd",
                 "tirx.bitwise_or": "BitwiseOr", "tirx.bitwise_xor": "BitwiseXor"}
_COLLECTIVE_CALLS = ("tirx.cuda.warp_reduce", "tirx.cuda.__shfl_sync", "tirx.cuda.__shfl_down_sync",
                     "tirx.cuda.__shfl_up_sync", "tirx.cuda.__shfl_xor_sync", "tirx.tvm_warp_shuffle",
                     "tirx.tvm_warp_shuffle_down", "tirx.tvm_warp_shuffle_up")
_VALUE_CALLS = ("tirx.call_pure_extern", "tirx.call_extern", "tirx.reinterpret", "tirx.cuda.__activemask",
                "tirx.isnan", "tirx.isinf", "tirx.isfinite", "tirx.exp", "tirx.exp2", "tirx.log", "tirx.sqrt",
                "tirx.rsqrt", "tirx.fabs", "tirx.floor", "tirx.ceil", "tirx.round", "tirx.nearbyint",
                "tirx.trunc", "tirx.pow", "tirx.fma", "tirx.tanh", "tirx.sigmoid", "tirx.erf", "tirx.ret",
                "tirx.type_annotation", "tirx.tvm_thread_invariant")


@dataclasses.dataclass(frozen=True)
class _Helper:
    """What a ``T.cuda.func_call`` device helper does, read from its inline PTX."""

    name: str
    ops: tuple  # ("cp_async", nbytes) | ("commit",) | ("wait", n) | ("ldmatrix", n) | ("collective",)


_PTX_TOUCHING_SHARED = re.compile(r"\b(ld|st|red|atom|cp|stmatrix|ldmatrix|bar|barrier|mbarrier|wgmma|cp\.async)"
                                  r"\.[\w.:]*shared|\bbar\.|\bbarrier\.|__syncthreads|__syncwarp")


def _parse_helper(name: str, source: str) -> _Helper:
    """The effects of helper ``name`` from its source (inline PTX), in program order."""
    ops = []
    pattern = re.compile(
        r"cp\.async\.(?:ca|cg)\.shared(?:::cta)?\.global[\w.:]*\s*\[%\d+\],\s*\[%\d+\],\s*(\d+)"
        r"|cp\.async\.commit_group|cp\.async\.wait_group\s+(\d+)|cp\.async\.wait_all"
        r"|ldmatrix\.sync\.aligned\.m8n8\.x([124])(?:\.trans)?\.shared(?:::cta)?\.b16"
        r"|mma\.sync\.aligned")
    covered = []
    for m in pattern.finditer(source):
        text = m.group(0)
        covered.append(m.span())
        if text.startswith("cp.async.c") and m.group(1):
            ops.append(("cp_async", int(m.group(1))))
        elif text == "cp.async.commit_group":
            ops.append(("commit",))
        elif text.startswith("cp.async.wait_group"):
            ops.append(("wait", int(m.group(2))))
        elif text == "cp.async.wait_all":
            ops += [("commit",), ("wait", 0)]
        elif text.startswith("ldmatrix"):
            ops += [("ldmatrix", int(m.group(3))), ("collective",)]
        else:
            ops.append(("collective",))
    rest = list(source)
    for a, b in covered:
        rest[a:b] = [" "] * (b - a)
    if _PTX_TOUCHING_SHARED.search("".join(rest)):
        raise NotModelled(f"device helper {name} touches shared memory or synchronizes in a way the checker "
                          f"does not model:\n{source}")
    return _Helper(name, tuple(ops))


# --------------------------------------------------------------------------------------------
# Run-time state


class _Block:
    """One thread block's shadow memory and findings."""

    def __init__(self, coords: tuple):
        self.coords = coords
        self.shadow: list[dict] = []  # per interval: {root: {byte: entry}}
        self.races: dict = {}
        self.accesses = 0
        self.barrier_ctx: list = []  # thread 0's barriers: (site, loop context)

    def mem(self, epoch: int, root: _Root) -> dict:
        while len(self.shadow) <= epoch:
            self.shadow.append({})
        per = self.shadow[epoch]
        m = per.get(id(root))
        if m is None:
            m = per[id(root)] = {}
        return m

    def interval_desc(self, epoch: int) -> str:
        ctx = self.barrier_ctx

        def name(i):
            site, loops = ctx[i]
            return site.what + (f" [{loops}]" if loops else "")
        start = "kernel start" if epoch == 0 else f"after barrier {name(epoch - 1)}"
        end = f"before barrier {name(epoch)}" if epoch < len(ctx) else "to kernel end"
        return f"{start}, {end}"

    def add(self, kind: str, root_name: str, byte: int, threads: tuple, epoch: int, sites: tuple) -> None:
        key = (kind, root_name, epoch, tuple(id(s) for s in sites))
        race = self.races.get(key)
        if race is None:
            if len(self.races) >= MAX_RACES:
                return
            self.races[key] = Race(kind, root_name, byte, threads, epoch, "", tuple(sites), self.coords)
        else:
            race.count += 1


class _Thread:
    __slots__ = ("env", "tid", "warp", "coords", "block", "epoch", "barriers", "collectives", "loops",
                 "uncommitted", "groups", "inflight", "locals")

    def __init__(self, nslots: int, tid: int, coords: dict, block: _Block):
        self.env = [U] * nslots
        self.tid, self.warp, self.coords, self.block = tid, tid // WARP, coords, block
        self.epoch = 0
        self.barriers: list = []
        self.collectives: list = []
        self.loops: list = []
        self.uncommitted: list = []
        self.groups: list = []
        self.inflight: dict = {}  # (id(root), byte) -> copy, this thread's copies not yet waited for
        self.locals: dict = {}  # id(root) -> {byte: (value, element bytes)}: integer registers' values


# the shadow entry of a byte in one interval: [writer, its site, 2nd writer, site, reader, site,
# 2nd reader, site]; two distinct threads of each kind are enough to find every conflict
def _touch(th: _Thread, buf_root: _Root, b0: int, n: int, write: bool, site, epoch: int | None = None) -> None:
    block = th.block
    if epoch is None:  # a real access (not a copy's landing, booked in later intervals)
        block.accesses += 1
    ep = th.epoch if epoch is None else epoch
    if epoch is None and th.inflight:
        for b in range(b0, b0 + n):
            cp = th.inflight.get((id(buf_root), b))
            if cp is not None:
                block.add("access before this thread's cp.async.wait_group", buf_root.name, b, (th.tid,),
                          ep, (cp[3], site))
                break
    mem = block.mem(ep, buf_root)
    t = th.tid
    for b in range(b0, b0 + n):
        e = mem.get(b)
        if e is None:
            mem[b] = [t, site, None, None, None, None, None, None] if write else \
                [None, None, None, None, t, site, None, None]
            continue
        if write:
            if e[0] is None:
                e[0], e[1] = t, site
            elif e[0] != t:
                block.add(_kind(e[1], site, True), buf_root.name, b, (e[0], t), ep, (e[1], site))
                if e[2] is None:
                    e[2], e[3] = t, site
            if e[4] is not None and e[4] != t:
                block.add(_kind(site, e[5], False), buf_root.name, b, (t, e[4]), ep, (site, e[5]))
            elif e[6] is not None and e[6] != t:
                block.add(_kind(site, e[7], False), buf_root.name, b, (t, e[6]), ep, (site, e[7]))
        else:
            if e[0] is not None and e[0] != t:
                block.add(_kind(e[1], site, False), buf_root.name, b, (e[0], t), ep, (e[1], site))
            elif e[2] is not None and e[2] != t:
                block.add(_kind(e[3], site, False), buf_root.name, b, (e[2], t), ep, (e[3], site))
            if e[4] is None:
                e[4], e[5] = t, site
            elif e[4] != t and e[6] is None:
                e[6], e[7] = t, site


def _kind(wsite, osite, other_writes: bool) -> str:
    """Name a conflict between a write at ``wsite`` and an access at ``osite``."""
    whats = (getattr(wsite, "what", ""), getattr(osite, "what", ""))
    if any(w.startswith("cp.async landing") for w in whats):
        # issued in an earlier interval, not yet completed by its thread's wait_group
        return "cp.async copy still in flight (not yet waited for) while another thread accesses it"
    if any(w.startswith("cp.async") for w in whats):
        # the copy and the access share an interval: either the access expects the copied data
        # (no wait + barrier between) or the copy overwrites data still read (no barrier between
        # the last read of the stage and the next copy into it)
        return "cp.async copy and another thread's access in one barrier interval"
    return "write-write race" if other_writes else "read-write race"


class _LandingSite:
    """A cp.async copy seen in the intervals after its issue (its destination still in flight)."""

    def __init__(self, site: _Site):
        self.index, self.node, self.what = site.index, site.node, "cp.async landing, " + site.what

    def __str__(self) -> str:
        return _Site.__str__(self)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# The compiler: device IR → Python closures run per thread


class _Compiler:
    def __init__(self, func: tvm.tirx.PrimFunc, scalars: dict, global_bytes: dict, index_data: dict | None = None):
        self.func = func
        self.index_data = {k: _flat_ints(k, v) for k, v in (index_data or {}).items()}
        self.index_roots: dict[str, tuple] = {}  # given name -> (the argument's root, its element bytes)
        self.slots: dict[int, int] = {}
        self.slot_names: list[str] = []
        self.bufs: dict[int, _Buf] = {}
        self.sites: list = []
        self.launch: dict[str, Any] = {}  # thread tag -> extent closure
        self.helpers: dict[str, _Helper] = {}
        self.global_bytes = global_bytes
        self._memo = {}
        self.n_barriers = 0  # barrier sites so far: their ordinal is what drop_barrier counts
        self.param_values: dict[int, Any] = {}
        for p in func.params:
            if isinstance(p.ty, tvm.ir.PrimType):
                self.param_values[self._slot(p)] = scalars.get(p.name, U)
            else:  # a global pointer argument: its buffer is declared below
                self._slot(p)
        self.body = self.stmt(func.body)
        unused = sorted(set(self.index_data) - set(self.index_roots))
        if unused:
            raise ValueError(f"index data for {unused}: the kernel has no such int argument")

    # -- helpers -------------------------------------------------------------------------
    def _slot(self, var) -> int:
        key = var.id_
        s = self.slots.get(key)
        if s is None:
            s = self.slots[key] = len(self.slot_names)
            self.slot_names.append(var.name)
        return s

    def _site(self, what: str, stmt) -> _Site:
        site = _Site(len(self.sites), what, stmt)
        self.sites.append(site)
        return site

    def _buf(self, buffer) -> _Buf:
        b = self.bufs.get(buffer.id_)
        if b is None:
            raise NotModelled(f"buffer {buffer.name} is used without a declaration the checker saw")
        return b

    def _declare(self, buffer, data) -> None:
        elem = _dtype_bytes(buffer.dtype)
        off = buffer.elem_offset
        if not isinstance(off, tvm.tirx.IntImm):
            raise NotModelled(f"buffer {buffer.name} has a symbolic elem_offset {off}")
        if data is None:  # an allocation
            nbytes = self._size(buffer, elem)
            self.bufs[buffer.id_] = _Buf(_Root(buffer.name, buffer.scope(), nbytes), 0, elem, buffer.name)
            return
        if isinstance(data, tvm.ir.Var):  # a kernel argument (global pointer)
            known = self.global_bytes.get(buffer.name)
            if known is not None and len(buffer.shape) == 1 and isinstance(buffer.shape[0], tvm.ir.Var):
                # the flat argument's length var (a host-computed extent): the size given fixes it
                s = self._slot(buffer.shape[0])
                if self.param_values.get(s, U) is U:
                    self.param_values[s] = known // elem
            root = _Root(buffer.name, "global", known if known is not None else self._size(buffer, elem))
            given = [k for k in (buffer.name, data.name) if k in self.index_data]
            if given:
                if not str(buffer.dtype).startswith(("int", "uint")):
                    raise ValueError(f"index data for {given[0]}: the argument is {buffer.dtype}, not an integer")
                root.values = self.index_data[given[0]]
                self.index_roots[given[0]] = (root, elem)
            self.bufs[buffer.id_] = _Buf(root, int(off.value) * elem, elem, buffer.name)
            return
        if isinstance(data, tvm.ir.Call) and data.op.name == "tirx.buffer_data":
            parent = self._buf(data.args[0])
            self.bufs[buffer.id_] = _Buf(parent.root, parent.base + int(off.value) * elem, elem, buffer.name)
            return
        raise NotModelled(f"buffer {buffer.name} declared on {data}")

    def _size(self, buffer, elem):
        total = 1
        for d in buffer.shape:
            if not isinstance(d, tvm.tirx.IntImm):
                f = self.expr(d)
                return lambda th, f=f, prev=total: _mul_size(f(th), prev, elem)
            total *= int(d.value)
        return total * elem

    # -- expressions ---------------------------------------------------------------------
    def expr(self, e) -> Callable:
        """A closure ``f(thread) -> value`` (int, bool, tuple of lanes, _Ptr or U)."""
        if _is_float(e):
            eff = self.effects(e)
            if eff is None:
                return lambda th: U

            def f(th):
                eff(th)
                return U
            return f
        return self._expr(e)

    def _expr(self, e) -> Callable:
        k = type(e).__name__
        if k == "IntImm":
            v = bool(e.value) if str(e.ty.dtype) == "bool" else int(e.value)
            return lambda th: v
        if k in ("FloatImm", "StringImm"):
            v = e.value
            return lambda th: v
        if k == "Var":
            s = self._slot(e)
            return lambda th: th.env[s]
        if k in _INT_OPS:
            return self._binop(_INT_OPS[k], self.expr(e.a), self.expr(e.b), _lanes(e) > 1)
        if k in ("And", "Or"):
            return self._logic(k == "And", self.expr(e.a), self.expr(e.b))
        if k == "Not":
            fa = self.expr(e.a)
            return lambda th: U if (a := fa(th)) is U else (not a)
        if k == "Select":
            fc, ft, ff = self.expr(e.condition), self.expr(e.true_value), self.expr(e.false_value)

            def sel(th):
                c, t, f = fc(th), ft(th), ff(th)
                return U if c is U else (t if c else f)
            return sel
        if k == "Cast":
            return self._cast(e)
        if k == "Ramp":
            fb, fs, n = self.expr(e.base), self.expr(e.stride), int(e.lanes)
            return lambda th: U if (b := fb(th)) is U or (s := fs(th)) is U else tuple(b + i * s for i in range(n))
        if k == "Broadcast":
            fv, n = self.expr(e.value), int(e.lanes)
            return lambda th: U if (v := fv(th)) is U else (v,) * n
        if k == "Let":
            s, fv, fb = self._slot(e.var), self.expr(e.value), self.expr(e.body)

            def let(th):
                th.env[s] = fv(th)
                return fb(th)
            return let
        if k == "TensorLoad":
            return self._load(e)
        if k == "Call":
            return self._call(e, None)
        raise NotModelled(f"expression {k}: {e}")

    def _binop(self, op, fa, fb, vector):
        if not vector:
            def f(th):
                a, b = fa(th), fb(th)
                return U if a is U or b is U else op(a, b)
            return f

        def fv(th):
            a, b = fa(th), fb(th)
            if a is U or b is U:
                return U
            n = len(a) if isinstance(a, tuple) else len(b)
            a = a if isinstance(a, tuple) else (a,) * n
            b = b if isinstance(b, tuple) else (b,) * n
            return tuple(op(x, y) for x, y in zip(a, b))
        return fv

    @staticmethod
    def _logic(is_and, fa, fb):
        def f(th):
            a, b = fa(th), fb(th)
            if is_and:
                return False if (a is False or b is False) else (U if a is U or b is U else bool(a and b))
            return True if (a is True or b is True) else (U if a is U or b is U else bool(a or b))
        return f

    def _cast(self, e):
        fv = self.expr(e.value)
        dt = str(e.ty.dtype)
        if dt == "bool":
            return lambda th: U if (v := fv(th)) is U else bool(v)
        if dt.startswith(("int", "uint")) and "x" not in dt:
            bits = int(re.sub(r"\D", "", dt) or 32)
            signed = dt.startswith("int")

            def cast(th):
                v = fv(th)
                if v is U or isinstance(v, (tuple, _Ptr)):
                    return U
                v = int(v) & ((1 << bits) - 1)
                return v - (1 << bits) if signed and v >= 1 << (bits - 1) else v
            return cast
        return lambda th: (fv(th), U)[1]

    def effects(self, e) -> Callable | None:
        """A closure performing only the shared/global accesses and collectives of ``e`` (its
        value unused), or None when it has none."""
        if not self._touches(e):
            return None
        return self._expr_effects(e)

    def _touches(self, e) -> bool:
        """Whether evaluating ``e`` touches shared or global memory or runs a warp collective."""
        key = e.id_
        hit = self._memo.get(key)
        if hit is not None:
            return hit
        k = type(e).__name__
        if k in _LEAVES:
            out = False
        elif k == "TensorLoad":
            b = self.bufs.get(e.source.id_)
            out = b is None or b.scope in SHARED_SCOPES or b.scope == "global" or \
                any(self._touches(i) for i in e.indices)
        elif k == "Call" and e.op.name not in _VALUE_CALLS and e.op.name != "prim.if_then_else" \
                and e.op.name not in _CALL_INT_OPS:
            out = True
        elif k == "Call" or k in _COMPOSITES:
            kids = list(e.args) if k == "Call" else [getattr(e, f) for f in _CHILD_FIELDS if hasattr(e, f)]
            out = any(self._touches(c) for c in kids if isinstance(c, tvm.ir.Expr))
        else:  # a kind this checker does not know: evaluate it, and _expr refuses it by name
            out = True
        self._memo[key] = out
        return out

    def _expr_effects(self, e) -> Callable:
        k = type(e).__name__
        if k == "Cast":
            return self.effects(e.value) or (lambda th: None)
        if k not in _COMPOSITES or k in ("Let", "Select"):
            return self._expr(e)
        children = [getattr(e, f) for f in ("a", "b", "value", "base", "stride") if hasattr(e, f)]
        fs = [f for f in (self.effects(c) for c in children) if f is not None]

        def run(th):
            for f in fs:
                f(th)
            return U
        return run

    def _index(self, indices, what):
        if len(indices) != 1:
            raise NotModelled(f"{what}: a multi-dimensional access after lowering")
        return self.expr(indices[0])

    def _load(self, e):
        buf = self._buf(e.source)
        if buf.scope not in SHARED_SCOPES and buf.scope != "global":
            if not _is_int_buffer(e.source):
                return lambda th: U  # float registers: values are not simulated
            fi = self._index(e.indices, f"load of {buf.name}")
            return lambda th: _local_load(th, buf, fi(th))
        fi = self._index(e.indices, f"load of {buf.name}")
        site = self._site(f"read {buf.name} ({_text(e)}) in", self._cur_stmt)
        nb = _bytes_per_index(e, e.indices[0])
        root = buf.root

        def load(th):
            i = fi(th)
            inside = _access(th, buf, i, nb, False, site)
            values = root.values
            if values is None or i is U:  # memory is unknown, but an index argument's contents are given
                return U
            if not inside:
                raise _IndexOutOfBounds()
            first = buf.base // buf.elem
            return tuple(values[first + j] for j in i) if isinstance(i, tuple) else values[first + i]
        return load

    # -- calls -----------------------------------------------------------------------------
    def _call(self, e, stmt) -> Callable:
        name = e.op.name
        args = list(e.args)
        if name in _CALL_INT_OPS:
            return self._binop(_INT_OPS[_CALL_INT_OPS[name]], self.expr(args[0]), self.expr(args[1]), _lanes(e) > 1)
        if name == "prim.if_then_else":
            fc, ft, ff = (self.expr(a) for a in args)

            def ite(th):
                c = fc(th)
                if c is U:
                    ft(th)
                    ff(th)
                    return U
                return ft(th) if c else ff(th)
            return ite
        if name == "tirx.likely":
            return self.expr(args[0])
        if name == "tirx.address_of":
            return self._address_of(args[0])
        if name == "tirx.buffer_data":
            buf = self._buf(args[0])
            return lambda th: _Ptr(buf, buf.base)
        if name == "tirx.tvm_access_ptr":
            return self._access_ptr(args)
        if name == "tirx.tvm_storage_sync":
            return self._sync(args, stmt)
        if name == "tirx.cuda.func_call":
            return self._helper_call(args, stmt)
        fargs = [self.expr(a) for a in args]
        if name in _COLLECTIVE_CALLS:
            site = self._site(f"warp collective {name} in", self._cur_stmt)

            def coll(th):
                for f in fargs:
                    f(th)
                th.collectives.append((site.index, th.epoch))
                return U
            return coll

        def generic(th):
            for f in fargs:
                if isinstance(f(th), _Ptr):
                    raise NotModelled(f"call {name} takes a pointer: its memory effect is not modelled")
            return U
        if name not in _VALUE_CALLS:
            shared = [a for a in args if type(a).__name__ == "Call" and a.op.name in
                      ("tirx.address_of", "tirx.tvm_access_ptr", "tirx.buffer_data")]
            if shared:
                raise NotModelled(f"call {name} takes a pointer: its memory effect is not modelled")
        return generic

    def _address_of(self, load):
        if type(load).__name__ != "TensorLoad":
            raise NotModelled(f"address_of({load})")
        buf = self._buf(load.source)
        fi = self._index(load.indices, f"address of {buf.name}")
        elem = buf.elem

        def addr(th):
            i = fi(th)
            if i is U or isinstance(i, tuple):
                raise NotModelled(f"address of {buf.name} at an index that depends on data")
            return _Ptr(buf, buf.base + i * elem)
        return addr

    def _access_ptr(self, args):
        data = args[1]
        if isinstance(data, tvm.ir.Call) and data.op.name == "tirx.buffer_data":
            buf = self._buf(data.args[0])
        else:
            raise NotModelled(f"tvm_access_ptr on {data}")
        fo = self.expr(args[2])
        elem = _dtype_bytes(args[0].ty.dtype) if isinstance(args[0].ty, tvm.ir.PrimType) else buf.elem
        return lambda th: _Ptr(buf, buf.base + fo(th) * elem)

    def _sync(self, args, stmt):
        scope = args[0].value
        if scope not in SHARED_SCOPES:
            raise NotModelled(f"tvm_storage_sync({scope!r}) (only shared-memory barriers are modelled)")
        site = self._site(f"__syncthreads #{self.n_barriers}", stmt)
        self.n_barriers += 1

        def sync(th):
            th.barriers.append(site.index)
            if th.tid == 0:
                th.block.barrier_ctx.append((site, ", ".join(f"{n}={v}" for n, v in th.loops)))
            th.epoch += 1
            return U
        return sync

    def _helper_call(self, args, stmt):
        name, source = args[0].value, args[-1].value
        helper = self.helpers.get(name)
        if helper is None:
            helper = self.helpers[name] = _parse_helper(name, source)
        fargs = [self.expr(a) for a in args[1:-1]]
        kinds = [op[0] for op in helper.ops if op[0] != "collective"] or ["mma/collective"]
        label = {"cp_async": "cp.async", "ldmatrix": "ldmatrix"}
        site = self._site(f"{'+'.join(label.get(k, k) for k in kinds)} ({name})", stmt)
        ops = helper.ops

        def call(th):
            ptrs = [f(th) for f in fargs]
            shared = [p for p in ptrs if isinstance(p, _Ptr) and p.buf.scope in SHARED_SCOPES]
            glob = [p for p in ptrs if isinstance(p, _Ptr) and p.buf.scope == "global"]
            touched = False
            for op in ops:
                kind = op[0]
                if kind == "cp_async":
                    if len(shared) != 1 or len(glob) != 1:
                        raise NotModelled(f"{name}: cp.async wants one shared and one global pointer")
                    _bounds(th, glob[0].buf, glob[0].byte, op[1], site)
                    _aligned(th, (shared[0], glob[0]), op[1], site)
                    _cp_async(th, shared[0], op[1], site)
                    touched = True
                elif kind == "commit":
                    th.groups.append(th.uncommitted)
                    th.uncommitted = []
                elif kind == "wait":
                    _cp_wait(th, op[1])
                elif kind == "ldmatrix":
                    if len(shared) != 1:
                        raise NotModelled(f"{name}: ldmatrix wants one shared pointer")
                    if th.tid % WARP < 8 * op[1]:  # the lanes that supply a row address
                        _aligned(th, shared, 16, site)
                        _access(th, shared[0].buf, None, 16, False, site, byte=shared[0].byte)
                    touched = True
                else:
                    th.collectives.append((site.index, th.epoch))
            if shared and not touched:
                raise NotModelled(f"{name} takes a shared pointer but its PTX does not say what it does with it")
            return U
        return call

    # -- statements ----------------------------------------------------------------------
    _cur_stmt = None

    def stmt(self, s) -> Callable:
        k = type(s).__name__
        prev, self._cur_stmt = self._cur_stmt, s
        try:
            return getattr(self, "_s_" + k, self._s_unknown)(s)
        finally:
            self._cur_stmt = prev

    def _s_unknown(self, s):
        raise NotModelled(f"statement {type(s).__name__}: {str(s)[:200]}")

    def _s_SeqStmt(self, s):
        fs = [self.stmt(x) for x in s.seq]

        def seq(th):
            for f in fs:
                f(th)
        return seq

    def _s_Bind(self, s):
        slot, fv = self._slot(s.var), self.expr(s.value)

        def bind(th):
            th.env[slot] = fv(th)
        return bind

    _s_LetStmt = _s_Bind

    def _s_AttrStmt(self, s):
        if s.attr_key == "thread_extent":
            iv = s.node
            tag, slot = iv.thread_tag, self._slot(iv.var)
            self.launch[tag] = self.expr(s.value)
            fb = self.stmt(s.body)

            def launch(th):
                th.env[slot] = th.coords[tag]
                fb(th)
            return launch
        return self.stmt(s.body)

    def _s_DeclBuffer(self, s):
        self._declare(s.buffer, s.data)
        return lambda th: None

    def _s_AllocBuffer(self, s):
        self._declare(s.buffer, None)
        return lambda th: None

    def _s_For(self, s):
        if s.step is not None and not (isinstance(s.step, tvm.tirx.IntImm) and s.step.value == 1):
            raise NotModelled(f"loop {s.loop_var} with step {s.step}")
        if s.thread_binding is not None:  # final IR binds threads with launch_thread attributes
            raise NotModelled(f"loop {s.loop_var} bound to {s.thread_binding.thread_tag}")
        slot, name = self._slot(s.loop_var), s.loop_var.name
        fmin, fext, fb = self.expr(s.min), self.expr(s.extent), self.stmt(s.body)
        here = s

        def loop(th):
            lo, n = fmin(th), fext(th)
            if lo is U or n is U:
                raise NotModelled(f"loop bound depends on data: {str(here)[:120]}")
            env, cell = th.env, [name, lo]
            th.loops.append(cell)
            for i in range(lo, lo + n):
                env[slot] = i
                cell[1] = i
                fb(th)
            th.loops.pop()
        return loop

    def _s_While(self, s):
        fc, fb = self.expr(s.condition), self.stmt(s.body)

        def loop(th):
            while True:
                c = fc(th)
                if c is U:
                    raise NotModelled("a while condition depends on data")
                if not c:
                    return
                fb(th)
        return loop

    def _s_IfThenElse(self, s):
        fc, ft = self.expr(s.condition), self.stmt(s.then_case)
        fe = self.stmt(s.else_case) if s.else_case is not None else None
        here = s

        def branch(th):
            c = fc(th)
            if c is U:
                raise NotModelled(f"a branch depends on data: if {str(here.condition)[:120]}")
            if c:
                ft(th)
            elif fe is not None:
                fe(th)
        return branch

    def _s_AssertStmt(self, s):
        return self.stmt(s.body) if hasattr(s, "body") and s.body is not None else (lambda th: None)

    def _s_Evaluate(self, s):
        v = s.value
        if type(v).__name__ == "Call":
            return self._call(v, s)
        f = self.expr(v)
        return lambda th: (f(th), None)[1]

    def _s_BufferStore(self, s):
        buf = self._buf(s.buffer)
        if buf.scope not in SHARED_SCOPES and buf.scope != "global" and _is_int_buffer(s.buffer):
            # integer registers (varlen's seq, the caches' k_len ...): their values flow
            fi, fv = self._index(s.indices, f"store to {buf.name}"), self.expr(s.value)
            return lambda th: _local_store(th, buf, fi(th), fv(th))
        fval = self.effects(s.value)
        if buf.scope not in SHARED_SCOPES and buf.scope != "global":
            if fval is None:
                return lambda th: None
            return lambda th: (fval(th), None)[1]
        fi = self._index(s.indices, f"store to {buf.name}")
        site = self._site(f"write {buf.name}", s)
        nb = _bytes_per_index(s.value, s.indices[0])

        def store(th):
            if fval is not None:
                fval(th)
            _access(th, buf, fi(th), nb, True, site)
        return store


def _mul_size(v, prev, elem):
    return U if v is U else v * prev * elem


def _bounds(th: _Thread, buf: _Buf, b0: int, n: int, site) -> bool:
    size = buf.root.nbytes
    if callable(size):
        size = size(th)
    if isinstance(size, int) and (b0 < 0 or b0 + n > size):
        th.block.add(f"out of bounds ({buf.root.scope}: bytes [{b0}, {b0 + n}) of {size})", buf.root.name, b0,
                     (th.tid,), th.epoch, (site,))
        return False
    return True


def _aligned(th: _Thread, ptrs, align: int, site) -> None:
    """cp.async and ldmatrix rows need ``align``-byte aligned addresses (allocations and
    kernel arguments are taken as aligned)."""
    for p in ptrs:
        if p.byte % align:
            th.block.add(f"misaligned address ({p.buf.root.scope} byte {p.byte}, {align}-byte alignment needed)",
                         p.buf.root.name, p.byte, (th.tid,), th.epoch, (site,))


def _access(th: _Thread, buf: _Buf, index, nbytes: int, write: bool, site, byte: int | None = None) -> bool:
    """Record one access of ``buf`` at element ``index`` (an int or a tuple of lanes) or at
    absolute ``byte``, ``nbytes`` per index. False: (some of) it out of bounds (reported)."""
    if byte is None:
        if index is U:
            what = "store to" if write else "load of"
            raise NotModelled(f"the index of a {what} {buf.name} depends on data ({site})")
        if isinstance(index, tuple):
            if all(b - a == 1 for a, b in zip(index, index[1:])):
                byte, nbytes = buf.base + index[0] * buf.elem, nbytes * len(index)
            else:
                return all([_access(th, buf, i, nbytes, write, site) for i in index])
        else:
            byte = buf.base + index * buf.elem
    if not _bounds(th, buf, byte, nbytes, site):
        return False
    if buf.root.scope in SHARED_SCOPES:
        _touch(th, buf.root, byte, nbytes, write, site)
    return True


def _is_int_buffer(buffer) -> bool:
    return str(buffer.dtype).startswith(("int", "uint", "bool"))


def _local_store(th: _Thread, buf: _Buf, index, value) -> None:
    """An integer register buffer's element(s) take ``value`` (an index that depends on data
    forgets the whole buffer: its values become unknown)."""
    mem = th.locals.setdefault(id(buf.root), {})
    if index is U or isinstance(index, _Ptr):
        mem.clear()
        return
    if isinstance(index, tuple):
        vals = value if isinstance(value, tuple) else (value,) * len(index)
        for i, v in zip(index, vals):
            mem[buf.base + i * buf.elem] = (v, buf.elem)
        return
    mem[buf.base + index * buf.elem] = (value, buf.elem)


def _local_load(th: _Thread, buf: _Buf, index):
    mem = th.locals.get(id(buf.root))
    if mem is None or index is U or isinstance(index, _Ptr):
        return U

    def one(i):
        v = mem.get(buf.base + i * buf.elem)
        return v[0] if v is not None and v[1] == buf.elem else U
    if isinstance(index, tuple):
        vals = tuple(one(i) for i in index)
        return U if any(v is U for v in vals) else vals
    return one(index)


def _flat_ints(name: str, values) -> tuple:
    """Nested sequences of ints (an index argument's contents, row-major) as one flat tuple."""
    out = []

    def walk(v):
        if hasattr(v, "tolist"):  # a NumPy array or scalar
            v = v.tolist()
        if isinstance(v, (list, tuple)):
            for x in v:
                walk(x)
        elif isinstance(v, int):
            out.append(int(v))
        else:
            raise ValueError(f"index data for {name}: {v!r} is not an integer")
    walk(values)
    return tuple(out)


def _cp_async(th: _Thread, dst: _Ptr, nbytes: int, site) -> None:
    if not _bounds(th, dst.buf, dst.byte, nbytes, site):
        return
    root = dst.buf.root
    for b in range(dst.byte, dst.byte + nbytes):
        old = th.inflight.get((id(root), b))
        if old is not None:
            th.block.add("two cp.async copies in flight into the same bytes", root.name, b, (th.tid,), th.epoch,
                         (old[3], site))
            break
    _touch(th, root, dst.byte, nbytes, True, site)
    copy = (root, dst.byte, nbytes, site, th.epoch)
    th.uncommitted.append(copy)
    for b in range(dst.byte, dst.byte + nbytes):
        th.inflight[(id(root), b)] = copy


def _land(th: _Thread, copy, last_epoch: int) -> None:
    """The copy's destination counts as written in every interval after its issue up to
    ``last_epoch`` (where its thread waited for it)."""
    root, b0, n, site, issued = copy
    if site.landing is None:  # one twin per site: one finding per site pair, not per copy
        site.landing = _LandingSite(site)
    landing = site.landing
    for ep in range(issued + 1, last_epoch + 1):
        _touch(th, root, b0, n, True, landing, epoch=ep)
    for b in range(b0, b0 + n):
        if th.inflight.get((id(root), b)) is copy:
            del th.inflight[(id(root), b)]


def _cp_wait(th: _Thread, n: int) -> None:
    done = th.groups[:len(th.groups) - n] if n else th.groups
    th.groups = th.groups[len(th.groups) - n:] if n else []
    for group in done:
        for copy in group:
            _land(th, copy, th.epoch)


# --------------------------------------------------------------------------------------------
# Running a block


def _extent(compiled: _Compiler, tag: str, th: _Thread) -> int:
    f = compiled.launch.get(tag)
    if f is None:
        return 1
    v = f(th)
    if v is U:
        raise NotModelled(f"the extent of {tag} depends on an unknown value")
    return v


def _grid(compiled: _Compiler) -> tuple[dict, dict]:
    probe = _Thread(len(compiled.slot_names), 0, {}, _Block(()))
    for s, v in compiled.param_values.items():
        probe.env[s] = v
    # launch extents may use scalar arguments only (TVM hoists them out of the kernel)
    threads = {t: _extent(compiled, t, probe) for t in ("threadIdx.x", "threadIdx.y", "threadIdx.z")}
    grid = {t: _extent(compiled, t, probe) for t in ("blockIdx.x", "blockIdx.y", "blockIdx.z")}
    return threads, grid


def _run_block(compiled: _Compiler, coords: dict, threads: dict) -> tuple[_Block, int]:
    block = _Block(tuple(coords[t] for t in ("blockIdx.x", "blockIdx.y", "blockIdx.z")))
    dx, dy, dz = threads["threadIdx.x"], threads["threadIdx.y"], threads["threadIdx.z"]
    runs = []
    stopped = False  # a thread read an index argument out of bounds and stopped (its finding is in block)
    for z, y, x in itertools.product(range(dz), range(dy), range(dx)):
        tid = x + dx * (y + dy * z)
        th = _Thread(len(compiled.slot_names), tid, {**coords, "threadIdx.x": x, "threadIdx.y": y,
                                                      "threadIdx.z": z}, block)
        for s, v in compiled.param_values.items():
            th.env[s] = v
        try:
            compiled.body(th)
        except _IndexOutOfBounds:
            stopped = True
        pending = th.uncommitted + [c for g in th.groups for c in g]
        for copy in pending:
            block.add("cp.async copy never waited for (in flight when the thread exits)", copy[0].name, copy[1],
                      (tid,), copy[4], (copy[3],))
            _land(th, copy, th.epoch)
        runs.append(th)
    if not stopped:
        _check_convergence(block, runs)
    intervals = max(th.epoch for th in runs) + 1
    for race in block.races.values():
        race.dims = (dx, dy, dz)
        if race.interval >= 0:
            race.interval_desc = block.interval_desc(race.interval)
    return block, intervals


def _check_convergence(block: _Block, runs: list) -> None:
    first = runs[0]
    for th in runs[1:]:
        if th.barriers != first.barriers:
            block.add(f"barrier divergence: thread {first.tid} passes {len(first.barriers)} barriers, "
                      f"thread {th.tid} {len(th.barriers)} (or in another order)", "", -1, (first.tid, th.tid),
                      -1, ())
            break
    warps: dict[int, _Thread] = {}
    for th in runs:
        lead = warps.setdefault(th.warp, th)
        if th.collectives != lead.collectives:
            block.add(f"warp-collective divergence in warp {th.warp}: lanes {lead.tid % WARP} and "
                      f"{th.tid % WARP} do not run the same ldmatrix/mma/shuffle sequence", "", -1,
                      (lead.tid, th.tid), -1, ())


def check_function(func: tvm.tirx.PrimFunc, scalars: dict | None = None, blocks: Any = "all",
                   global_bytes: dict | None = None, max_blocks: int = 64,
                   index_data: dict | None = None) -> RaceReport:
    """Check the device kernel ``func`` (final lowered IR) for shared-memory races.

    ``scalars``: values of its scalar arguments by name (a symbolic build's lengths, e.g.
    ``{"batch": 2, "seq_q": 37, "seq_kv": 45}``, varlen's ``total_q``/``batch_plus_1``, the
    caches' ``max_len``/``num_pages``/``max_pages``; others stay unknown). ``blocks``: "all"
    (every block of the grid, at most ``max_blocks``, else an error), or a list of
    ``(blockIdx.x, blockIdx.y, blockIdx.z)``. ``global_bytes``: sizes of global arguments by
    buffer name, for bounds checks where the IR's own sizes are symbolic. ``index_data``: the
    contents of integer arguments by buffer name in the lowered function (or its pointer
    parameter's name), e.g. ``{"CQ": [0, 7, 44], "CK": [...]}``, ``{"BT": [[3, 0], [1, -1]],
    "CS": [20, 9]}`` (nested: row-major): loads from them yield these values (bounds-checked
    against the given length and the IR's shape), so what the kernel derives from them (its
    sequence's offsets and lengths in registers, loop bounds, page addresses) is concrete."""
    compiled = _Compiler(func, scalars or {}, global_bytes or {}, index_data)
    threads, grid = _grid(compiled)
    probe = _Thread(len(compiled.slot_names), 0, {}, _Block(()))
    for s, v in compiled.param_values.items():
        probe.env[s] = v
    for name, (root, elem) in compiled.index_roots.items():
        size = root.nbytes(probe) if callable(root.nbytes) else root.nbytes
        if isinstance(size, int) and size != len(root.values) * elem:
            raise ValueError(f"index data for {name}: {len(root.values)} elements, but the kernel's {root.name} "
                             f"has {size // elem} at these scalars")
        root.nbytes = len(root.values) * elem  # where the IR's size is unknown, the data's bounds it
    if blocks == "all":
        n = grid["blockIdx.x"] * grid["blockIdx.y"] * grid["blockIdx.z"]
        if n > max_blocks:
            raise ValueError(f"the grid has {n} blocks > max_blocks={max_blocks}: pass blocks=[...] or a smaller shape")
        blocks = [(x, y, z) for z in range(grid["blockIdx.z"]) for y in range(grid["blockIdx.y"])
                  for x in range(grid["blockIdx.x"])]
    nthreads = threads["threadIdx.x"] * threads["threadIdx.y"] * threads["threadIdx.z"]
    report = RaceReport(str(func.attrs["global_symbol"]) if func.attrs and "global_symbol" in func.attrs else "kernel",
                        list(blocks), nthreads)
    for bx, by, bz in blocks:
        block, intervals = _run_block(compiled, {"blockIdx.x": bx, "blockIdx.y": by, "blockIdx.z": bz}, threads)
        report.intervals = max(report.intervals, intervals)
        report.accesses += block.accesses
        report.races.extend(block.races.values())
    return report


# --------------------------------------------------------------------------------------------
# Builds and fault injection


def device_function(built) -> tvm.tirx.PrimFunc:
    """The attention kernel of a CUDA ``BuiltKernel`` (its final lowered IR): the device kernel
    that reads K (a latent build's KV; a split-KV build's merge kernel reads only the workspace, through no shared
    memory; a device-checked build's check kernel only the index arrays)."""
    funcs = [f for mod in built.lowered.devices.values() for f in mod.functions.values()]
    attention = [f for f in funcs if any(p.name in ("K_ptr", "K8_ptr", "KV_ptr") for p in f.params)]
    if len(attention) != 1:
        raise ValueError(f"expected one attention kernel (reading K) among {len(funcs)} device kernel(s), "
                         f"found {len(attention)}")
    return attention[0]


def check_built(built, lengths: dict | None = None, blocks: Any = "all", func=None, max_blocks: int = 64,
                index_data: dict | None = None) -> RaceReport:
    """Check a CUDA build of either attention kernel at the spec's lengths (a symbolic build:
    at ``lengths``, e.g. ``{"batch": 2, "seq_q": 37, "seq_kv": 45}``, default the spec's
    nominal ones; varlen: ``total_q``, ``total_k``, ``batch_plus_1``; kvcache: ``batch``,
    ``seq_q``, ``max_len``; paged: ``batch``, ``seq_q``, ``num_pages``, ``max_pages``) with
    ``index_data`` the contents of its index arguments (``check_function``: varlen ``CQ``/``CK``,
    kvcache ``CS``, paged ``BT``/``CS``). ``func`` replaces the build's device function (a
    fault-injected copy)."""
    spec = built.spec
    dims = {"batch": spec.batch, "seq_q": spec.seq_q, "seq_kv": spec.seq_kv, **(lengths or {})}
    return check_function(func if func is not None else device_function(built), host_scalars(built, dims), blocks,
                          _argument_bytes(spec, dims), max_blocks, index_data)


def host_scalars(built, dims: dict) -> dict:
    """``dims`` with the scalars the host function computes from them and passes to its kernels:
    TVM hoists common subexpressions of the launch into host lets (``cse_v18 = (seq_q + 15) >>
    4``, a split-KV grid's chunk count), which the kernel takes as parameters. Those the host's
    lets give as integers at ``dims`` (a let may use another's value)."""
    vals = dict(dims)
    lets: list = []
    for f in built.lowered.host.functions.values():
        if isinstance(f, tvm.tirx.PrimFunc):
            tvm_ffi.structural_walk(f.body, [(tvm.tirx.LetStmt, lets.append), (tvm.tirx.Bind, lets.append)])
    for _ in range(len(lets)):  # until no let gains a value (each pass binds at least one more)
        analyzer, known = tvm.sym.Analyzer(), len(vals)
        for let in lets:
            free: list = []
            tvm_ffi.structural_walk(let.value, [(tvm.tirx.Var, free.append)])
            if let.var.name in vals or any(v.name not in vals for v in free):
                continue
            try:
                for v in free:
                    analyzer.bind(v, tvm.tirx.IntImm(str(v.ty.dtype), vals[v.name]))
                value = analyzer.simplify(let.value)
            except (TypeError, AttributeError):  # a call or a handle: not a scalar of dims
                continue
            if isinstance(value, tvm.tirx.IntImm):
                vals[let.var.name] = int(value)
        if len(vals) == known:
            break
    return vals


def _argument_bytes(spec: AttentionSpec, dims: dict) -> dict:
    """Q, K, V and O's sizes in bytes in ``spec``'s layout at ``dims`` (those it determines)."""
    elem = _dtype_bytes(tvm.DataType(spec.dtype))
    compiled = {"heads": spec.heads, "kv_heads": spec.kv_heads, "head_dim": spec.head_dim, "page_size": spec.page_size,
                "head_dim_v": spec.v_dim}

    def size(arg):  # the layout entry's argument: its dims compiled in, or taken from dims
        vals = [compiled[n] if n in compiled else dims.get(n) for n in arg.dims]
        return None if any(v is None for v in vals) else math.prod(vals) * elem
    args = spec.layout_info.args
    if spec.layout_info.latent:  # one cache, KV: K and V (its first head_dim_v columns)
        out = {"Q": size(args[0]), "Qp": size(args[0]), "O": size(spec.layout_info.output), "KV": size(args[1])}
        return {k: v for k, v in out.items() if v is not None}
    q, kv, v, o = size(args[0]), size(args[1]), size(args[2]), size(spec.layout_info.output)
    out = {"Q": q, "Qp": q, "O": o, "K": kv, "V": v}
    return {k: v for k, v in out.items() if v is not None}


def _is_sync(stmt) -> bool:
    v = stmt.value
    return type(v).__name__ == "Call" and v.op.name == "tirx.tvm_storage_sync" and v.args[0].value in SHARED_SCOPES


def _is_helper(stmt, name: str) -> bool:
    v = stmt.value
    return type(v).__name__ == "Call" and v.op.name == "tirx.cuda.func_call" and v.args[0].value == name


def barrier_sites(func: tvm.tirx.PrimFunc) -> int:
    """How many ``__syncthreads`` statements the kernel has (in program order)."""
    found = []
    tvm_ffi.structural_walk(func.body, [(tvm.tirx.Evaluate, lambda s: found.append(s) if _is_sync(s) else None)])
    return len(found)


def _drop(func: tvm.tirx.PrimFunc, match: Callable, which: int | None) -> tvm.tirx.PrimFunc:
    seen = [0]

    def cb(s):
        if not match(s):
            return s
        k = seen[0]
        seen[0] += 1
        return tvm.tirx.Evaluate(tvm.tirx.IntImm("int32", 0)) if which is None or k == which else s
    body = tvm_ffi.structural_map(func.body, [(tvm.tirx.Evaluate, cb)], order="pre")
    if which is not None and which >= seen[0]:
        raise ValueError(f"the kernel has {seen[0]} such statements, not {which + 1}")
    if seen[0] == 0:
        raise ValueError("no such statement in the kernel")
    return func.with_body(body)


def drop_barrier(func: tvm.tirx.PrimFunc, k: int) -> tvm.tirx.PrimFunc:
    """``func`` without its ``k``-th ``__syncthreads`` (program order, from 0): a fault."""
    return _drop(func, _is_sync, k)


def drop_helper_calls(func: tvm.tirx.PrimFunc, name: str, k: int | None = None) -> tvm.tirx.PrimFunc:
    """``func`` without the calls of device helper ``name`` (all, or the ``k``-th in program
    order), e.g. ``attn_cp_wait0``: a fault."""
    return _drop(func, lambda s: _is_helper(s, name), k)


# --------------------------------------------------------------------------------------------
# The configurations the script and the tests check

ALL_DYNAMIC = ("batch", "seq_q", "seq_kv")


@dataclasses.dataclass(frozen=True)
class RaceConfig:
    """One kernel build at a small concrete shape. ``spec``: AttentionSpec fields; ``lengths``:
    where a symbolic build is run (its grid and loop bounds: the kernel's scalar arguments);
    ``data``: the contents of its index arguments by name (varlen ``CQ``/``CK``, the caches'
    ``CS``, paged ``BT``); ``quick``: in the test's set."""

    name: str
    kernel: str  # "fused_tc" | "fused_simt" | "fused_mla" | "backward_mma"
    spec: dict
    knobs: dict
    lengths: dict | None = None
    quick: bool = False
    data: dict | None = None

    def attention_spec(self) -> AttentionSpec:
        return AttentionSpec(**self.spec)

    def build(self):
        # local: checking a device function needs no build path (schedules, workloads, nvcc)
        from tvm_attention.build import build_kernel
        if self.kernel == _BWD:  # the backward's main kernel (build_backward: its own knobs)
            from tvm_attention.backward import CudaBackwardKnobs, build_backward  # the backward's build path
            return build_backward(self.attention_spec(), CudaBackwardKnobs(**self.knobs),
                                  target=resolve_target("cuda", arch="sm_90"))
        return build_kernel(self.attention_spec(), self.kernel, target=resolve_target("cuda", arch="sm_90"),
                            knobs=self.knobs)


def _cfg(name, kernel, knobs, quick=False, *, lengths=None, data=None, **spec):
    base = dict(batch=1, heads=2, kv_heads=1, head_dim=16, dtype="float16", causal=False)
    return RaceConfig(name, kernel, {**base, **spec}, knobs, lengths, quick, data)


def varlen_case(seqlens) -> dict:
    """``lengths`` and ``data`` of a varlen config: sequences of (query rows, keys)."""
    cq, ck = [0], [0]
    for sq, sk in seqlens:
        cq.append(cq[-1] + sq)
        ck.append(ck[-1] + sk)
    return dict(lengths=dict(batch=len(seqlens), total_q=cq[-1], total_k=ck[-1], batch_plus_1=len(seqlens) + 1),
                data=dict(CQ=tuple(cq), CK=tuple(ck)), layout="varlen")


def cache_case(cache_seqlens, seq_q: int, page_size: int | None = None, seed: int = 0) -> dict:
    """``lengths`` and ``data`` of a kvcache config (``max_len`` the longest sequence: a key read
    past a sequence lands in the next one, or out of bounds for the last), or a paged one
    (``page_size``): each sequence's pages taken in a shuffled order from a pool with 2 spare
    pages, ``max_pages`` one more than the longest needs, unused ``block_table`` entries -1 (as
    ``layouts.Paged.random_inputs`` makes them: a read through one is out of bounds)."""
    b = len(cache_seqlens)
    if page_size is None:
        return dict(lengths=dict(batch=b, seq_q=seq_q, max_len=max(cache_seqlens)),
                    data=dict(CS=tuple(cache_seqlens)), layout="kvcache")
    need = [-(-n // page_size) for n in cache_seqlens]
    max_pages, num_pages = max(need) + 1, sum(need) + 2
    order = list(range(num_pages))
    random.Random(seed).shuffle(order)
    table, nxt = [], 0
    for n in need:
        table.append(tuple(order[nxt:nxt + n]) + (-1,) * (max_pages - n))
        nxt += n
    return dict(lengths=dict(batch=b, seq_q=seq_q, num_pages=num_pages, max_pages=max_pages),
                data=dict(BT=tuple(table), CS=tuple(cache_seqlens)), layout="paged", page_size=page_size)


_SIMT = "fused_simt"
_TC = "fused_tc"
_MLA = "fused_mla"
_BWD = "backward_mma"
_LEN = dict(batch=2, seq_q=37, seq_kv=45)  # symbolic builds run here: tails in both lengths
#: varlen (query rows, keys): no rows, a sequence longer than a row tile, no keys, keys > rows
_RAGGED = ((0, 7), (37, 45), (5, 0), (20, 70))
#: cache_seqlens of a decode step and of a prefill chunk of 5 (no keys; tile and page edges; one
#: key: under causal masking the chunk's first 4 positions see none, a whole row tile of them
#: where the packed group's rows span two tiles)
_DECODE = (37, 0, 16, 70)
_CHUNK = (21, 0, 1, 40)
#: GQA (2 query heads on 1 KV head) everywhere; tails (37 × 45, 45 × 17 ...) unless noted
CONFIGS = [
    _cfg("simt_f32_causal_37x45", _SIMT, dict(block_m=8, block_n=16, threads_per_row=4), True,
         seq_q=37, seq_kv=45, dtype="float32", causal=True),
    _cfg("simt_f16_full_37x45", _SIMT, dict(block_m=16, block_n=16, threads_per_row=2), True,
         seq_q=37, seq_kv=45),
    _cfg("simt_f16_causal_sym", _SIMT, dict(block_m=16, block_n=16, threads_per_row=4), True, lengths=_LEN,
         seq_q=64, seq_kv=64, causal=True, dynamic=ALL_DYNAMIC),
    _cfg("simt_f32_causal_45x17", _SIMT, dict(block_m=8, block_n=16, threads_per_row=4),
         seq_q=45, seq_kv=17, dtype="float32", causal=True),
    _cfg("simt_bf16_full_32x64", _SIMT, dict(block_m=8, block_n=32, threads_per_row=8),
         seq_q=32, seq_kv=64, dtype="bfloat16", head_dim=32),
    _cfg("simt_f16_preset_d64_causal", _SIMT, dict(block_m=64, block_n=64, threads_per_row=4),
         seq_q=70, seq_kv=80, head_dim=64, causal=True),
    _cfg("simt_f32_preset_d64_causal", _SIMT, dict(block_m=32, block_n=32, threads_per_row=8),
         seq_q=40, seq_kv=70, dtype="float32", head_dim=64, causal=True),
    _cfg("tc_f16_s1_m1_causal_37x45", _TC, dict(warps=2, block_n=16, stages=1, m_tiles=1), True,
         seq_q=37, seq_kv=45, causal=True),
    _cfg("tc_f16_s2_m1_full_37x45", _TC, dict(warps=2, block_n=16, stages=2, m_tiles=1), True,
         seq_q=37, seq_kv=45),
    _cfg("tc_f16_s2_m2_causal_37x100", _TC, dict(warps=2, block_n=32, stages=2, m_tiles=2), True,
         seq_q=37, seq_kv=100, head_dim=32, causal=True),
    _cfg("tc_f16_s2_m2_causal_sym", _TC, dict(warps=2, block_n=16, stages=2, m_tiles=2), True, lengths=_LEN,
         seq_q=64, seq_kv=64, head_dim=32, causal=True, dynamic=ALL_DYNAMIC),
    _cfg("tc_bf16_s3_m1_causal_20x90", _TC, dict(warps=1, block_n=16, stages=3, m_tiles=1),
         seq_q=20, seq_kv=90, dtype="bfloat16", causal=True),
    _cfg("tc_f16_s4_m2_full_37x100", _TC, dict(warps=2, block_n=16, stages=4, m_tiles=2),
         seq_q=37, seq_kv=100),
    _cfg("tc_bf16_s1_m2_causal_45x17", _TC, dict(warps=2, block_n=16, stages=1, m_tiles=2),
         seq_q=45, seq_kv=17, dtype="bfloat16", causal=True),
    _cfg("tc_bf16_s3_m1_full_sym_kv", _TC, dict(warps=2, block_n=16, stages=3, m_tiles=1),
         lengths=dict(seq_kv=77), seq_q=40, seq_kv=64, dtype="bfloat16", dynamic=("seq_kv",)),
    _cfg("tc_f16_preset_d64_causal", _TC, dict(warps=4, block_n=64, stages=2, m_tiles=2),
         seq_q=130, seq_kv=200, head_dim=64, causal=True),
    _cfg("tc_f16_preset_d128", _TC, dict(warps=4, block_n=32, stages=2, m_tiles=1),
         seq_q=64, seq_kv=100, head_dim=128),
    # past 48 KiB the stages are one dynamic shared allocation (buf_dyn_shmem): D=128 with 64-key
    # tiles (68 KiB), D=64 with three stages (54 KiB)
    _cfg("tc_f16_dyn_s2_n64_d128", _TC, dict(warps=1, block_n=64, stages=2, m_tiles=1), True,
         seq_q=20, seq_kv=90, head_dim=128, causal=True),
    _cfg("tc_f16_dyn_s3_m2_d64", _TC, dict(warps=4, block_n=64, stages=3, m_tiles=2),
         seq_q=130, seq_kv=200, head_dim=64, causal=True),
    # -- the serving layouts: the kernels' control flow follows their index arguments -----------
    # (the KV-cache builds split-KV into 2 chunks at batch 4 with one KV head, 1 with two:
    # split_tasks=8 keeps their grids small; a chunk past the keys runs its empty loop)
    _cfg("simt_f16_varlen_causal", _SIMT, dict(block_m=16, block_n=16, threads_per_row=4), True,
         seq_q=64, seq_kv=64, causal=True, **varlen_case(_RAGGED)),
    _cfg("simt_f32_varlen_full", _SIMT, dict(block_m=8, block_n=16, threads_per_row=4),
         seq_q=64, seq_kv=64, dtype="float32", **varlen_case(_RAGGED)),
    _cfg("simt_f32_kvcache_decode_causal", _SIMT, dict(block_m=8, block_n=16, threads_per_row=4, split_tasks=8), True,
         heads=4, seq_q=1, seq_kv=64, dtype="float32", causal=True, **cache_case(_DECODE, 1)),
    _cfg("simt_f16_paged_chunk5_causal", _SIMT, dict(block_m=8, block_n=32, threads_per_row=4, split_tasks=8), True,
         heads=4, kv_heads=2, seq_q=5, seq_kv=64, causal=True, **cache_case(_CHUNK, 5, 16)),
    _cfg("simt_f16_paged_decode_full", _SIMT, dict(block_m=16, block_n=16, threads_per_row=2, split_tasks=8),
         heads=4, seq_q=1, seq_kv=64, **cache_case(_DECODE, 1, 16, seed=1)),
    _cfg("simt_f32_kvcache_chunk5_full", _SIMT, dict(block_m=16, block_n=16, threads_per_row=4, split_tasks=8),
         heads=4, kv_heads=2, seq_q=5, seq_kv=64, dtype="float32", **cache_case(_CHUNK, 5)),
    _cfg("tc_f16_s2_m1_varlen_causal", _TC, dict(warps=2, block_n=16, stages=2, m_tiles=1), True,
         seq_q=64, seq_kv=64, causal=True, **varlen_case(_RAGGED)),
    _cfg("tc_bf16_s1_m2_varlen_full", _TC, dict(warps=2, block_n=16, stages=1, m_tiles=2),
         seq_q=64, seq_kv=64, dtype="bfloat16", **varlen_case(_RAGGED)),
    _cfg("tc_f16_s1_m1_kvcache_decode_causal", _TC, dict(warps=2, block_n=16, stages=1, m_tiles=1, split_tasks=8), True,
         heads=4, seq_q=1, seq_kv=64, causal=True, **cache_case(_DECODE, 1)),
    _cfg("tc_f16_s2_m1_paged_chunk5_causal", _TC, dict(warps=2, block_n=32, stages=2, m_tiles=1, split_tasks=8), True,
         heads=4, kv_heads=2, seq_q=5, seq_kv=64, causal=True, **cache_case(_CHUNK, 5, 16)),
    _cfg("tc_bf16_s2_m2_paged_decode_full", _TC, dict(warps=2, block_n=16, stages=2, m_tiles=2, split_tasks=8),
         heads=4, seq_q=1, seq_kv=64, dtype="bfloat16", **cache_case(_DECODE, 1, 16, seed=1)),
    _cfg("tc_f16_s3_m1_kvcache_chunk5_causal", _TC, dict(warps=1, block_n=16, stages=3, m_tiles=1, split_tasks=8),
         heads=8, kv_heads=2, seq_q=5, seq_kv=64, causal=True, **cache_case(_CHUNK, 5)),
    # 8-bit caches: plain loads converted into the stages (no cp.async), TVM's barriers around them
    _cfg("tc_f16_s2_m1_paged_e4m3_decode", _TC, dict(warps=2, block_n=16, stages=2, m_tiles=1, split_tasks=8), True,
         heads=4, seq_q=1, seq_kv=64, causal=True, kv_dtype="float8_e4m3fn", **cache_case(_DECODE, 1, 16, seed=1)),
    _cfg("simt_f32_kvcache_int8_decode", _SIMT, dict(block_m=8, block_n=16, threads_per_row=4, split_tasks=8),
         heads=4, seq_q=1, seq_kv=64, dtype="float32", causal=True, kv_dtype="int8", **cache_case(_DECODE, 1)),
    # a value head size of its own: V's tile (and its stages) narrower or wider than K's
    _cfg("tc_f16_s2_m1_causal_dv16_d32", _TC, dict(warps=2, block_n=16, stages=2, m_tiles=1),
         seq_q=37, seq_kv=45, head_dim=32, head_dim_v=16, causal=True),
    _cfg("simt_f16_paged_decode_dv32", _SIMT, dict(block_m=16, block_n=16, threads_per_row=2, split_tasks=8),
         heads=4, seq_q=1, seq_kv=64, head_dim_v=32, **cache_case(_DECODE, 1, 16, seed=1)),
    # MLA (the latent layouts): two row groups of two warps, which exchange their slices' row
    # maxima and sums and the P tile through shared memory; 40 heads a decode step are two row
    # tiles, split into 2 chunks; a paged prefill chunk of 5 (200 packed rows) in one stage
    _cfg("mla_f16_decode_split", _MLA, dict(row_groups=2, col_groups=2, block_n=32, stages=2, split_tasks=8), True,
         heads=40, seq_q=1, seq_kv=64, head_dim=64, head_dim_v=32, scale=0.1, causal=True,
         **{**cache_case(_DECODE, 1), "layout": "mla"}),
    _cfg("mla_bf16_paged_chunk5_s1", _MLA, dict(row_groups=2, col_groups=2, block_n=32, stages=1, split_tasks=8), True,
         heads=40, seq_q=5, seq_kv=64, head_dim=64, head_dim_v=32, scale=0.1, causal=True, dtype="bfloat16",
         **{**cache_case(_CHUNK, 5, 16), "layout": "mla_paged"}),
    # the backward's main kernel: a key tile's block walks the query tiles (Q, dO and dS through
    # shared memory, two barriers a tile); GQA 2:1, tails in both lengths, causal
    _cfg("bwd_f16_causal_37x45", _BWD, dict(warps=2, block_m=32), True, heads=2, seq_q=37, seq_kv=45, head_dim=32,
         causal=True),
    _cfg("bwd_bf16_full_dv16_40x50", _BWD, dict(warps=2, block_m=16), heads=2, seq_q=40, seq_kv=50, head_dim=32,
         head_dim_v=16, dtype="bfloat16"),
]


def configs(kernel: str = "all", quick: bool = False) -> list[RaceConfig]:
    """The configurations of ``kernel`` ("fused_tc", "fused_simt", "fused_mla", "backward_mma" or "all"); ``quick``: the
    tests' subset."""
    return [c for c in CONFIGS if (kernel == "all" or c.kernel == kernel) and (c.quick or not quick)]


def check_config(cfg: RaceConfig, built=None, func=None) -> RaceReport:
    """Build ``cfg`` (unless ``built`` is given) and check every block of its grid."""
    built = built if built is not None else cfg.build()
    return check_built(built, cfg.lengths, func=func, index_data=cfg.data)
