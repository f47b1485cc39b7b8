"""The cascade on the CUDA kernels (issue 65, item 5): the prefix pass (the stacked queries of every
sequence, non-causal, what hides prefix keys as custom-mask bits, ALiBi and the modifiers reading
each stacked row's position from the ``cascade_*`` tensors) and the suffix pass (the serving
kernel with lse, its modifiers shifted by the prefix's length, appending its new keys) built by
the SIMT and mma.sync kernels, emulated on the CPU, run by ``cascade.attend`` with torch tensors
(the merge in torch's ops: on a GPU the states stay there), against the float64 reference."""
from __future__ import annotations

import numpy as np
import pytest
import tvm

from tvm_attention import cascade
from tvm_attention.loader import AttentionKernel
from tvm_attention.validate import TOLERANCES
from tvm_attention.workloads.fused_cuda import fused_attention_cuda
from tvm_attention.workloads.fused_mma import fused_attention_mma

from test_cascade import VARIANT_CASES, check_variant_outputs, variant_inputs, variant_spec
from test_cuda import EMULATION_TARGET

torch = pytest.importorskip("torch")


def emulated(spec, kernel: str) -> AttentionKernel:
    """``spec``'s kernel of the CUDA family ``kernel`` (``simt``: 16×16 tiles, 4 rows a thread;
    ``mma``: 2 warps, 16-key tiles, 2 stages), compiled for the CPU's emulation, behind the loader."""
    func = (fused_attention_cuda(spec, 16, 16, 4, emulate=True) if kernel == "simt"
            else fused_attention_mma(spec, 2, 16, 2, 1, emulate=True))
    return AttentionKernel(spec, tvm.compile(func, target=EMULATION_TARGET)["attention"])


#: (kernel, dtype, variant case): the CUDA-core kernel in float32 on the page pool that appends with
#: both modifiers, key bounds and a custom mask; tensor cores in float16 on the contiguous cache
#: with a window (its prefix bits), ALiBi (a prefix modifier), kv_start, softcap and sinks
CASES = [("simt", "float32", VARIANT_CASES[1]), ("mma", "float16", VARIANT_CASES[0])]


@pytest.mark.parametrize("kernel, dtype, case", CASES, ids=["simt-paged-append-mods-bounds-mask",
                                                             "mma-kvcache-window-alibi-kvstart"])
def test_cuda_kernels_serve_the_cascade(kernel, dtype, case):
    spec = variant_spec(*case, dtype=dtype)
    kp, ks = emulated(cascade.prefix_spec(spec), kernel), emulated(cascade.suffix_spec(spec), kernel)
    x = variant_inputs(spec)
    t = lambda a: torch.from_numpy(np.asarray(a)).clone()  # noqa: E731 - torch's (aligned) copy: append writes it
    prefix, suffix = tuple(map(t, x[1])), tuple(map(t, x[2]))
    args = {k: [t(m) for m in v] if isinstance(v, list) else t(v) for k, v in x[3].items()}
    o, lse = cascade.attend(kp, ks, t(x[0]), prefix, suffix, sinks=None if x[4] is None else t(x[4]), **args)
    assert isinstance(o, torch.Tensor) and o.dtype == t(x[0]).dtype
    atol, rtol = TOLERANCES[dtype]
    check_variant_outputs(spec, (x[0], tuple(a.numpy() for a in prefix), tuple(a.numpy() for a in suffix), x[3], x[4]),
                          o.float().numpy(), lse.numpy(), atol=atol, rtol=rtol)
