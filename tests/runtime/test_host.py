"""The candidate host (runtime/sandbox/c_host.c) on its own: arguments of every kind reach the kernel, in order."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest

from runtime.sandbox.c_host import HostLauncher
from runtime.toolchain.cc import CompileError

# 13 ints and pointers (more than the registers carry: the rest go on the stack) and 3 floats, interleaved.
ECHO = """
void kernel(int a, float x, int b, int c, const float *p, int d, float y, int e, int f, int g, int h, int i,
            int j, float z, int k, float *out) {
    int ints[] = {a, b, c, d, e, f, g, h, i, j, k};
    for (int n = 0; n < 11; n++) out[n] = (float)ints[n];
    out[11] = x; out[12] = y; out[13] = z; out[14] = p[0] + p[1];
}
"""


@pytest.fixture(scope="module")
def launcher(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("host")
    (tmp / "echo.c").write_text(ECHO)
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", str(tmp / "echo.so"), str(tmp / "echo.c")], check=True)
    launch = HostLauncher("cc", str(tmp), str(tmp))
    yield launch, str(tmp / "echo.so")
    launch.close()


def test_every_argument_reaches_the_kernel_in_order(launcher):
    launch, lib = launcher
    with launch.host(lib, "kernel") as host:
        p = host.alloc(8).view(np.float32)
        p[:] = [1.5, 2.25]
        out = host.alloc(15 * 4).view(np.float32)
        ints = [3, -4, 5, 600, 7, 8, 9, 10, 11, 12, -13]
        a, b, c, d, e, f, g, h, i, j, k = ints
        handle = host.bind([a, 0.5, b, c, p, d, -1.25, e, f, g, h, i, j, 1e-3, k, out])
        seconds, cpu_ns = host.call_many((handle,))
        assert seconds > 0 and cpu_ns >= 0
        assert out[:11].tolist() == [float(v) for v in ints]
        assert out[11:14].tolist() == pytest.approx([0.5, -1.25, 1e-3])
        assert out[14] == 3.75


def test_a_missing_function_and_too_many_arguments_are_refused(launcher):
    launch, lib = launcher
    with pytest.raises(CompileError, match="defines no function 'absent'"):
        launch.host(lib, "absent")
    with launch.host(lib, "kernel") as host:
        with pytest.raises(TypeError, match="more than 8 float"):
            host.bind([0.0] * 9)
        with pytest.raises(TypeError, match="unsupported kernel argument"):
            host.bind(["text"])


def test_a_library_changed_since_it_was_built_is_refused_and_what_loads_is_a_sealed_copy(launcher, tmp_path):
    from runtime.toolchain.cc import library_sha256

    launch, lib = launcher
    copy = tmp_path / "copy.so"
    copy.write_bytes(open(lib, "rb").read())
    built = library_sha256(copy.read_bytes())
    with launch.host(str(copy), "kernel", sha256=built) as host:
        copy.write_bytes(b"\0" * 64)  # the file changes after the check: the host holds its own sealed copy
        out = host.alloc(15 * 4).view(np.float32)
        p = host.alloc(8).view(np.float32)
        handle = host.bind([1, 0.5, 2, 3, p, 4, 1.0, 5, 6, 7, 8, 9, 10, 2.0, 11, out])
        host.call_many((handle,))
        assert out[0] == 1.0
    with pytest.raises(CompileError, match="changed since it was built"):
        launch.host(str(copy), "kernel", sha256=built)


def test_the_calibration_host_loads_nothing_and_answers_in_microseconds(launcher):
    launch, _ = launcher
    trips = [launch.round_trip() for _ in range(3)]
    assert all(0 < t < 1e-3 for t in trips), trips
