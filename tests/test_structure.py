"""The house rules the code keeps (scripts/check_structure.py measures them): no import cycle
between project modules, counting the imports that function bodies hide, and each of those
imports says why; no function over 150 lines; the build path reads tuning logs without the tuner."""
import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("check_structure", ROOT / "scripts" / "check_structure.py")
check = importlib.util.module_from_spec(_spec)
sys.modules["check_structure"] = check  # dataclasses look their module up there
_spec.loader.exec_module(check)


def test_no_import_cycle_between_project_modules():
    assert check.cycles(check.imports()) == []


def test_no_function_over_150_lines():
    assert check.long_functions(150) == []


def test_every_function_local_project_import_says_why():
    bare = [f"{i.module}:{i.line} imports {i.target}" for i in check.imports() if i.local and not i.commented]
    assert not bare, "function-local imports without a comment saying why:\n" + "\n".join(bare)


def test_a_cycle_hidden_in_a_function_is_found(tmp_path):
    pkg = tmp_path / "tvm_attention"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import g\n\n\ndef f():\n    return g()\n")
    (pkg / "b.py").write_text(textwrap.dedent("""\
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            from .c import C  # never runs: not an edge


        def g():
            from .a import f  # the hidden half of the cycle
            return f
        """))
    (pkg / "c.py").write_text("from .b import g\n")
    found = check.imports(tmp_path)
    assert check.cycles(found) == [["tvm_attention.a", "tvm_attention.b"]]
    hidden = [i for i in found if i.local]
    assert [(i.module, i.target, i.commented) for i in hidden] == [("tvm_attention.b", "tvm_attention.a", True)]


def test_pyproject_lists_every_package_of_the_tree():
    """pyproject.toml lists its packages (schedules/ installs as ``tvm_attention.schedules`` and
    tuning_logs/ as ``tvm_attention.tuning_logs``, which discovery cannot map): a new package folder
    must be added there, or an installed package would miss it. Its package-dir table is what
    ``tvm_attention._checkout`` maps when the package runs from a checkout, and what
    scripts/check_structure.py names the modules by; nothing installs as a top-level package but
    ``tvm_attention`` (a top-level ``schedules`` was shadowed by any schedules.py in the user's folder)."""
    import tomllib

    from tvm_attention._checkout import PACKAGE_DIRS

    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapped = conf.get("package-dir", {})
    assert mapped == PACKAGE_DIRS
    assert {f: p for f, p in check.PACKAGES.items() if f != "tvm_attention"} == \
        {f: p for p, f in mapped.items() if (ROOT / f / "__init__.py").exists()}
    found = {".".join(("tvm_attention", *p.parent.relative_to(ROOT / "tvm_attention").parts))
             for p in (ROOT / "tvm_attention").rglob("__init__.py")}
    for package, folder in mapped.items():
        found |= {".".join((package, *p.parent.relative_to(ROOT / folder).parts))
                  for p in (ROOT / folder).rglob("__init__.py")}
    assert set(conf["packages"]) == found | set(mapped)
    assert {p.split(".")[0] for p in conf["packages"]} == {"tvm_attention"}


def test_build_reads_a_tuning_log_without_importing_the_tuner():
    # build_best on a committed log in a fresh process: on the CPU it was tuned on, its best
    # record is replayed and timed against the hand build; elsewhere no record is for this
    # target (LogNotUsable, after every workload was regenerated and compared)
    log = sorted((ROOT / "tuning_logs").glob("*/b1_h8_kv8_q1024_k1024_d64_float32_causal"))[0]
    code = textwrap.dedent(f"""\
        import sys
        from tvm_attention.pipeline import LogNotUsable, build_best
        from tvm_attention.spec import AttentionSpec
        try:
            build_best(AttentionSpec(batch=1, heads=8, seq_q=1024, head_dim=64, causal=True), log_dir={str(log)!r})
        except LogNotUsable:
            pass
        tuner = sorted(m for m in sys.modules if m.startswith("tvm_attention.tune"))
        assert not tuner, tuner
        """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_a_schedules_workload_kinds_are_what_its_families_build():
    """``WORKLOAD_KINDS`` (how a tuning log's records are matched to a schedule) names the
    ``attn.workload`` of every function each family builds, on every target it has."""
    from tvm_attention.schedules import SCHEDULES, WORKLOAD_KINDS
    from tvm_attention.spec import AttentionSpec
    from tvm_attention.target import resolve_target

    assert set(WORKLOAD_KINDS) == set(SCHEDULES)
    targets = {"cpu": resolve_target("llvm"), "cuda": resolve_target("cuda", arch="sm_90")}
    for name, by_target in SCHEDULES.items():
        for where, family in by_target.items():
            dtype = "float16" if where == "cuda" else "float32"
            spec = AttentionSpec(batch=1, heads=2, seq_q=64, head_dim=64, dtype=dtype)
            if spec.layout not in family.CAPABILITIES.layouts:  # the MLA kernel: its latent layouts
                spec = AttentionSpec(batch=1, heads=16, seq_q=1, head_dim=64, head_dim_v=32, scale=0.1, dtype=dtype,
                                     layout=family.CAPABILITIES.layouts[0])
            func = family.workload(spec, family.preset(spec, targets[where]))
            assert str(func.attrs["attn.workload"]) in WORKLOAD_KINDS[name], (name, where)


def test_every_registered_family_implements_the_protocol():
    from tvm_attention.schedules import SCHEDULES
    from tvm_attention.schedules.family import Capabilities, Family

    for name, by_target in SCHEDULES.items():
        for target, family in by_target.items():
            assert isinstance(family, Family), f"{name} on {target}: {family.__name__} misses a member of Family"
            assert isinstance(family.CAPABILITIES, Capabilities)
            assert family.CAPABILITIES.target == target, (name, target)


def test_capabilities_refuse_in_one_format():
    from tvm_attention.schedules import cpu_materialized, cpu_rowcache, cuda_mma
    from tvm_attention.spec import AttentionSpec

    base = dict(batch=1, heads=2, seq_q=64, head_dim=64)
    cases = [
        (cpu_rowcache, dict(return_lse=True), "the rowcache schedule does not write lse (--return-lse): use --schedule "
                                             "fused on a CPU (llvm) target"),
        (cpu_materialized, dict(layout="paged", seq_q=1),
         "the materialized schedule builds layout(s) bhsd, not 'paged': use --schedule fused on a CPU (llvm) target"),
        (cpu_materialized, dict(dtype="float16"), "the materialized schedule builds dtype(s) float32, not 'float16'"),
        (cpu_rowcache, dict(dynamic=("seq_q",)), "the rowcache schedule has no symbolic-shape build (seq_q given as "
                                                "dyn): give static lengths, or use --schedule fused"),
        (cuda_mma, dict(), "the CUDA tensor-core fused schedule builds dtype(s) float16, bfloat16, not 'float32': use "
                           "--schedule fused_simt, or use --schedule fused on a CPU (llvm) target"),
    ]
    for family, over, message in cases:
        why = family.CAPABILITIES.refusal(AttentionSpec(**{**base, **over}))
        assert why is not None and why.startswith(message), why
    assert cpu_materialized.CAPABILITIES.refusal(AttentionSpec(**base, dynamic=("seq_q",))) is None


def test_every_public_name_imports_from_the_package():
    """``tvm_attention.__all__`` holds every public function the package defines (its docstring's
    Public API), and each of its names imports (``from tvm_attention import *`` binds them all)."""
    import inspect

    import tvm_attention

    defined = {n for n, v in vars(tvm_attention).items()
               if not n.startswith("_") and inspect.isfunction(v) and v.__module__ == "tvm_attention"}
    assert defined <= set(tvm_attention.__all__), f"public but not in __all__: {defined - set(tvm_attention.__all__)}"
    assert {"merge_states", "quantize_kv"} <= set(tvm_attention.__all__)
    names: dict = {}
    exec("from tvm_attention import *", names)
    assert set(tvm_attention.__all__) <= set(names)
    for name in tvm_attention.__all__:
        assert name in tvm_attention.__doc__ or name == "__version__", f"{name} is not in the Public API docstring"


def test_design_doc_names_every_module():
    """docs/design.md's module map names every module of the package and of schedules/ (a new
    module gets its line there)."""
    design = (ROOT / "docs" / "design.md").read_text()
    missing = [str(p.relative_to(ROOT)) for folder in check.PACKAGES for p in sorted((ROOT / folder).rglob("*.py"))
               if f"`{p.relative_to(ROOT)}`" not in design]
    assert not missing, "modules docs/design.md does not name (add a line to its module map):\n" + "\n".join(missing)
