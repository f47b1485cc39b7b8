"""Target resolution (``tvm_attention.target.resolve_target``): what a user types, refused by name
when malformed (issue 62: ``num-cores``)."""
from __future__ import annotations

import json
import re

import pytest
from tvm.target import Target

from tvm_attention.target import MAX_NUM_CORES, TargetError, resolve_target

#: an LLVM target naming its CPU (a vendor-neutral AVX2 one; nothing here is built or run)
CPU = {"kind": "llvm", "mcpu": "x86-64-v3"}


@pytest.mark.parametrize("value", [99999999999, MAX_NUM_CORES + 1, 2**31, 0, -2, True, 2.0, "4", None])
def test_num_cores_must_be_a_positive_int_within_the_bound(value):
    """A core count sizes split-KV's tasks and MetaSchedule's parallel extents (C ints) and names
    the tuning logs' folder: 99999999999 was accepted as is. Refused by name in every form a
    target takes: a dict, JSON text, a CUDA target's host, a built Target, the num_cores argument."""
    want = rf"num-cores must be an int in \[1, {MAX_NUM_CORES}\].*got {re.escape(repr(value))}"
    forms = [{**CPU, "num-cores": value}, {"kind": "cuda", "arch": "sm_90", "host": {**CPU, "num-cores": value}}]
    if not isinstance(value, str) and value is not None:
        forms.append(json.dumps({**CPU, "num-cores": value}))
    if isinstance(value, int) and not isinstance(value, bool):  # what TVM takes itself
        forms.append(Target({**CPU, "num-cores": value}))
        for form in ("llvm", CPU):
            with pytest.raises(TargetError, match=want.replace("num-cores", "num_cores")):
                resolve_target(form, num_cores=value)
    for form in forms:
        with pytest.raises(TargetError, match=want):
            resolve_target(form)


def test_num_cores_within_the_bound_is_kept():
    for n in (1, 2, MAX_NUM_CORES):
        assert int(resolve_target({**CPU, "num-cores": n}).attrs["num-cores"]) == n
        assert int(resolve_target("llvm", num_cores=n).attrs["num-cores"]) == n
    host = resolve_target("cuda", arch="sm_90", num_cores=3).host
    assert int(host.attrs["num-cores"]) == 3


def test_the_default_target_takes_every_feature_the_host_has_and_none_it_lacks(monkeypatch):
    """``"llvm"`` names the host's model and adds (``+f``) what /proc/cpuinfo shows beyond it, AMX
    included, and turns off (``-f``) what the model has and the host lacks: a VM that names an
    older model (LLVM calls a Sapphire Rapids VM ``rocketlake``, without AVX512-BF16, AVX512-FP16,
    AVX-VNNI or AMX) still gets its CPU's features. Here the host is named ``haswell`` (AVX2), a
    model older than any this project runs on, and then given AMX's flags."""
    from tvm_attention import hostcpu, target
    from tvm_attention.target import cpu_features, resolve_target

    monkeypatch.delenv("TVM_ATTENTION_HOST_CPU", raising=False)  # the host as it is (the suite may run as AVX2)
    real = resolve_target("llvm")
    assert set(hostcpu.host_features()) <= set(cpu_features(real)) and not hostcpu.missing_features(cpu_features(real))
    monkeypatch.setattr(target, "host_cpu", lambda: "haswell")
    old = resolve_target("llvm")
    assert str(old.attrs["mcpu"]) == "haswell"
    assert set(hostcpu.host_features()) <= set(cpu_features(old)) and not hostcpu.missing_features(cpu_features(old))
    assert [f"+{f}" for f in hostcpu.extra_features(hostcpu.KNOWN_CPUS["haswell"].split())] == \
        [str(a) for a in old.attrs.get("mattr", []) if str(a).startswith("+")]
    # a host with AMX: its tile features are the target's, recorded as the code's (cpu_features),
    # so that a host without them refuses the code by name
    flags = hostcpu._cpuinfo_flags() or frozenset()
    monkeypatch.setattr(hostcpu, "_cpuinfo_flags", lambda: flags | {"amx_tile", "amx_bf16", "amx_int8", "avx2", "fma"})
    amx = resolve_target("llvm")
    assert {"+amx-tile", "+amx-bf16", "+amx-int8"} <= {str(a) for a in amx.attrs["mattr"]}
    assert {"amx-tile", "amx-bf16", "amx-int8"} <= set(cpu_features(amx))
    monkeypatch.setattr(hostcpu, "_cpuinfo_flags", lambda: flags - {"amx_tile", "amx_bf16", "amx_int8"})
    with pytest.raises(hostcpu.HostCPUError, match="amx-bf16, amx-int8, amx-tile.*SIGILL"):
        target.check_target_runnable(amx)


def test_an_override_model_gets_nothing_beyond_its_features(monkeypatch):
    """``TVM_ATTENTION_HOST_CPU=x86-64-v3`` runs the process as an AVX2 host: the default target
    adds nothing (the host has that model's features at most)."""
    from tvm_attention.target import resolve_target

    monkeypatch.setenv("TVM_ATTENTION_HOST_CPU", "x86-64-v3")
    t = resolve_target("llvm")
    assert str(t.attrs["mcpu"]) == "x86-64-v3" and not any(str(a).startswith("+") for a in t.attrs.get("mattr", []))


@pytest.mark.parametrize("rate, dots", [(0.49, False), (2.0, True), (None, True)])
def test_bf16_presets_follow_the_measured_balance_of_dots_and_fmas(monkeypatch, rate, dots):
    """The bf16 prefill preset takes the dot-product form (``dot_bf16``), and a decode step's
    ``decode_dot`` (2 for a bf16 cache, 1 for an 8-bit one), only where this host's vdpbf16ps
    outrun its FMAs (``cpu_balance``: 0.49 measured on a Sapphire Rapids VM, about 2 on a Zen 4),
    or, for code this host does not run as its own (None), wherever the target has AVX512-BF16."""
    from tvm_attention.schedules import cpu_balance, cpu_fused
    from tvm_attention.spec import AttentionSpec
    from tvm_attention.target import resolve_target

    monkeypatch.setattr(cpu_balance, "dot_to_fma_rate", lambda target: rate)
    zen4 = resolve_target({"kind": "llvm", "mcpu": "znver4", "num-cores": 2})
    prefill = AttentionSpec(batch=1, heads=8, seq_q=2048, head_dim=64, dtype="bfloat16")
    decode = AttentionSpec(batch=4, heads=32, kv_heads=8, seq_q=1, seq_kv=4096, head_dim=128, dtype="bfloat16",
                           layout="kvcache", causal=True)
    assert cpu_fused.preset(prefill, zen4).dot_bf16 == int(dots)
    assert cpu_fused.preset(decode, zen4).decode_dot == 2 * dots
    assert cpu_fused.preset(AttentionSpec(**{**decode.to_dict(), "kv_dtype": "int8"}), zen4).decode_dot == int(dots)
    # AVX2: no dot products, whatever the balance
    assert cpu_fused.preset(prefill, resolve_target({"kind": "llvm", "mcpu": "x86-64-v3"})).dot_bf16 == 0


def test_the_balance_is_measured_only_for_this_hosts_own_code():
    """``dot_to_fma_rate``: None for another model's code (cross-compiled); for the default target
    of a host with AVX512-BF16, a positive finite ratio of one core's FLOP rates."""
    import math

    from tvm_attention.schedules import cpu_balance
    from tvm_attention.target import host_cpu, resolve_target, target_features

    other = "znver4" if host_cpu() != "znver4" else "icelake-server"
    assert cpu_balance.dot_to_fma_rate(resolve_target({"kind": "llvm", "mcpu": other})) is None
    here = resolve_target("llvm")
    if "avx512bf16" in target_features(here):
        rate = cpu_balance.dot_to_fma_rate(here)
        assert rate is not None and math.isfinite(rate) and rate > 0
        assert cpu_balance.dots_outrun_fmas(here) == (rate > cpu_balance.DOTS_OVER_FMAS)
    else:
        assert not cpu_balance.dots_outrun_fmas(here)
    assert cpu_balance.zmm_to_ymm_rate(resolve_target({"kind": "llvm", "mcpu": other})) is None
    if "avx512f" in target_features(here):
        rate = cpu_balance.zmm_to_ymm_rate(here)
        assert rate is not None and 0.5 < rate < 3  # 2.0 Sapphire Rapids, 1.0 Zen 4
        assert cpu_balance.wide_fmas(here) == (rate > cpu_balance.WIDE_OVER_HALVES)
    else:
        assert cpu_balance.zmm_to_ymm_rate(here) is None and not cpu_balance.wide_fmas(here)


@pytest.mark.parametrize("rate, rows", [(2.0, 64), (1.0, 32), (None, 32)])
def test_fp32_row_tiles_follow_the_measured_width_of_the_fmas(monkeypatch, rate, rows):
    """fp32 prefill takes 64-row tiles where the host's zmm FMAs run at twice the FLOP rate of
    its ymm ones (Intel: two full-width FMA ports), 32 where they are split in halves (Zen 4) or
    not measured (another model's code)."""
    from tvm_attention.schedules import cpu_balance, cpu_fused
    from tvm_attention.spec import AttentionSpec
    from tvm_attention.target import resolve_target

    monkeypatch.setattr(cpu_balance, "zmm_to_ymm_rate", lambda target: rate)
    avx512 = resolve_target({"kind": "llvm", "mcpu": "skylake-avx512", "num-cores": 2})
    for d in (64, 128):
        assert cpu_fused.preset(AttentionSpec(batch=1, heads=8, seq_q=2048, head_dim=d), avx512).block_m == rows
    assert cpu_fused.preset(AttentionSpec(batch=1, heads=8, seq_q=2048, head_dim=64),
                            resolve_target({"kind": "llvm", "mcpu": "x86-64-v3"})).block_m == 32
