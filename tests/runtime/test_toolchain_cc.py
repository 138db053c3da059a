"""The C backend: the compile cache, compile errors, a missing compiler, loading and calling."""

from __future__ import annotations

import os

import numpy as np
import pytest

from runtime.settings import CompilerSettings
from runtime.toolchain import CompileError, CompilerNotFound, cache_key, compile_source, compiler_version, load_kernel

SRC = "void kernel(int n, float a, const float *x, float *y) { for (int i = 0; i < n; i++) y[i] = a * x[i]; }\n"


@pytest.fixture
def cache(tmp_path) -> str:
    return str(tmp_path / "cache")


def _compile(src: str, cache: str, **compiler):
    os.makedirs(cache, exist_ok=True)
    return compile_source(src, compiler=CompilerSettings(**compiler), cache_dir=cache)


def test_second_compile_is_a_cache_hit(cache):
    first = _compile(SRC, cache, flags=["-O2"])
    again = _compile(SRC, cache, flags=["-O2"])
    assert not first.cached and again.cached
    assert again.path == first.path and again.seconds == 0.0
    assert [f for f in os.listdir(cache)] == [os.path.basename(first.path)]  # no temporary left behind


def test_key_changes_with_flags_source_and_compiler():
    v = compiler_version("cc")
    base = cache_key(SRC, ["-O2"], v)
    assert cache_key(SRC, ["-O3"], v) != base
    assert cache_key(SRC + " ", ["-O2"], v) != base
    assert cache_key(SRC, ["-O2"], v + "x") != base
    assert cache_key(SRC, ["-O2"], v) == base


def test_other_flags_compile_again(cache):
    a = _compile(SRC, cache, flags=["-O1"])
    b = _compile(SRC, cache, flags=["-O2"])
    assert not b.cached and a.path != b.path


def test_compile_error_carries_the_compiler_message(cache):
    with pytest.raises(CompileError) as info:
        _compile("void kernel(void) { undeclared_thing = 1; }\n", cache)
    assert "undeclared_thing" in info.value.stderr and "error" in info.value.stderr
    assert "/tmp" not in info.value.stderr  # no temporary paths in what an LLM will read


def test_compile_error_is_trimmed(cache):
    src = "".join(f"void f{i}(void) {{ nope{i} = 1; }}\n" for i in range(2000))
    with pytest.raises(CompileError) as info:
        _compile(src, cache)
    assert len(info.value.stderr) < 5000 and "characters cut" in info.value.stderr


def test_missing_compiler_is_a_specific_error(cache):
    with pytest.raises(CompilerNotFound) as info:
        _compile(SRC, cache, cc="/nonexistent/evoforge-cc")
    msg = str(info.value)
    assert "/nonexistent/evoforge-cc" in msg and "evaluation.compiler.cc" in msg and "\n" not in msg


def test_loaded_kernel_computes(cache):
    lib = load_kernel(_compile(SRC, cache).path, "kernel")
    x = np.arange(5, dtype=np.float32)
    y = np.zeros(5, np.float32)
    lib.bind([5, 2.0, x, y])()
    lib.close()
    np.testing.assert_array_equal(y, 2 * x)


def test_missing_symbol_is_a_compile_error(cache):
    with pytest.raises(CompileError, match="no function 'other'"):
        load_kernel(_compile(SRC, cache).path, "other")


OMP_SRC = """
void kernel(int n, const float *x, float *y) {
    #pragma omp parallel for num_threads(2)
    for (int i = 0; i < n; i++) y[i] = 2.0f * x[i];
}
"""


def test_closing_an_openmp_kernel_leaves_the_process_able_to_exit(cache, tmp_path):
    """Unloading a library whose OpenMP threads still exist crashes the process at exit: such a library
    stays loaded when its kernel is closed."""
    import subprocess
    import sys

    lib = _compile(OMP_SRC, cache, flags=["-O2", "-fopenmp"])
    code = (
        "import numpy as np\nfrom runtime.toolchain import load_kernel\n"
        f"k = load_kernel({lib.path!r}, 'kernel')\n"
        "x = np.arange(1000, dtype=np.float32); y = np.empty_like(x)\n"
        "k.bind([1000, x, y])(); assert (y == 2 * x).all(); k.close()\nprint('closed')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "closed", (out.returncode, out.stderr[-2000:])
