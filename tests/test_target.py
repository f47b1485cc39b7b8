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
