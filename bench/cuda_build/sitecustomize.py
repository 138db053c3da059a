"""Loaded (through PYTHONPATH) only while bench/gpu_check.sh builds pycuda: setuptools compiles an
extension's sources one by one, and pycuda's are ~40 C++ files; this compiles them on every core."""

import os
from concurrent.futures import ThreadPoolExecutor


def _compile_in_parallel() -> None:
    try:
        from setuptools._distutils import ccompiler
    except ImportError:
        return
    base = ccompiler.CCompiler
    if not all(hasattr(base, name) for name in ("_setup_compile", "_get_cc_args", "_compile")):
        return  # another setuptools: leave its serial compile alone

    def compile(self, sources, output_dir=None, macros=None, include_dirs=None, debug=0,  # noqa: A001
                extra_preargs=None, extra_postargs=None, depends=None):
        macros, objects, extra_postargs, pp_opts, build = self._setup_compile(
            output_dir, macros, include_dirs, sources, depends, extra_postargs)
        cc_args = self._get_cc_args(pp_opts, debug, extra_preargs)

        def one(obj):
            src, ext = build[obj]
            self._compile(obj, src, ext, cc_args, extra_postargs, pp_opts)

        with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
            list(pool.map(one, objects))
        return objects

    base.compile = compile


_compile_in_parallel()
