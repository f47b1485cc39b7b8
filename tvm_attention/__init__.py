"""tvm-attention: fused attention kernels generated with Apache TVM.

Public API::

    AttentionSpec                       the workload (GQA, bottom-right causal; ``layout`` "bhsd",
                                        "varlen", "kvcache" or "paged", ``dynamic`` dims symbolic
                                        at call time, ``return_lse``)
    SpecError                           an invalid spec (a ValueError naming the offending field)
    build_kernel(spec, schedule, ...)   PrimFunc → schedule → lowered IR → audit → module
    load(dir) -> kernel(q, k, v) -> o   serving-side loader of an exported artifact (varlen:
                                        kernel(q, k, v, cu_seqlens_q=..., cu_seqlens_k=...);
                                        kvcache: kernel(q, k_cache, v_cache, cache_seqlens=...);
                                        paged: kernel(q, k_pages, v_pages, block_table=...,
                                        cache_seqlens=...); --return-lse: (o, lse))
    integrations.transformers.register()  attn_implementation="tvm_attention" for transformers
    aligned_empty(shape, dtype)         a 64-byte-aligned array: an ``out=`` buffer used without a copy
    set_num_threads(n)                  size TVM's CPU thread pool for the calling thread
    merge_states(o_a, lse_a, o_b, lse_b)  attention over two disjoint key sets from each one's
                                        (o, lse) (cascade / shared-prefix attention)
    quantize_kv(x, dtype)               (x_q, scale): K or V quantized to an 8-bit cache dtype
                                        (float8_e4m3fn, float8_e5m2, int8), one scale per kv head,
                                        per token or per 32 elements (granularity=)

From a source checkout (``PYTHONPATH=<checkout>``, no install or another checkout's),
``tvm_attention.schedules`` and ``tvm_attention.tuning_logs`` resolve to the folders beside this
package, as an install maps them (:mod:`tvm_attention._checkout`).
"""
from . import _checkout

_checkout.install()  # before any import of tvm_attention.schedules; does nothing in an installed package

from .spec import AttentionSpec, SpecError  # noqa: E402

__version__ = "0.1.0"


def load(directory, num_threads=None):
    """Load an artifact directory; see :func:`tvm_attention.loader.load`."""
    from .loader import load as _load  # lazy: `import tvm_attention` loads no TVM

    return _load(directory, num_threads=num_threads)


def merge_states(o_a, lse_a, o_b, lse_b, sinks=None):
    """Merge two attention states; see :func:`tvm_attention.merge.merge_states`."""
    from .merge import merge_states as _merge  # lazy: `import tvm_attention` loads no TVM

    return _merge(o_a, lse_a, o_b, lse_b, sinks=sinks)


def quantize_kv(x, dtype, head_axis=1, scale=None, granularity="head"):
    """K or V as an 8-bit cache and its scales (per kv head, per token or per group of 32);
    see :func:`tvm_attention.quant.quantize_kv`."""
    from .quant import quantize_kv as _quantize  # lazy: NumPy only, but the package imports nothing eagerly

    return _quantize(x, dtype, head_axis=head_axis, scale=scale, granularity=granularity)


def aligned_empty(shape, dtype):
    """A C-contiguous, 64-byte-aligned NumPy array; see :func:`tvm_attention.loader.aligned_empty`."""
    from .loader import aligned_empty as _empty  # lazy: `import tvm_attention` loads no TVM

    return _empty(shape, dtype)


def build_kernel(spec, schedule="fused", target="llvm", knobs=None, cache=False):
    """Build a kernel (``cache=True``: through the build cache, docs/cli.md); see
    :func:`tvm_attention.build.build_kernel`."""
    from .build import build_kernel as _build  # lazy: the compiler loads only to build

    return _build(spec, schedule=schedule, target=target, knobs=knobs, cache=cache)


def set_num_threads(n=None):
    """Size TVM's thread pool; see :func:`tvm_attention.threads.set_num_threads`."""
    from .threads import set_num_threads as _set  # lazy: `import tvm_attention` loads no TVM

    return _set(n)


__all__ = ["AttentionSpec", "SpecError", "aligned_empty", "build_kernel", "load", "merge_states", "quantize_kv",
           "set_num_threads", "__version__"]
