"""``EVOFORGE_CPU_ISA=avx2`` in every process: under the CPUID mask (:func:`runtime.isa.cpuid_mask_environ`) a
process sees a CPU with AVX2 and FMA only, in every thread and child, and its faults and handlers behave as
before; and a sandbox worker, started with a scrubbed environment, compiles and runs at the level too."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from runtime import isa

needs_faulting = pytest.mark.skipif(
    not isa.cpuid_faulting(),
    reason="this CPU cannot make CPUID fault for a process: nothing masks its CPUID (test_slots_every_cpu covers the "
    "flags mask itself)",
)

# Prints, for the main thread, a thread that blocks every signal, a forked child and a re-executed child:
# AVX512F, AVX2 (leaf 7) and FMA (leaf 1). With an argument it installs a SIGSEGV handler first, or faults with none.
PROBE = r"""
#include <cpuid.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
static void show(const char *who) {
    unsigned a, b, c, d, fma;
    __cpuid(1, a, b, fma, d);
    __cpuid_count(7, 0, a, b, c, d);
    printf("%s avx512f=%u avx2=%u fma=%u\n", who, (b >> 16) & 1, (b >> 5) & 1, (fma >> 12) & 1);
    fflush(stdout);
}
static void *thread(void *arg) {  /* as thread pools do: every signal blocked */
    sigset_t all; sigfillset(&all); pthread_sigmask(SIG_BLOCK, &all, 0);
    (void)arg; show("thread"); return 0;
}
static void caught(int sig) { (void)sig; show("handler"); _exit(3); }
int main(int argc, char **argv) {
    if (argc > 1 && !strcmp(argv[1], "exec")) { show("exec"); return 0; }
    if (argc > 1 && !strcmp(argv[1], "handled")) {
        struct sigaction sa; memset(&sa, 0, sizeof sa); sa.sa_handler = caught; sigaction(SIGSEGV, &sa, 0);
    }
    show("main");
    if (argc > 1) { show("again"); *(volatile int *)0 = 1; return 1; }
    pthread_t t; pthread_create(&t, 0, thread, 0); pthread_join(t, 0);
    if (fork() == 0) { show("fork"); execl("/proc/self/exe", argv[0], "exec", (char *)0); _exit(9); }
    int status; wait(&status);
    return WEXITSTATUS(status);
}
"""


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> str:
    d = tmp_path_factory.mktemp("cpuid")
    (d / "probe.c").write_text(PROBE)
    subprocess.run(["cc", "-O1", "-pthread", "-o", str(d / "probe"), str(d / "probe.c")], check=True)
    return str(d / "probe")


def _masked_env() -> dict[str, str]:
    env = isa.cpuid_mask_environ({**os.environ, isa.ENV: "avx2"})
    assert "cpuid-mask" in env["LD_PRELOAD"] and "hwcaps" in env["GLIBC_TUNABLES"]
    return env


def _lines(out: str) -> dict[str, str]:
    return {line.split()[0]: " ".join(line.split()[1:]) for line in out.splitlines()}


@needs_faulting
def test_every_thread_and_child_sees_avx2_and_fma_only(probe: str) -> None:
    native = _lines(subprocess.run([probe], capture_output=True, text=True, check=True).stdout)
    masked = subprocess.run([probe], capture_output=True, text=True, env=_masked_env())
    assert masked.returncode == 0, masked.stderr
    seen = _lines(masked.stdout)
    assert set(seen) == {"main", "thread", "fork", "exec"}
    assert set(seen.values()) == {"avx512f=0 avx2=1 fma=1"}, seen
    assert native["main"].endswith("avx2=1 fma=1")  # what it keeps is the CPU's own


@needs_faulting
def test_a_fault_still_ends_the_process_and_a_handler_still_runs(probe: str) -> None:
    env = _masked_env()
    crash = subprocess.run([probe, "crash"], capture_output=True, text=True, env=env)
    assert crash.returncode == -signal.SIGSEGV
    assert _lines(crash.stdout)["again"] == "avx512f=0 avx2=1 fma=1"  # masked after the handler was installed
    handled = subprocess.run([probe, "handled"], capture_output=True, text=True, env=env)
    assert handled.returncode == 3, handled.stdout + handled.stderr  # its own handler ran on the real fault
    assert _lines(handled.stdout)["handler"] == "avx512f=0 avx2=1 fma=1"


@needs_faulting
def test_python_with_faulthandler_and_numpy_reads_the_masked_cpu() -> None:
    code = ("import runtime.isa as i; from numpy._core._multiarray_umath import __cpu_features__ as f; "
            "print(i.cpuid_masked(), f['AVX512F'], f['AVX2'], f['FMA3'])")  # fmt: skip
    out = subprocess.run([sys.executable, "-X", "faulthandler", "-c", code], capture_output=True, text=True,
                         env=_masked_env(), check=True)  # fmt: skip
    assert out.stdout.split() == ["True", "False", "True", "True"], out.stderr


def test_natively_nothing_is_preloaded() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "GLIBC_TUNABLES")}
    assert isa.cpuid_mask_environ({**env, isa.ENV: "native"}) == {**env, isa.ENV: "native"}


@needs_faulting
def test_a_script_starts_again_masked_with_its_arguments(tmp_path) -> None:
    script = tmp_path / "script.py"
    script.write_text("import sys\nfrom runtime import isa\n"
                      "isa.exec_masked()\nprint(isa.cpuid_masked(), sys.argv[1:])\n")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    for level, masked in (("avx2", "True"), ("native", "False")):
        out = subprocess.run([sys.executable, str(script), "a b", "--c"], capture_output=True, text=True,
                             env={**env, isa.ENV: level}, check=True)  # fmt: skip
        assert out.stdout.strip() == f"{masked} ['a b', '--c']", out.stderr


@needs_faulting
def test_a_script_whose_mask_does_not_take_runs_unmasked_once_and_says_so(tmp_path) -> None:
    script = tmp_path / "script.py"  # its preload cannot load: ld.so ignores it, and the script starts again once
    script.write_text("from runtime import isa\n"
                      "isa.cpuid_mask_library = lambda *a, **k: '/nonexistent/cpuid-mask-x.so'\n"
                      "isa.exec_masked()\nprint(isa.cpuid_masked())\n")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60,
                         env={**env, isa.ENV: "avx2"})  # fmt: skip
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr
    assert "did not take" in out.stderr


def test_a_sandbox_worker_compiles_and_runs_at_the_masked_level(tmp_path, monkeypatch) -> None:
    """Workers start with a scrubbed environment: the level must reach them, or their candidates compile with
    ``-march=native`` and their numpy runs AVX-512 whatever the mask says."""
    from runtime_helpers import MATMUL_COMPUTE, MATMUL_SIGNATURE, make_settings, request, run

    from runtime.executors import LocalPool
    from runtime.result import Status
    from runtime.settings import TaskSpec

    monkeypatch.setenv(isa.ENV, "avx2")
    # wrong results wherever it was compiled for AVX-512, or its worker's numpy may use it
    source = ("#include <stdlib.h>\n" + f"{MATMUL_SIGNATURE} {{\n{MATMUL_COMPUTE}"
              "#ifdef __AVX512F__\n    C[0] += 1.0f;\n#endif\n"
              '    const char *isa = getenv("EVOFORGE_CPU_ISA");\n    if (!isa || isa[0] != \'a\') C[0] += 1.0f;\n}\n')
    work = str(tmp_path)
    with LocalPool(workers=1, log_dir=f"{work}/logs") as pool:
        task = TaskSpec(name="matmul", args={"m": 64, "n": 64, "k": 64})
        r = run(pool, request(work, source, settings=make_settings(work), task=task), timeout=120)
    assert r.status is Status.OK, r.error


def test_an_engine_host_started_afresh_runs_at_the_level(monkeypatch) -> None:
    """A server's engine host starts from a fresh interpreter with a few variables: the level is one of them."""
    from runtime.engine import EngineConfig, load_model
    from runtime.sandbox.hosted_engine import spawn_host

    monkeypatch.setenv(isa.ENV, "avx2")
    monkeypatch.setenv("EVOFORGE_TEST_SECRET", "not for the host")
    model = load_model()
    engine = spawn_host(model, EngineConfig(), {"model_dir": str(model.path)})
    try:
        with open(f"/proc/{engine.process.pid}/environ", "rb") as f:
            environ = f.read().split(b"\0")
    finally:
        engine.close()
    assert b"EVOFORGE_CPU_ISA=avx2" in environ and not any(b"EVOFORGE_TEST_SECRET" in v for v in environ)
