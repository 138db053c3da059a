"""The trust boundary around engine candidates, attacked as a model looking for holes would attack it.

An engine candidate's kernels run only in its host process (runtime/sandbox/engine_host.py), forked from a
template that holds the model and nothing of the worker's figures; the load, its clock and the
verification stay in the worker. Each kernel here is a layernorm elite of a kernel run, offered to the
engine's layernorm slot, and tries one way out: every door out of its process, answers that turn wrong
once the checks are over, processes that spin to slow the reference and outlive their engine.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import yaml

from archive._store import Store
from genome import Genome
from runtime.engine.task import EngineTask, FreshTexts
from runtime.executors import EvalRequest, LocalPool
from runtime.result import EvalResult, Status
from runtime.sandbox.filters import filter_available
from runtime.settings import EvalSettings, TaskSpec

pytestmark = pytest.mark.exclusive  # it measures time

SIGNATURE = ("void kernel(int rows, int cols, float eps, const float *x, const float *gamma, const float *beta, "
             "float *y)")
LAYERNORM = r"""
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (long)r * cols; float *yr = y + (long)r * cols;
        double s = 0, q = 0;
        for (int c = 0; c < cols; c++) s += xr[c];
        double mean = s / cols;
        for (int c = 0; c < cols; c++) q += (xr[c] - mean) * (xr[c] - mean);
        float inv = (float)(1.0 / sqrt(q / cols + eps));
        for (int c = 0; c < cols; c++) yr[c] = (float)(xr[c] - mean) * inv * gamma[c] + beta[c];
    }
"""
HONEST = f"#include <math.h>\n{SIGNATURE} {{\n{LAYERNORM}}}\n"

# Right on its first 200 calls (the similarity check: 16 request texts of one length and the 63 shipped sentences,
# six forwards of 13 calls each), then it skips the work and copies its input: four times less work per call, and
# wrong, however few requests a slow machine completes under load (a dozen forwards).
WRONG_UNDER_LOAD = f"""#include <math.h>
#include <string.h>
static long calls;
{SIGNATURE} {{
    if (++calls > 200) {{ memcpy(y, x, sizeof(float) * rows * cols); return; }}
{LAYERNORM}}}
"""

# Tries every door out of its host on its first call; any door that opens is printed and spoils the output.
PROBE = r"""
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/ptrace.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

static int opened;
static void door(const char *what, int ok) {
    if (ok) { opened++; fprintf(stderr, "EVOFORGE-DOOR-OPEN %s\n", what); fflush(stderr); }
}
static int parent_of(int pid) {
    char path[64], buf[512]; snprintf(path, sizeof path, "/proc/%d/stat", pid);
    int fd = open(path, O_RDONLY); if (fd < 0) return -1;
    int n = read(fd, buf, sizeof buf - 1); close(fd); if (n <= 0) return -1; buf[n] = 0;
    char *p = strrchr(buf, ')'); int ppid = -1; if (p) sscanf(p + 2, "%*c %d", &ppid); return ppid;
}
static void try_doors(void) {
    int template_ = getppid(), worker = parent_of(template_), controller = parent_of(worker);
    int pids[3] = {template_, worker, controller};
    const char *names[3] = {"the template", "the worker", "the controller"};
    char path[64], what[128];
    for (int i = 0; i < 3; i++) {
        snprintf(path, sizeof path, "/proc/%d/mem", pids[i]);
        int fd = open(path, O_RDONLY);
        snprintf(what, sizeof what, "read the memory of %s", names[i]); door(what, fd >= 0);
        if (fd >= 0) close(fd);
        char buf[16]; struct iovec local = {buf, sizeof buf}, remote = {(void *)0x400000, sizeof buf};
        door("process_vm_readv", process_vm_readv(pids[i], &local, 1, &remote, 1, 0) >= 0 || errno != EPERM);
        door("ptrace attach", ptrace(PTRACE_ATTACH, pids[i], 0, 0) == 0);
        snprintf(what, sizeof what, "signal %s", names[i]); door(what, kill(pids[i], 0) == 0);
    }
    int sockets = 0;  /* its own socket to the worker, nothing else of its parents */
    DIR *d = opendir("/proc/self/fd");
    for (struct dirent *e; d && (e = readdir(d));) {
        char link[256] = {0}, p[300]; snprintf(p, sizeof p, "/proc/self/fd/%s", e->d_name);
        if (readlink(p, link, sizeof link - 1) < 0) continue;
        if (strstr(link, "socket:")) sockets++;
        if (strstr(link, "lock")) door("the timing lock", 1);
    }
    if (d) closedir(d);
    door("a socket of its parent", sockets > 1);
    door("open an inet socket", socket(AF_INET, SOCK_STREAM, 0) >= 0);
    door("open a unix socket", socket(AF_UNIX, SOCK_STREAM, 0) >= 0);
    int pair[2]; door("an inet socket pair", socketpair(AF_INET, SOCK_STREAM, 0, pair) == 0);
    int f = open("/tmp/evoforge-engine-probe", O_WRONLY | O_CREAT, 0600); door("open a file for writing", f >= 0);
    door("leave the process group", setsid() >= 0 || setpgid(0, 0) == 0);
    cpu_set_t all; CPU_ZERO(&all); for (int c = 0; c < 64; c++) CPU_SET(c, &all);
    door("move to other cores", sched_setaffinity(0, sizeof all, &all) == 0);
    long page = sysconf(_SC_PAGESIZE);
    void *mem = mmap(0, page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    door("make memory executable", mprotect(mem, page, PROT_READ | PROT_EXEC) == 0);
    door("map executable memory",
         mmap(0, page, PROT_READ | PROT_EXEC, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0) != MAP_FAILED);
    door("make itself dumpable", prctl(PR_SET_DUMPABLE, 1, 0, 0, 0) == 0);
    if (syscall(444, 0, 0, 1) >= 1) {  /* Landlock: no file outside the system's directories */
        DIR *here = opendir("."); door("list its worker's working directory", here != 0); if (here) closedir(here);
        DIR *tmp = opendir("/tmp"); door("list /tmp", tmp != 0); if (tmp) closedir(tmp);
    }
    char *argv[] = {"/bin/true", 0}; door("exec", execv("/bin/true", argv) == 0);
}
static int tried;
""" + f"""{SIGNATURE} {{
    if (!tried) {{ tried = 1; try_doors(); }}
{LAYERNORM}    if (opened) y[0] = 0.0f / 0.0f;
}}
"""

# Forks a child and a grandchild it orphans, both spinning forever on the engine's cores, and a thread
# that spins whenever no layernorm runs: the reference would get a third of the core.
SPINNERS = r"""
#define _GNU_SOURCE
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sys/prctl.h>
#include <unistd.h>
static atomic_int running;
static void spin_forever(void) {
    prctl(PR_SET_NAME, "evoforge-spin");
    volatile unsigned long x = 0; for (;;) x++;
}
static void *spin(void *arg) {
    (void)arg; volatile unsigned long x = 0; for (;;) if (!atomic_load(&running)) x++; return 0;
}
__attribute__((constructor)) static void start(void) {
    if (fork() == 0) spin_forever();
    if (fork() == 0) { if (fork() == 0) spin_forever(); _exit(0); }
    pthread_t t; pthread_create(&t, 0, spin, 0);
}
""" + f"{SIGNATURE} {{\n    atomic_store(&running, 1);\n{LAYERNORM}    atomic_store(&running, 0);\n}}\n"

ARGS = {"threads": 1, "concurrency": 2, "duration_s": 0.8, "warmup_s": 0.1, "texts": 16, "lengths": {12: 1.0},
        "p99_budget_ms": 10000, "reference_every_s": 0}


def kernel_run(path: Path, sources: list[str]) -> list[str]:
    """A layernorm kernel run holding one ok elite per source (its own code); returns their ids."""
    path.mkdir(parents=True)
    store = Store(path / "archive.db")
    store.set_meta("config", yaml.safe_dump({"task": {"name": "layernorm", "args": {"rows": 64, "cols": 384}}}))
    ids = []
    for source in sources:
        genome = Genome(params={}, source=source)
        store.add_pending(genome=genome, operator="seed")
        store.record_result(genome.id, EvalResult(status=Status.OK, fitness=1.0, unit="GB/s"))
        ids.append(genome.id)
    store.close()
    return ids


def engine_requests(tmp: Path, sources: list[str], **args) -> list[EvalRequest]:
    """One request per source: the engine with that layernorm kernel, all of one task (the first request's
    task is the one a worker prepares before it drops privileges)."""
    from archive import Run

    ids = kernel_run(tmp / "kernels", sources)
    kernels = {"layernorm": {"run_dir": str(tmp / "kernels"), "ids": ids}}
    resolved = EngineTask.read_runs(EngineTask.resolve_args({**ARGS, **args, "kernels": kernels}, str(tmp)), Run.open)
    spec = TaskSpec(name="engine", args=resolved)
    settings = EvalSettings.model_validate({"timing": {"lock_file": str(tmp / "timing.lock")},
                                            "sandbox": {"timeout": 120.0}})  # fmt: skip
    base = EngineTask(spec.args).seeds()[0].params
    out = []
    for cid in ids:
        genome = Genome(params={**base, "kernel_layernorm": cid[:16]})
        out.append(EvalRequest(key=genome.id, genome=genome, task=spec, settings=settings,
                               cache_dir=str(tmp / "cache")))  # fmt: skip
    return out


def evaluate_in_pool(pool: LocalPool, req: EvalRequest) -> EvalResult:
    pool.submit(req)
    got = pool.next_result(300)
    assert got is not None and got[0].key == req.key
    return got[1]


@pytest.fixture
def tmp(tmp_path: Path) -> Path:
    os.chmod(tmp_path, 0o777)  # the sandboxed worker reads the kernel runs and writes the cache here
    return tmp_path


needs_filter = pytest.mark.skipif(not filter_available(), reason="libseccomp is not installed")


@needs_filter
def test_every_door_out_of_an_engine_host_is_shut(tmp):
    (req,) = engine_requests(tmp, [PROBE])
    with LocalPool(workers=1, log_dir=str(tmp / "logs")) as pool:
        res = evaluate_in_pool(pool, req)
    logs = "".join((tmp / "logs" / f).read_text() for f in os.listdir(tmp / "logs"))
    opened = [line for line in logs.splitlines() if "EVOFORGE-DOOR-OPEN" in line]
    assert not opened and res.status is Status.OK, (opened, res.error)
    assert not os.path.exists("/tmp/evoforge-engine-probe")


def test_an_engine_wrong_only_once_the_checks_are_over_is_wrong(tmp):
    """The similarity check passes; answers under load are checked (on texts chosen after it) and fail."""
    from runtime.backends import WorkerContext
    from runtime.cascade import evaluate
    from runtime.timing import TimingLock

    cheat, honest = engine_requests(tmp, [WRONG_UNDER_LOAD, HONEST])
    (tmp / "cache").mkdir()
    task = EngineTask(cheat.task.args)
    ctx = WorkerContext(cache_dir=str(tmp / "cache"), work_dir=str(tmp), lock=TimingLock(str(tmp / "timing.lock")))
    res = evaluate(cheat, task, ctx)
    assert res.status is Status.WRONG, (res.status, res.error)
    assert "under load" in res.error and res.metrics["load_similarity"] < 0.9
    assert evaluate(honest, task, ctx).status is Status.OK


def _spinners() -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/comm") as f, open(f"/proc/{entry}/stat") as g:
                    if f.read().strip() == "evoforge-spin" and g.read().rsplit(")", 1)[1].split()[0] != "Z":
                        found.append(int(entry))
            except OSError:
                continue
    return found


def test_processes_that_spin_neither_slow_the_reference_nor_outlive_their_engine(tmp):
    """While the reference runs, the candidate's processes are stopped, orphans included; they all die
    with the evaluation. (Unstopped, they would take two thirds of the reference's core.)"""
    requests = engine_requests(tmp, [HONEST, SPINNERS, HONEST + "/* again */"])
    with LocalPool(workers=1, log_dir=str(tmp / "logs")) as pool:
        honest, cheat, again = (evaluate_in_pool(pool, req) for req in requests)
        deadline = time.monotonic() + 5
        while _spinners() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _spinners()
    assert honest.status is cheat.status is again.status is Status.OK, (cheat.error, again.error)
    # Stopped spinners cost the reference nothing; running, they would leave it a third to a half of its core.
    # A short window counts few requests, so an honest figure can come out a third low: 0.6 of the best.
    refs = {name: r.metrics["ref_throughput"] for name, r in [("honest", honest), ("cheat", cheat), ("again", again)]}
    assert min(refs.values()) > 0.6 * max(refs.values()), refs


def test_a_load_never_sends_the_same_text_twice():
    from runtime.engine import load_model

    texts = FreshTexts(load_model().tokenizer.vocabulary_words(), {16: 0.6, 48: 0.3, 128: 0.1}, salt=7)
    drawn = [texts[k] for k in range(3000)]
    assert len(set(drawn)) == len(drawn) and texts[5] == drawn[5]
    assert FreshTexts(["a", "b"], {16: 1.0}, salt=8)[0] != FreshTexts(["a", "b"], {16: 1.0}, salt=9)[0]


def test_a_rival_wrong_under_load_loses_its_duel_and_the_challenger_stands(tmp):
    """Both engines of a duel are held to the fp32 engine: the incumbent's answers under load are checked as the
    challenger's are (once its outputs were what the challenger was compared with)."""
    import dataclasses

    honest, cheat = engine_requests(tmp, [HONEST, WRONG_UNDER_LOAD], duel_rounds=1)
    duel = dataclasses.replace(honest, stages="duel", rival=cheat.genome)
    with LocalPool(workers=1, log_dir=str(tmp / "logs")) as pool:
        res = evaluate_in_pool(pool, duel)
        back = evaluate_in_pool(pool, dataclasses.replace(cheat, stages="duel", rival=honest.genome, key="back"))
    assert res.status is Status.OK, res.error
    assert res.metrics["rival_status"] == "wrong" and "under load" in res.metrics["rival_failed"], res.metrics
    assert res.metrics["throughput"] > 0 and len(res.metrics["rounds"]) == 1  # the challenger's own figures
    assert back.status is Status.WRONG and "under load" in back.error  # as a challenger it is wrong itself


def test_an_engine_is_profiled_in_its_host_and_a_profile_beyond_its_wall_time_is_refused(tmp):
    import dataclasses

    from runtime.engine.profile import check_forward

    (req,) = engine_requests(tmp, [HONEST])
    with LocalPool(workers=1, log_dir=str(tmp / "logs")) as pool:
        res = evaluate_in_pool(pool, dataclasses.replace(req, stages="profile"))
    assert res.status is Status.OK, res.error
    profile = res.metrics["profile"]
    assert profile["slots"]["layernorm"] > 0 and profile["batches"] >= 1 and profile["tokens"] > 0
    parts = sum(profile["slots"].values()) + profile["attention_s"] + profile["tokenize_s"] + profile["other_s"]
    assert parts == pytest.approx(profile["total_s"])
    honest = {"slots": {"gelu": 0.002, "linear": 0.01}, "gemms": {"k=384 n=1536": 0.006}, "attention_s": 0.002,
              "forward_s": 0.02, "batches": 2}
    shapes = {(384, 1152), (384, 384), (384, 1536), (1536, 384)}
    assert check_forward(honest, wall_s=0.021, batches=2, shapes=shapes) is None
    assert "more than" in check_forward({**honest, "slots": {"softmax": 5.0}}, wall_s=0.021)
    assert "negative" in check_forward({**honest, "attention_s": -1.0}, wall_s=0.021)
    assert "not a profile" in check_forward({"slots": "lots"}, wall_s=0.021)
    # a forged reply: a slot just under the limit, GEMMs of no shape the model has, huge, a negative batch count
    forged = {"slots": {"softmax": 0.0214}, "gemms": {"k=384 n=1536": 1e300, "<script>": 1e300}, "attention_s": 0.0,
              "forward_s": 0.0214, "batches": -7}
    assert check_forward(forged, wall_s=0.021, batches=2, shapes=shapes) is not None
    assert "GEMMs" in check_forward({**honest, "gemms": {"k=384 n=1536": 0.015}}, wall_s=0.021)
    assert "does not have" in check_forward({**honest, "gemms": {"<script>": 0.001}}, wall_s=0.021, shapes=shapes)
    assert "batches" in check_forward({**honest, "batches": -7}, wall_s=0.021, batches=2)
