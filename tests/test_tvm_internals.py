"""TVM's private API, reached from one module (tvm_attention/tvm_internals.py): each use still
present in the installed TVM, none outside that module, the TVMScript macro shortcut in force
only while our kernels generate, tensor intrinsics registered once without swallowing errors,
and errors in regenerating a log's workload raised, not taken for "no match"."""
import dataclasses
import importlib
import json
import re
from pathlib import Path

import pytest
import tvm
import tvm_ffi

from tvm_attention import tvm_internals
from tvm_attention.spec import AttentionSpec

ROOT = Path(__file__).resolve().parents[1]
SPEC = AttentionSpec(batch=1, heads=2, seq_q=64, seq_kv=96, head_dim=32, causal=True)
PARSER = "tvm.script.parser.core.parser"
MACRO_METHODS = ("_find_parser_def",)


def test_every_private_tvm_name_we_use_is_still_there():
    """After a TVM upgrade this is the test that fails, naming each use that broke (the
    docstrings in tvm_internals say what depends on it); then update the use and CHECKED_WITH."""
    gone = tvm_internals.missing()
    assert not gone, (f"TVM {tvm.__version__} lacks what tvm_internals uses (checked with "
                      f"{tvm_internals.CHECKED_WITH}):\n" + "\n".join(gone))
    # the check itself finds a missing name, a missing module and a changed source
    checks = {"gone_attr": ("tvm.ir:_no_such_name",), "gone_module": ("tvm.no_such_module",),
              "changed": (lambda: tvm_internals._require_source(PARSER, "ScriptMacro.get_macro_def", "no such text"),)}
    saved = dict(tvm_internals.REQUIRES)
    try:
        tvm_internals.REQUIRES.update(checks)
        found = tvm_internals.missing()
    finally:
        tvm_internals.REQUIRES.clear()
        tvm_internals.REQUIRES.update(saved)
    assert [line.split(":")[0] for line in found] == list(checks), found


def test_every_use_is_declared_and_no_other_module_reaches_into_tvm():
    """Every reach of tvm_internals has its check (REQUIRES), and no other module of the package
    imports a private TVM name or touches a private attribute of TVM's classes."""
    here = tvm_internals.__name__
    public = {n for n, v in vars(tvm_internals).items()
              if not n.startswith("_") and (callable(v) or n.isupper()) and getattr(v, "__module__", here) == here}
    helpers = {"missing", "fast_macros", "tensor_intrin_registered", "CHECKED_WITH", "REQUIRES", "TORCHLESS"}
    assert public - helpers == set(tvm_internals.REQUIRES)
    private = re.compile(r"from tvm[\w.]* import [^\n]*\b_[a-z]\w*"  # from tvm.x import _name
                         r"|\btvm(?:\.\w+)*\._[a-z]\w*"  # tvm.x._name
                         r"|\._cls\b|\._worker_map\b|\._shutdown\b|\._proc\b"  # TVM's classes' own attributes
                         r"|sys\.modules\[[\"']tvm|ScriptMacro|TensorIntrin\.register")
    found = []
    for folder in ("tvm_attention", "schedules"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.name == "tvm_internals.py":
                continue
            for i, line in enumerate(path.read_text().splitlines(), 1):
                if private.search(line.split("#")[0]):  # code, not a comment
                    found.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not found, "\n".join(found)


def _macro_methods_are_tvms() -> bool:
    import inspect

    from tvm.script.parser.core.parser import ScriptMacro
    from tvm.tirx.script.parser import entry

    from tvm.script.parser.core.diagnostics import Source

    return (all(getattr(ScriptMacro, n).__module__ == PARSER for n in MACRO_METHODS) and entry.inspect is inspect
            and Source.as_ast.__module__ == "tvm.script.parser.core.diagnostics")


def test_fast_stack_is_inspects_stack():
    """The prim_func decorator's ``inspect.stack()`` under the shortcut lists the same frames,
    files, line numbers, functions and code lines as Python's (here, under pytest: deep, with a
    frame of eval'd code that has no source)."""
    import inspect

    def both():
        return inspect.stack(), tvm_internals._stack_lines()

    slow, fast = eval("both()", {"both": both})
    slow, fast = slow[1:], fast[1:]  # both()'s own line differs (one call per line)
    assert len(slow) == len(fast) > 10
    for a, b in zip(slow, fast):
        assert (a.frame, a.filename, a.lineno, a.function, a.code_context, a.index) == \
            (b.frame, b.filename, b.lineno, b.function, b.code_context, b.index)
    assert any(a.code_context is None for a in slow)  # the eval'd frame


def test_macro_shortcut_only_while_kernels_generate(monkeypatch):
    """Importing the package leaves TVMScript as TVM wrote it; the shortcut is in only inside
    fast_macro_expansion (nested, and through an exception), and a build leaves it out again."""
    from tvm.script.parser.core.parser import ScriptMacro

    from tvm_attention.build import build_kernel
    from tvm_attention.workloads import fused_attention

    importlib.import_module("tvm_attention.workloads")
    importlib.import_module("tvm_attention.schedules")
    assert _macro_methods_are_tvms()
    own = {n: ScriptMacro.__dict__[n] for n in MACRO_METHODS}
    with tvm_internals.fast_macro_expansion():
        assert not _macro_methods_are_tvms()
        with tvm_internals.fast_macro_expansion():
            pass
        assert not _macro_methods_are_tvms()  # the inner exit leaves the outer's in force
    assert {n: ScriptMacro.__dict__[n] for n in MACRO_METHODS} == own
    with pytest.raises(ZeroDivisionError):
        with tvm_internals.fast_macro_expansion():
            1 / 0
    assert _macro_methods_are_tvms()

    seen = []
    real = tvm_internals._install_fast_macros

    def install():
        seen.append(real())
        return seen[-1]

    monkeypatch.setattr(tvm_internals, "_install_fast_macros", install)
    fused_attention(SPEC, 32, 32)
    assert seen == [True]  # the workload generated under the shortcut
    assert _macro_methods_are_tvms()
    build_kernel(dataclasses.replace(SPEC, seq_kv=80))
    assert _macro_methods_are_tvms()


def test_macro_shortcut_gives_tvms_ir():
    """The shortcut's IR is TVM's own, for a prefill (the tile macros), a paged decode step (the
    tiers) and varlen; the factories' undecorated form parses with TVM's methods."""
    from tvm_attention.workloads import fused_attention

    specs = [AttentionSpec(batch=1, heads=2, seq_q=96, seq_kv=160, head_dim=64, causal=True),
             AttentionSpec(batch=2, heads=4, kv_heads=2, seq_q=1, seq_kv=256, head_dim=64, layout="paged",
                           page_size=16),
             AttentionSpec(batch=2, heads=2, seq_q=64, head_dim=32, layout="varlen", causal=True)]
    fast = [fused_attention(s, 32, 64) for s in specs]
    slow = [fused_attention.__wrapped__(s, 32, 64) for s in specs]
    assert _macro_methods_are_tvms()
    for s, a, b in zip(specs, fast, slow):
        assert tvm_ffi.structural_equal(a, b), s.short_name()


def test_tensor_intrinsics_register_once_and_errors_surface():
    """Registering a name again with the same definition is a no-op (a module loaded twice);
    with another definition, or a malformed one, it raises."""
    from tvm.s_tir import TensorIntrin

    from tvm_attention.schedules import cpu_decode

    first = TensorIntrin.get(cpu_decode.dot_intrinsic(32, 2))
    other = TensorIntrin.get(cpu_decode.dot_intrinsic(32, 4))
    name = "tvma_test_dot"
    got = tvm_internals.register_tensor_intrin(name, first.desc, first.impl)
    assert tvm_internals.register_tensor_intrin(name, first.desc, first.impl).same_as(got)
    assert tvm_internals.tensor_intrin_registered(name)
    with pytest.raises(ValueError, match="already registered with another definition"):
        tvm_internals.register_tensor_intrin(name, other.desc, other.impl)
    with pytest.raises(TypeError):
        tvm_internals.register_tensor_intrin("tvma_test_malformed", "not a PrimFunc", first.impl)
    assert not tvm_internals.tensor_intrin_registered("tvma_test_malformed")
    # the scheduler's own registration, made again as another load of its module would
    saved = set(cpu_decode._REGISTERED)
    cpu_decode._REGISTERED.clear()
    try:
        assert cpu_decode.dot_intrinsic(32, 2) == "attn_decode_dot_d32_r2"
    finally:
        cpu_decode._REGISTERED.update(saved)


def test_regenerate_raises_a_generator_bug_and_refuses_a_foreign_record(monkeypatch):
    """A record of spec's own kernel whose workload fails to generate raises (a bug is no "log
    not usable"); a record of another spec's kernel, or a function that is no workload of ours,
    is None without being generated."""
    from tvm_attention import task_mods
    from tvm_attention.workloads import fused_attention

    func = fused_attention(SPEC, 32, 32)
    assert tvm_ffi.structural_equal(task_mods.regenerate(SPEC, func), task_mods.normalize(func))
    other = dataclasses.replace(SPEC, seq_kv=128)
    plain = func.without_attr("attn.workload")

    def broken(*a, **k):
        raise RuntimeError("a bug in the workload")

    monkeypatch.setattr(task_mods.cpu_fused, "workload", broken)
    with pytest.raises(RuntimeError, match="a bug in the workload"):
        task_mods.regenerate(SPEC, func)
    assert task_mods.regenerate(other, func) is None
    assert task_mods.regenerate(SPEC, plain) is None


def test_a_bug_registering_a_logged_intrinsic_is_no_bad_line(tmp_path, monkeypatch):
    """Reading a log registers the decode intrinsics its records name; an error there is raised,
    not reported as an undecodable line and skipped."""
    from tvm.s_tir import meta_schedule as ms

    from tvm_attention import logs
    from tvm_attention.schedules import cpu_decode
    from tvm_attention.task_mods import normalize
    from tvm_attention.workloads import fused_attention

    wl = ms.database.Workload(normalize(fused_attention(SPEC, 32, 32)))
    (tmp_path / logs.WORKLOAD_FILE).write_text(json.dumps(wl.as_json()) + "\n")
    (tmp_path / logs.RECORD_FILE).write_text('[0, ["sample_categorical attn_decode_dot_d32_r2"]]\n')
    skipped = []
    parsed = logs.parse_logs(tmp_path, on_bad_line=skipped.append)  # a bad record: skipped, as before
    assert not parsed.records and len(skipped) == 1 and "cannot be decoded" in skipped[0]

    def broken(*a, **k):
        raise RuntimeError("a bug in the intrinsic")

    monkeypatch.setattr(cpu_decode, "dot_intrinsic", broken)
    with pytest.raises(RuntimeError, match="a bug in the intrinsic"):
        logs.parse_logs(tmp_path, on_bad_line=skipped.append)



def test_bf16_intrinsics_register_when_scheduled_or_logged_not_at_import(tmp_path):
    """Importing the schedules parses no tensor intrinsic (cpu_bf16's four TVMScript definitions
    cost every process ~1 s); a log whose record names them registers them before decoding it,
    so a fresh process can decode a bf16 dot-product record (a resumed tune, ``build``)."""
    import subprocess
    import sys

    from tvm.s_tir import meta_schedule as ms

    from tvm_attention import logs
    from tvm_attention.schedules import cpu_bf16
    from tvm_attention.task_mods import normalize
    from tvm_attention.workloads import fused_attention

    wl = ms.database.Workload(normalize(fused_attention(SPEC, 32, 32)))
    (tmp_path / logs.WORKLOAD_FILE).write_text(json.dumps(wl.as_json()) + "\n")
    (tmp_path / logs.RECORD_FILE).write_text(json.dumps([0, [f"tensorize {cpu_bf16.DP} {cpu_bf16.ILV}"]]) + "\n")
    probe = f"""
from tvm_attention import logs, tvm_internals
from tvm_attention.build import build_kernel
from tvm_attention.schedules import cpu_bf16
names = (cpu_bf16.DP, cpu_bf16.ILV)
assert not any(tvm_internals.tensor_intrin_registered(n) for n in names), "registered at import"
skipped = []
logs.parse_logs({str(tmp_path)!r}, on_bad_line=skipped.append)  # a malformed trace: skipped after registering
assert len(skipped) == 1 and "cannot be decoded" in skipped[0], skipped
assert all(tvm_internals.tensor_intrin_registered(n) for n in names), "not registered by the log"
"""
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


def test_pool_workers_run_without_torch_only_inside_torchless_workers():
    """The tuner's workers (``_workers_spawn`` → ``torchless_workers``) start through
    ``tvm_attention._torchless``, where ``import torch`` fails as if it were not installed; a pool
    started outside keeps TVM's plain worker (with torch where it is installed)."""
    import importlib.util

    from tvm.support import popen_pool

    def _torch_in_worker():  # nested: cloudpickle sends it by value (the worker cannot import tests)
        import os
        import sys

        try:
            import torch  # noqa: F401
            ok = True
        except ImportError:
            ok = False
        return open(f"/proc/{os.getpid()}/cmdline").read().split("\0"), ok, sys.argv

    plain = popen_pool.PopenWorker
    with tvm_internals.torchless_workers(), tvm_internals.torchless_workers():  # nested: counted
        pool = popen_pool.PopenPoolExecutor(max_workers=1)
        cmd, torch_ok, argv = pool.submit(_torch_in_worker).result()
        pool.shutdown()
    assert popen_pool.PopenWorker is plain  # TVM's class is back after the last context
    assert cmd[1:4] == ["-m", tvm_internals.TORCHLESS, tvm_internals.POPEN_WORKER_MODULE] and not torch_ok
    assert len(argv) == 3  # popen_worker's own argv: the module, its two pipe fds
    if importlib.util.find_spec("torch") is not None:
        pool = popen_pool.PopenPoolExecutor(max_workers=1)
        cmd, torch_ok, _ = pool.submit(_torch_in_worker).result()
        pool.shutdown()
        assert cmd[1:3] == ["-m", tvm_internals.POPEN_WORKER_MODULE] and torch_ok


def test_the_program_keeps_torch_out_of_its_compiling_commands_only():
    import subprocess
    import sys

    probe = ("import sys; from tvm_attention import cli; sys.argv = ['tvm-attention', *sys.argv[1:]]\n"
             "try:\n    cli.entry()\nexcept SystemExit:\n    pass\n"
             "print('TORCH', 'torch' in sys.modules and sys.modules['torch'] is None)")
    for argv, blocked in ((["inspect", "/nonexistent-artifact"], True), (["bench", "--help"], False)):
        out = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True, timeout=120).stdout
        assert f"TORCH {blocked}" in out, out[-500:]
    from tvm_attention import cli

    for command in cli.TORCHLESS_COMMANDS:  # each one a command of the program
        with pytest.raises(SystemExit) as e:
            cli.parse_args([command, "--help"])
        assert e.value.code == 0
