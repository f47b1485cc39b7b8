"""Two shortcuts in TVMScript's macro expansion, exact in what they return, cheap in what they do.

Our kernels are written with ``T.macro`` (the tile body, the KV addressing), and every macro
call in TVM 0.27's parser does two costly things that do not depend on anything the call
changes:

- ``ScriptMacro._find_parser_def`` looks for the parser object up the call stack with
  ``inspect.getouterframes``, which reads a source line for every frame (and calls
  ``inspect.getmodule``, a walk over ``sys.modules``, for each). Under pytest, or with torch
  imported, that is 0.05-0.1 s a call; one kernel makes 4-10 macro calls. Walking
  ``frame.f_back`` finds the same frame without reading any source.
- ``ScriptMacro.get_macro_def`` re-parses the macro's source text into an AST on every call;
  the text of one macro object never changes, so its definition is kept on the object.

Measured (cProfile over test_kvcache, test_correctness and test_hardening, 2-core Zen 4): 119 s
of the 360 s were in ``getouterframes``, 18 s in ``get_macro_def``. Applied once, on import of
``tvm_attention.workloads``; if the pinned TVM's names change, nothing is patched and parsing
stays as TVM wrote it (slower, same result).
"""
from __future__ import annotations

import inspect


#: TVM's own methods, as they were before ``_install`` (a test parses with both and compares)
ORIGINAL: dict = {}


def _install() -> bool:
    try:
        from tvm.script.parser.core.parser import ScriptMacro
    except ImportError:  # pragma: no cover - another TVM layout
        return False
    if getattr(ScriptMacro, "_tvma_fast", False):
        return True
    if not all(callable(getattr(ScriptMacro, n, None)) for n in ("_find_parser_def", "get_macro_def")):
        return False  # pragma: no cover
    original_def = ScriptMacro.get_macro_def
    ORIGINAL.update(_find_parser_def=ScriptMacro._find_parser_def, get_macro_def=original_def)
    name = ScriptMacro.parser_object_name

    def _find_parser_def(self):
        # the same frames getouterframes lists (this one first), without their source lines
        frame = inspect.currentframe()
        while frame is not None:
            parser = frame.f_globals.get(name)
            if parser is not None:
                return parser
            frame = frame.f_back
        raise RuntimeError(f"{name} not available")

    def get_macro_def(self):
        cached = self.__dict__.get("_tvma_def")
        if cached is None or cached[0] is not self.source:
            cached = (self.source, original_def(self))
            self.__dict__["_tvma_def"] = cached
        return cached[1]

    ScriptMacro._find_parser_def = _find_parser_def
    ScriptMacro.get_macro_def = get_macro_def
    ScriptMacro._tvma_fast = True
    return True


INSTALLED = _install()
