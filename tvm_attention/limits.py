"""The integer ranges every kernel is written for: one place, read by the spec, the loader, the
library's own checks and the lowering (docs/artifact_checks.md lists each bound and why no sum
or product a check forms can overflow).

Kernels index tensors and form positions, window edges and tile bounds in int32. So:

* no tensor holds more than ``MAX_ELEMENTS`` elements (its every flat index fits);
* no sequence has more than ``MAX_SEQ_LEN`` rows or keys, and no window side is wider than
  ``MAX_WINDOW``: with tiles far below 2**16 keys, every position ``p = i + seq_kv − seq_q``,
  window edge ``p ± window`` and tile bound ``keys + block_n − 1`` a kernel forms stays within
  ±(2**30 + 2**29 + 2**16) < 2**31.

The library checks the first two on every call (the caller's int64 shapes, then its index
arrays), the spec the third when a kernel is built.
"""

#: Kernels index tensors with int32: no tensor may have 2**31 elements or more.
MAX_ELEMENTS = 2**31 - 1
#: The longest sequence a kernel takes: rows (seq_q, total_q) and keys (seq_kv, max_len, total_k,
#: a sequence's cache_seqlens plus appended keys), each at most 2**30.
MAX_SEQ_LEN = 2**30
#: The widest window side a spec takes (-1: unbounded).
MAX_WINDOW = 2**29
