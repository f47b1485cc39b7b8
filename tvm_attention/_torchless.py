"""``python -m tvm_attention._torchless MODULE ARGS...``: run TVM's ``MODULE`` (its ``__main__``)
in a process that never imports torch.

tvm-ffi imports torch whenever it is installed (for DLPack and a Windows symbol clash), a second
or more of CPU and hundreds of MB per process. The tuner's build and measurement workers and an
RPC fleet's tracker and servers compile and run our kernels on NumPy arrays and never meet a
torch tensor, yet each paid it: a small tune took twice its CPU time. Here ``import torch``
raises ImportError (which tvm-ffi expects where torch is absent), and the pool workers this
process starts are started the same way (``tvm_internals.torchless_workers``).
"""
from __future__ import annotations

import runpy
import sys


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m tvm_attention._torchless MODULE [ARGS...]")
    module = sys.argv[1]
    sys.modules.setdefault("torch", None)  # type: ignore[arg-type]  # import torch -> ImportError
    from .tvm_internals import torchless_workers  # after torch is blocked: it imports TVM

    torchless_workers().__enter__()  # for the process's life: its pools' workers are ours too
    sys.argv = [module, *sys.argv[2:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
