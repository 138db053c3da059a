"""Backends turn a rendered source into something callable: compile (cached), load, call.

C (via the system compiler and ctypes) is the only backend so far; CUDA (pycuda) will sit beside it
with the same shape: ``compile_source(...) -> CompileResult`` and ``load_kernel(path, name)``.
"""

from runtime.backends.c import (
    CKernel,
    CompileError,
    CompileResult,
    CompilerNotFound,
    cache_key,
    compile_source,
    compiler_version,
    load_kernel,
)

__all__ = [
    "CKernel",
    "CompileError",
    "CompileResult",
    "CompilerNotFound",
    "cache_key",
    "compile_source",
    "compiler_version",
    "load_kernel",
]
