"""Every use of TVM's private API, in one place.

The project pins apache-tvm; each function here reaches past TVM's public API (a name with a
leading underscore, an attribute a class sets for itself, a module TVM imports for its own use)
and its docstring says what it uses, the TVM it was checked against (:data:`CHECKED_WITH`) and
what breaks if TVM changes it. :func:`missing` lists what the installed TVM no longer has;
``tests/test_tvm_internals.py`` asserts it is empty, so an upgrade fails that one test, by name,
instead of deep inside a build or a tune.

Nothing here imports TVM at module level: each function imports what it uses when called (a
build without a tuning log never loads MetaSchedule, a CPU build never loads the nvcc helpers).
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import inspect
import sys
import threading
import types
from typing import Any, Callable

#: the apache-tvm every use below was read against
CHECKED_WITH = "0.27.0.post1"

#: function name -> what it needs from TVM: "module:attr.attr" (an attribute path), "module" (a
#: module that must exist, found without importing it), or a callable that raises when it is gone
REQUIRES: dict[str, tuple[str | Callable[[], None], ...]] = {}


def _uses(*needs: str | Callable[[], None]):
    def mark(fn):
        REQUIRES[fn.__name__] = needs
        return fn

    return mark


def missing() -> list[str]:
    """What the installed TVM lacks of :data:`REQUIRES`, one line each (``[]``: all present)."""
    out = []
    for name, needs in REQUIRES.items():
        for need in needs:
            try:
                _check(need)
            except Exception as e:  # noqa: BLE001 - any failure to find it is the answer, reported by name
                what = need if isinstance(need, str) else "a check of its source or attributes"
                out.append(f"{name}: {what}: {type(e).__name__}: {e}")
    return out


def _check(need) -> None:
    if callable(need):
        need()
        return
    module, _, path = need.partition(":")
    if not path:
        if importlib.util.find_spec(module) is None:
            raise ModuleNotFoundError(f"no module {module}")
        return
    obj: Any = importlib.import_module(module)
    for part in path.split("."):
        obj = getattr(obj, part)


# -- expressions ------------------------------------------------------------------------------------
@_uses("tvm.ir._overload_prim_expr:ExprOp", "tvm.ir.expr:Expr")
@functools.lru_cache(maxsize=1)
def tir_expr_types() -> tuple[type, ...]:
    """The Python classes of a TIR expression: ``tvm.ir.expr.Expr`` and
    ``tvm.ir._overload_prim_expr.ExprOp``, the private mixin that gives expressions their
    operators (a comparison's ``EqualOp`` is an ``ExprOp`` and no ``Expr``).

    Used by :mod:`tvm_attention.modifiers` to tell a TIR argument from a number or a NumPy
    array. If TVM moves ``ExprOp``, modifiers cannot evaluate in TIR (every kernel with a
    ``score_mod``/``mask_mod`` fails to generate). Checked with TVM 0.27.0.post1."""
    from tvm.ir import _overload_prim_expr, expr

    return (expr.Expr, _overload_prim_expr.ExprOp)


# -- MetaSchedule -----------------------------------------------------------------------------------
@_uses("tvm.s_tir.meta_schedule.tune_context:_normalize_mod")
def normalize_mod(func):
    """``func`` as MetaSchedule keys a workload: ``tune_context._normalize_mod`` (a PrimFunc
    becomes an IRModule with one ``main``, marked ``tirx.noalias``). The exact module matters:
    a tuning log's workload is looked up by its structural hash, so ours must be the one
    ``TuneContext`` makes. If TVM changes it, every stored log stops matching (``build``
    finds no record, ``tune`` starts over) until the logs are made again. Checked with TVM 0.27.0.post1."""
    from tvm.s_tir.meta_schedule.tune_context import _normalize_mod

    return _normalize_mod(func)


@_uses("tvm.s_tir.tensor_intrin", "tvm.s_tir.meta_schedule.tune_context:TuneContext.__init__",
       lambda: _require_source("tvm.s_tir.meta_schedule.tune_context", "TuneContext.__init__",
                               "import tvm.s_tir.tensor_intrin"))
@contextlib.contextmanager
def skip_tensor_intrin_import():
    """While active, ``sys.modules["tvm.s_tir.tensor_intrin"]`` is an empty module.

    ``TuneContext.__init__`` imports ``tvm.s_tir.tensor_intrin`` only to register TVM's
    tensorize intrinsics (~30 s: it parses ~500 TVMScript functions); our spaces tensorize none
    of TVM's. The placeholder is removed afterwards, so a later real import still works. If TVM
    renames the module or stops importing it there, this is harmless (the import costs its 30 s
    again); if TVM imports something *from* it there, creating a TuneContext fails with an
    ImportError naming it. Checked with TVM 0.27.0.post1."""
    name = "tvm.s_tir.tensor_intrin"
    if name in sys.modules:
        yield
        return
    sys.modules[name] = types.ModuleType(name)
    try:
        yield
    finally:
        sys.modules.pop(name, None)


@_uses("tvm.s_tir.meta_schedule.builder:LocalBuilder._cls",
       "tvm.s_tir.meta_schedule.builder:LocalBuilder._cls._sanity_check",
       lambda: _require_source("tvm.s_tir.meta_schedule.builder.local_builder", "LocalBuilder.__init__",
                               "self.f_export = f_export", "self._sanity_check()"),
       "tvm.s_tir.meta_schedule.builder.local_builder:_worker_func",
       "tvm.s_tir.meta_schedule.builder.local_builder:_serialize_params")
def local_builder_parts() -> tuple[type, Callable, Callable]:
    """``(LocalBuilder's Python class, _worker_func, _serialize_params)`` of
    ``meta_schedule.builder.local_builder``, for the tuner's builder that keeps its worker pool
    (``tune.driver._lean_builder_class``).

    It subclasses ``LocalBuilder._cls`` (the Python class under TVM's object wrapper), relies on
    its ``__init__`` storing ``max_workers``, ``timeout_sec``, ``initializer``, ``f_build`` and
    ``f_export`` and calling ``self._sanity_check()`` (overridden: TVM's starts a pool only to
    look ``f_build`` up), and builds each candidate with ``_worker_func(f_build, f_export, mod,
    target, _serialize_params(params))`` in the pool's workers. If TVM changes any of it,
    ``tune`` fails at its first build (or builds nothing). Checked with TVM 0.27.0.post1."""
    from tvm.s_tir import meta_schedule as ms
    from tvm.s_tir.meta_schedule.builder.local_builder import _serialize_params, _worker_func

    return ms.builder.LocalBuilder._cls, _worker_func, _serialize_params


@_uses("tvm.s_tir.meta_schedule.runner:LocalRunner._cls")
def local_runner_class() -> type:
    """``LocalRunner._cls``: the Python class under TVM's object wrapper, so that the tuner can
    set ``f_alloc_argument`` on the runner after construction (each tune's inputs differ, the
    kept runner does not) and shut its ``pool`` down. If TVM drops ``_cls``, ``tune`` fails
    when it makes its local runner. Checked with TVM 0.27.0.post1."""
    from tvm.s_tir import meta_schedule as ms

    return ms.runner.LocalRunner._cls


# -- worker pools -----------------------------------------------------------------------------------
#: the module TVM's pool workers run (``python -m tvm.exec.popen_worker``; checked with TVM 0.27.0.post1):
#: the tuner finds its own workers among its children by it before a hard exit
POPEN_WORKER_MODULE = "tvm.exec.popen_worker"
REQUIRES["POPEN_WORKER_MODULE"] = (POPEN_WORKER_MODULE,
                                   lambda: _require_source("tvm.support.popen_pool", "PopenWorker._start",
                                                           POPEN_WORKER_MODULE))
#: the module our workers' command lines run (``python -m`` it, then TVM's module and its arguments)
TORCHLESS = "tvm_attention._torchless"
_TORCHLESS_LOCK = threading.Lock()
_TORCHLESS_DEPTH = [0, None]  # active torchless_workers() contexts, TVM's own PopenWorker class


@functools.lru_cache(maxsize=1)
def _torchless_worker_class():
    """The ``PopenWorker`` subclass :func:`torchless_workers` puts in TVM's place (made once)."""
    import os
    import subprocess

    from tvm.support.popen_pool import PopenWorker

    class TorchlessWorker(PopenWorker):
        """TVM's ``PopenWorker`` whose process runs ``tvm.exec.popen_worker`` through
        :mod:`tvm_attention._torchless` (``_start``'s POSIX branch, with that command)."""

        def _start(self):
            if self._proc is not None or sys.platform == "win32":
                return super()._start()
            main_read, worker_write = os.pipe()
            worker_read, main_write = os.pipe()
            cmd = [sys.executable, "-m", TORCHLESS, POPEN_WORKER_MODULE, str(worker_read), str(worker_write)]
            self._proc = subprocess.Popen(cmd, pass_fds=(worker_read, worker_write), stdout=self._stdout,
                                          stderr=self._stderr)
            os.close(worker_read)
            os.close(worker_write)
            self._reader = os.fdopen(main_read, "rb")
            self._writer = os.fdopen(main_write, "wb")
            return None

    return TorchlessWorker


@_uses("tvm.support.popen_pool:PopenWorker._start",
       lambda: _require_source("tvm.support.popen_pool", "PopenPoolExecutor._worker_run", "proc = PopenWorker("),
       lambda: _require_source("tvm.support.popen_pool", "PopenWorker._start", "pass_fds=(worker_read, worker_write)",
                               "self._reader = os.fdopen(main_read", "self._writer = os.fdopen(main_write"))
@contextlib.contextmanager
def torchless_workers():
    """While active, the pool workers this process starts run without torch (:mod:`tvm_attention._torchless`):
    ``PopenPoolExecutor._worker_run`` makes each worker by the module's global name
    ``PopenWorker``, which is our subclass meanwhile (nested and concurrent uses count; the last
    one out puts TVM's back). Workers already running keep what they have. If TVM changes
    ``_start`` or ``_worker_run``, the workers import torch again (slower, not wrong): the check
    in :data:`REQUIRES` names it. Checked with TVM 0.27.0.post1."""
    from tvm.support import popen_pool

    with _TORCHLESS_LOCK:
        if _TORCHLESS_DEPTH[0] == 0:
            _TORCHLESS_DEPTH[1] = popen_pool.PopenWorker
            popen_pool.PopenWorker = _torchless_worker_class()
        _TORCHLESS_DEPTH[0] += 1
    try:
        yield
    finally:
        with _TORCHLESS_LOCK:
            _TORCHLESS_DEPTH[0] -= 1
            if _TORCHLESS_DEPTH[0] == 0:
                popen_pool.PopenWorker = _TORCHLESS_DEPTH[1]


def _pool_attrs() -> None:
    from tvm.support.popen_pool import PopenPoolExecutor, PopenWorker

    pool = PopenPoolExecutor(max_workers=1)  # no worker process until the first job
    try:
        pool._worker_map, pool._shutdown, pool._threadpool  # noqa: B018 - their presence is the check
        PopenWorker()._proc  # noqa: B018
    finally:
        pool.shutdown()


@_uses(_pool_attrs)
def pool_worker_processes(pool) -> list:
    """The ``subprocess.Popen`` of each worker a ``PopenPoolExecutor`` started (its
    ``_worker_map`` of ``PopenWorker``, each one's ``_proc``), for the tuner to kill an RPC
    runner's workers stuck on a lost server (``tune.driver._reset_rpc_runner``). If TVM renames
    them, this finds no worker: a hung RPC measurement is then not killed and the tune waits for
    TVM's own session timeout instead. Checked with TVM 0.27.0.post1."""
    procs = []
    for worker in list(getattr(pool, "_worker_map", {}).values()):
        proc = getattr(worker, "_proc", None)
        if proc is not None:
            procs.append(proc)
    return procs


@_uses(_pool_attrs)
def mark_pool_shut_down(pool) -> None:
    """Set a ``PopenPoolExecutor``'s private ``_shutdown`` flag, so that neither a later
    ``shutdown()`` nor its ``__del__`` kills its (already killed) workers again through pipes
    its threads are blocked on. If TVM renames the flag, an abandoned RPC runner's ``__del__``
    may deadlock the tuner on those pipes. Its jobs not started yet are dropped (its
    ``_threadpool``'s ``cancel_futures``): after a worker is killed, its thread would start a
    fresh one (a TVM import) for each, to wait in the tracker's queue for a fleet that is gone
    and hold the process at exit. Checked with TVM 0.27.0.post1."""
    pool._shutdown = True
    pool._threadpool.shutdown(wait=False, cancel_futures=True)


# -- CUDA -------------------------------------------------------------------------------------------
@_uses("tvm.support.nvcc:_ptxas_option_flags")
def ptxas_option_flags() -> list[str] | None:
    """The ptxas options TVM's nvcc path compiles with (``tvm.support.nvcc._ptxas_option_flags``:
    ``--register-usage-level=10``, ...), so that ``cuda_tools``' ptxas report describes the code
    that runs; None when this TVM has no such function (the report then asks ptxas for ``-v``
    only and its register counts may differ from the build's). Checked with TVM 0.27.0.post1."""
    try:
        from tvm.support.nvcc import _ptxas_option_flags
    except ImportError:
        return None
    return list(_ptxas_option_flags())


# -- tensor intrinsics ------------------------------------------------------------------------------
@_uses("tvm.s_tir:TensorIntrin.get", "tvm.s_tir:TensorIntrin.register")
def register_tensor_intrin(name: str, desc, impl):
    """Register the tensor intrinsic ``name`` once per process, and return it.

    TVM's registry is process-wide and refuses a second registration of a name. When ``name``
    is already registered (this module loaded twice, a log reader registering a decode
    intrinsic the scheduler registers too) with the same ``desc`` and ``impl`` (structurally),
    nothing happens; registered with another definition, it raises ``ValueError`` (two
    intrinsics under one name: a tensorize would use either). Any error of TVM's own (a
    ``desc`` that is no PrimFunc) propagates. Uses the public ``TensorIntrin.get(name,
    allow_missing=True)``. Checked with TVM 0.27.0.post1."""
    import tvm_ffi
    from tvm.s_tir import TensorIntrin

    have = TensorIntrin.get(name, allow_missing=True)
    if have is None:
        TensorIntrin.register(name, desc, impl)
        return TensorIntrin.get(name)
    if not (tvm_ffi.structural_equal(have.desc, desc) and tvm_ffi.structural_equal(have.impl, impl)):
        raise ValueError(f"tensor intrinsic {name!r} is already registered with another definition")
    return have


def tensor_intrin_registered(name: str) -> bool:
    """Whether ``name`` is a registered tensor intrinsic (public API; beside
    :func:`register_tensor_intrin` so a caller can skip parsing a definition TVM already has)."""
    from tvm.s_tir import TensorIntrin

    return TensorIntrin.get(name, allow_missing=True) is not None


# -- TVMScript macro expansion ----------------------------------------------------------------------
_MACRO = "tvm.script.parser.core.parser:ScriptMacro"
_macro_lock = threading.Lock()
_macro_depth = 0
#: (owner, attribute, TVM's value) of each swap while the fast ones are in (restored on the
#: outermost exit)
_macro_saved: list[tuple[Any, str, Any]] = []
#: ``Source.as_ast`` results by source text while the fast expansion is active (bounded)
_AST_CACHE: dict[str, Any] = {}
_AST_CACHE_SIZE = 256
#: a macro definition's code object -> the fields of its ``Source`` (the same code object is the
#: same definition: its lines, file and start do not change within a process)
_SOURCE_CACHE: dict[Any, dict[str, Any]] = {}


#: the module whose ``prim_func`` decorator calls ``inspect.stack()`` (its global ``inspect``)
_PRIM_FUNC_ENTRY = "tvm.tirx.script.parser.entry"

REQUIRES["fast_macro_expansion"] = (
    f"{_MACRO}._find_parser_def", f"{_MACRO}.get_macro_def", f"{_MACRO}.parser_object_name",
    lambda: _require_source("tvm.script.parser.core.parser", "ScriptMacro._find_parser_def",
                            "inspect.getouterframes", "ScriptMacro.parser_object_name"),
    lambda: _require_source("tvm.script.parser.core.parser", "ScriptMacro.get_macro_def", "self.source.as_ast()"),
    "tvm.script.parser.core.diagnostics:Source.as_ast",
    lambda: _require_source("tvm.script.parser.core.diagnostics", "Source.as_ast", "return doc.parse(self.source)"),
    # the one place the parser changes a parsed tree: an inline def (never cached, below)
    lambda: _require_source("tvm.tirx.script.parser.parser", "", "def visit_inline_function_def",
                            "node.decorator_list.pop()"),
    f"{_PRIM_FUNC_ENTRY}:inspect",
    lambda: _require_source(_PRIM_FUNC_ENTRY, "prim_func", "outer_stack = inspect.stack()"),
    # what the decorator reads of that stack: frame objects, frames[2]'s line and line number
    lambda: _require_source("tvm.script.parser.core.utils", "is_defined_in_class",
                            "frames[2]", "code_context", "frame_info.lineno"),
    lambda: _require_source("tvm.script.parser.core.utils", "resolve_closure_vars",
                            "frame_info.frame.f_code.co_name", "frame_info.frame.f_locals"),
)


def _stack_lines(context: int = 1) -> list[inspect.FrameInfo]:
    """``inspect.stack(context)`` of the caller, each frame's lines read from ``linecache`` by
    its code's file name: the same frames, line numbers and code lines for code loaded from
    ``.py`` files, without ``inspect.getmodule`` (a walk over ``sys.modules``, thousands of
    modules once torch is imported) run twice per frame."""
    import linecache

    frame = sys._getframe(1)
    out = []
    while frame is not None:
        filename, lineno = frame.f_code.co_filename, frame.f_lineno
        lines, index = None, None
        if context > 0 and lineno is not None:
            start = max(lineno - 1 - context // 2, 0)
            lines = [linecache.getline(filename, n + 1, frame.f_globals) for n in range(start, start + context)]
            lines = [line for line in lines if line] or None
            index = lineno - 1 - start if lines else None
        out.append(inspect.FrameInfo(frame, filename, lineno, frame.f_code.co_name, lines, index))
        frame = frame.f_back
    return out


class _FastStackInspect(types.ModuleType):
    """``inspect`` as TVM's ``prim_func`` decorator sees it while kernels generate: the module
    itself, but :func:`_stack_lines` for ``stack``."""

    def __init__(self):
        super().__init__("inspect")

    def __getattr__(self, name: str):
        return getattr(inspect, name)

    stack = staticmethod(_stack_lines)


@contextlib.contextmanager
def fast_macro_expansion():
    """While active (in any thread), TVMScript's parser takes three shortcuts that return
    exactly what TVM's methods return; on the outermost exit TVM's own
    methods are back. Used around the generation of our kernels (the workload factories), so
    that importing :mod:`tvm_attention` changes nothing in TVM for the rest of the process.

    TVM 0.27's parser does costly things that do not depend on the call, each kernel:

    - ``ScriptMacro._find_parser_def`` looks for the parser up the call stack with
      ``inspect.getouterframes``, which reads a source line for every frame (and calls
      ``inspect.getmodule``, a walk over ``sys.modules``, for each): under pytest, or with torch
      imported, 0.05-0.1 s a call, and one kernel makes 4-10. Walking ``frame.f_back`` finds
      the same frame (the first whose globals hold ``ScriptMacro.parser_object_name``) without
      reading any source.
    - ``ScriptMacro.get_macro_def`` re-parses the macro's source into an AST on every call,
      and the macros of a kernel factory are new objects each time it runs; ``T.prim_func``
      parses its function's source twice (the second time only to have a node to point an
      error at). ``Source.as_ast`` (Python's ``ast.parse``, then the conversion to TVM's doc
      tree: ~70 s of the test suite) returns the tree parsed before for the same source text.
      The parser reads these trees and changes one only for an inline def
      (``visit_inline_function_def``): a source holding the word ``inline`` is parsed afresh.
    - ``T.prim_func`` (as a decorator, and again when the parser evaluates that decorator)
      calls ``inspect.stack()`` for the frames it reads, with the same ``inspect.getmodule``
      walks for every frame: 0.1-0.3 s a kernel under pytest with torch imported, ~100 s of
      the test suite (py-spy, 2026-12-04). While active, that module's ``inspect`` is a proxy
      whose ``stack`` reads the lines from ``linecache`` instead (:func:`_stack_lines`).

    Measured when it was written (cProfile over test_kvcache, test_correctness and
    test_hardening, 2-core Zen 4): 119 s of 360 s in ``getouterframes``, 18 s in
    ``get_macro_def``. If TVM renames either method, nothing is patched and parsing stays as TVM
    wrote it (slower, same IR). Another thread parsing TVMScript while one of ours generates a
    kernel gets the fast methods too: same results. Checked with TVM 0.27.0.post1."""
    global _macro_depth
    with _macro_lock:
        if _macro_depth == 0:
            _install_fast_macros()
        _macro_depth += 1
    try:
        yield
    finally:
        with _macro_lock:
            _macro_depth -= 1
            if _macro_depth == 0:
                _restore_macros()


def fast_macros(fn):
    """``fn`` run under :func:`fast_macro_expansion` (a decorator for kernel factories)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with fast_macro_expansion():
            return fn(*args, **kwargs)

    return wrapper


def _install_fast_macros() -> bool:
    try:
        from tvm.script.parser.core.diagnostics import Source
        from tvm.script.parser.core.parser import ScriptMacro
    except ImportError:  # pragma: no cover - another TVM layout: parse as TVM does
        return False
    if not callable(ScriptMacro.__dict__.get("_find_parser_def")) or not callable(Source.__dict__.get("as_ast")):
        return False  # pragma: no cover - renamed: parse as TVM does
    name = ScriptMacro.parser_object_name
    original_as_ast = Source.__dict__["as_ast"]

    def _find_parser_def(self):
        # the same frames getouterframes lists (this one first), without their source lines
        frame = inspect.currentframe()
        while frame is not None:
            parser = frame.f_globals.get(name)
            if parser is not None:
                return parser
            frame = frame.f_back
        raise RuntimeError(f"{name} not available")

    def as_ast(self):
        text = self.source
        if "inline" in text:  # the parser edits an inline def's tree in place
            return original_as_ast(self)
        tree = _AST_CACHE.get(text)
        if tree is None:
            if len(_AST_CACHE) >= _AST_CACHE_SIZE:
                _AST_CACHE.clear()
            tree = _AST_CACHE[text] = original_as_ast(self)
        return tree

    original_init = Source.__dict__["__init__"]

    def __init__(self, program):
        # a macro's definition is scanned each time its factory runs (T.macro -> scan_macro ->
        # Source): the same code object every time, so the same fields (its lines found by
        # tokenizing the file: ~15 % of test_kvcache's time, 2026-12-07)
        code = None if isinstance(program, str) else getattr(inspect.unwrap(program), "__code__", None)
        if code is None:
            return original_init(self, program)
        fields = _SOURCE_CACHE.get(code)
        if fields is None:
            original_init(self, program)
            if len(_SOURCE_CACHE) >= _AST_CACHE_SIZE:
                _SOURCE_CACHE.clear()
            _SOURCE_CACHE[code] = dict(vars(self))
        else:
            self.__dict__.update(fields)

    entry = sys.modules.get(_PRIM_FUNC_ENTRY) or importlib.import_module(_PRIM_FUNC_ENTRY)
    swaps = [(ScriptMacro, "_find_parser_def", _find_parser_def), (Source, "as_ast", as_ast),
             (Source, "__init__", __init__)]
    if getattr(entry, "inspect", None) is inspect:
        swaps.append((entry, "inspect", _FastStackInspect()))
    _macro_saved.clear()
    for owner, attr, fast in swaps:
        _macro_saved.append((owner, attr, owner.__dict__[attr]))
        setattr(owner, attr, fast)
    return True


def _restore_macros() -> None:
    for owner, attr, tvms in reversed(_macro_saved):
        setattr(owner, attr, tvms)
    _macro_saved.clear()  # (_AST_CACHE stays: the next kernel parses the same sources)


def _require_source(module: str, qualname: str, *texts: str) -> None:
    """Raise unless the source of ``module``'s ``qualname`` holds each of ``texts`` (an
    assumption about what TVM's code does, not only that a name exists); ``qualname`` "": the
    module's own source."""
    obj: Any = importlib.import_module(module)
    for part in filter(None, qualname.split(".")):
        obj = getattr(obj, part)
    source = inspect.getsource(obj)
    for text in texts:
        if text not in source:
            raise AssertionError(f"{module}.{qualname} no longer contains {text!r}")
