"""Toolchains turn a rendered source into something callable: compile (cached by content), load, call.

- :mod:`runtime.toolchain.cc`: C through the system compiler, loaded with ctypes (``compile_source``,
  ``load_kernel``); its cache and atomic ``publish`` serve every toolchain.
- :mod:`runtime.toolchain.nvcc`: CUDA C++ to a cubin with ptxas' report (nvcc only, no GPU needed).
- :mod:`runtime.toolchain.cuda_device`, ``cuda_launch``, ``cuda_reference``: the GPU side through
  pycuda (context, guarded buffers, launches, event timing) and the GPU library references.

The backends (:mod:`runtime.backends`) use these; nothing here knows about tasks or fitness.
"""

from runtime.toolchain.cc import (
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
