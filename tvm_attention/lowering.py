"""Final lowering: the IR codegen receives, kept so it can be audited and printed.

``lower_final`` repeats exactly what ``tvm.tirx.build`` does (bind target, run the TIR pipeline,
split host/device, finalize) and keeps the result; ``codegen`` then turns that same IR into a
runtime module, so what we audit is what runs.
"""
from __future__ import annotations

import dataclasses

import tvm
from tvm.target import Target
from tvm.tirx.build import split_host_device_mods, tir_to_runtime
from tvm_ffi import DLDeviceType


@dataclasses.dataclass
class LoweredModule:
    """The final lowered IR: one host module plus a module per device target."""

    host: tvm.IRModule
    devices: dict  # Target -> IRModule
    target_host: Target

    def all_modules(self) -> list[tvm.IRModule]:
        return [self.host, *self.devices.values()]

    def script(self) -> str:
        parts = [f"# host target: {self.target_host}\n", self.host.script()]
        for tgt, mod in self.devices.items():
            parts.append(f"\n# device target: {tgt}\n")
            parts.append(mod.script())
        return "".join(parts)


def lower_final(mod: tvm.IRModule | tvm.tirx.PrimFunc, target: Target) -> LoweredModule:
    """Lower ``mod`` for ``target`` through the full default TIR pipeline and finalization."""
    if isinstance(mod, tvm.tirx.PrimFunc):
        mod = tvm.IRModule.from_expr(mod)
    target = Target(target)
    if target.host is not None:
        target_host = Target(target.host)
    elif target.get_target_device_type() == DLDeviceType.kDLCPU:
        target_host = target
    else:
        target_host = Target("llvm")
    mod = tvm.tirx.transform.BindTarget(target.with_host(target_host))(mod)
    pipeline, finalize_host, finalize_device = tvm.tirx.get_tir_pipeline("default")
    mod = pipeline(mod)
    host, devices = split_host_device_mods(mod)
    host = finalize_host()(host)
    devices = {t: finalize_device()(m) for t, m in devices.items()}
    return LoweredModule(host=host, devices=devices, target_host=target_host)


def codegen(lowered: LoweredModule) -> tvm.runtime.Module:
    """Generate the runtime module from already-lowered IR (no second lowering)."""
    return tir_to_runtime(lowered.host, lowered.devices, lowered.target_host)
