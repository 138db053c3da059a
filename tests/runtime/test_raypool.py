"""Evaluation on a real Ray cluster of two nodes started on this machine (``ray.cluster_utils.Cluster``):
requests run on every node with the user's task module shipped, a node that dies gives its requests to
the others (and one killed twice ends ``crash``), a node that joins gets work, fingerprints are compared
as configured, and candidate code cannot reach Ray's control plane. One cluster for the module."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterator

import pytest

ray = pytest.importorskip("ray")

from runtime_helpers import request  # noqa: E402

from runtime.executors import EvalRequest  # noqa: E402
from runtime.executors.ray import (  # noqa: E402
    ClusterUnavailable,
    MixedHardware,
    NodeEvaluator,
    RayPool,
    speed_differences,
    sweep_node_homes,
)
from runtime.result import EvalResult, Status  # noqa: E402

_NODE = {"num_cpus": 1, "object_store_memory": 80 * 2**20}


@pytest.fixture(scope="module")
def cluster() -> Iterator[object]:
    from ray.cluster_utils import Cluster

    os.environ["EVOFORGE_TEST_SECRET"] = "sk-never-on-a-node"  # in the environment the nodes are started from
    c = Cluster(initialize_head=True, head_node_args={**_NODE, "include_dashboard": False})
    c.add_node(**_NODE)
    try:
        yield c
    finally:
        os.environ.pop("EVOFORGE_TEST_SECRET", None)
        c.shutdown()


@pytest.fixture
def pool(cluster) -> Iterator[RayPool]:
    with RayPool(cluster.address, workers_per_node=1) as p:
        yield p


def _ensure_nodes(cluster, n: int) -> None:
    """At least ``n`` live nodes (tests before may have killed some)."""
    while len([x for x in ray.nodes() if x["Alive"]]) < n:
        cluster.add_node(**_NODE)
        cluster.wait_for_nodes()


def _all(pool: RayPool, n: int, timeout: float = 120.0) -> dict[str, EvalResult]:
    out: dict[str, EvalResult] = {}
    deadline = time.monotonic() + timeout
    while len(out) < n and time.monotonic() < deadline:
        got = pool.next_result(5.0)
        if got is not None:
            assert got[0].key not in out, f"{got[0].key} came back twice"
            out[got[0].key] = got[1]
    assert len(out) == n, f"{len(out)} of {n} results"
    return out


# A vecadd kernel that sleeps in every call: a check takes a second or two, long enough to kill its node.
SLOW = r"""
#include <unistd.h>
void kernel(int n, float a, float b, const float *x, float *y) {
    usleep(150000);
    for (int i = 0; i < n; i++) y[i] = a * x[i] + b;
}
"""


def _slow(workdir: str, i: int) -> EvalRequest:
    return dataclasses.replace(request(workdir, SLOW + f"/* {i} */"), stages="check")


def test_requests_run_on_every_node_with_the_users_task_module_and_no_secret(pool, tmp_path):
    nodes = pool.nodes()
    assert len(nodes) == 2 and pool.slots == 2
    assert all("EVOFORGE_TEST_SECRET" not in n["environment"] for n in nodes)  # scrubbed when the actor starts
    reqs = [request(str(tmp_path), params={"UNROLL": u}) for u in (1, 2, 4, 8)]  # vecadd_task: a user module
    for r in reqs:
        pool.submit(r)
    results = _all(pool, len(reqs))
    assert all(r.status is Status.OK and r.fitness for r in results.values()), results
    assert {r.metrics["node"] for r in results.values()} == {n["node"] for n in nodes}
    assert all(r.hardware and r.hardware["cpu_model"] for r in results.values())


def test_a_node_that_dies_gives_its_requests_to_the_others_and_a_new_node_gets_work(cluster, tmp_path):
    with RayPool(cluster.address, workers_per_node=1) as pool:
        reqs = [_slow(str(tmp_path), i) for i in range(4)]
        for r in reqs:
            pool.submit(r)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # until a request runs on the node that is not the head
            placed = pool.placement()
            victim = next((n for n in cluster.worker_nodes if n.node_id in placed.values()), None)
            if victim is not None:
                break
            time.sleep(0.05)
        assert victim is not None
        time.sleep(0.3)
        cluster.remove_node(victim, allow_graceful=False)
        results = _all(pool, len(reqs), timeout=180)
        assert all(r.status is Status.OK for r in results.values()), {k: r.error for k, r in results.items()}
        assert {r.metrics["node"] for r in results.values()} <= {n["node"] for n in pool.nodes()} | {victim.node_id}
        assert victim.node_id not in {n["node"] for n in pool.nodes()}
        joined = cluster.add_node(**_NODE)  # a node that joins mid-run gets work
        extra = [_slow(str(tmp_path), 10 + i) for i in range(4)]
        time.sleep(3)  # the pool looks for new nodes every 2 s
        for r in extra:
            pool.submit(r)
        later = _all(pool, len(extra), timeout=180)
        assert all(r.status is Status.OK for r in later.values())
        assert joined.node_id in {r.metrics["node"] for r in later.values()}


def test_a_request_whose_two_nodes_die_ends_crash(cluster, tmp_path):
    cluster.add_node(**_NODE)
    cluster.wait_for_nodes()
    with RayPool(cluster.address, workers_per_node=1, use_head=False) as pool:
        assert cluster.head_node.node_id not in {n["node"] for n in pool.nodes()}
        req = _slow(str(tmp_path), 99)
        pool.submit(req)
        killed = []
        deadline = time.monotonic() + 120
        got = None
        while time.monotonic() < deadline and got is None:
            placed = pool.placement().get(req.key)
            node = next((n for n in cluster.worker_nodes if n.node_id == placed), None)
            if node is not None and node.node_id not in killed:
                time.sleep(0.3)
                killed.append(node.node_id)
                cluster.remove_node(node, allow_graceful=False)
            got = pool.next_result(0.2)
        assert got is not None and got[1].status is Status.CRASH and "twice" in got[1].error, got
        assert len(killed) == 2


def test_the_directories_of_killed_nodes_are_swept(tmp_path):
    import subprocess
    import sys

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    homes = {}
    for name, pid in (("dead", dead.pid), ("alive", os.getpid()), ("unowned", None)):
        homes[name] = tmp_path / f"evoforge-node-{name}"
        (homes[name] / "cache").mkdir(parents=True)
        if pid is not None:
            (homes[name] / "owner.pid").write_text(str(pid))
    assert sweep_node_homes(str(tmp_path)) == [str(homes["dead"])]
    assert not homes["dead"].exists() and homes["alive"].exists() and homes["unowned"].exists()


def test_fingerprints_are_compared_on_what_decides_speed():
    a = {"cpu_model": "Xeon", "machine": "x86_64", "cpu_flags_sha256": "f1", "compiler": "gcc 14", "blas": {},
         "numpy": "2.3"}  # fmt: skip
    assert speed_differences(a, dict(a)) == []
    assert speed_differences(a, {**a, "cpu_model": "EPYC", "compiler": "gcc 13"}) == ["cpu_model", "compiler"]


def test_nodes_of_another_cpu_are_refused_unless_ranked_by_ratio(cluster):
    class OtherCpuOffTheHead(NodeEvaluator):  # defined here: Ray ships it to the nodes by value
        """Reports another CPU model on every node but the head (there is no such machine here)."""

        def describe(self) -> dict:
            info = super().describe()
            head = any(n["NodeID"] == info["node"] and "node:__internal_head__" in n["Resources"] for n in ray.nodes())
            return info if head else {**info, "speed": {**info["speed"], "cpu_model": "Some Other CPU"}}

    with RayPool(cluster.address, workers_per_node=1):  # connected, to count the nodes
        _ensure_nodes(cluster, 2)
    with pytest.raises(MixedHardware, match="differs from the others in cpu_model"):
        RayPool(cluster.address, workers_per_node=1, evaluator=OtherCpuOffTheHead)
    lines: list[str] = []
    with RayPool(cluster.address, workers_per_node=1, fingerprints="ratio", evaluator=OtherCpuOffTheHead,
                 say=lines.append) as pool:  # fmt: skip
        assert len(pool.nodes()) >= 2
    assert any("ranked by vs_reference" in line for line in lines)


def test_ratio_ranking_makes_vs_reference_the_fitness(cluster, tmp_path):
    cluster.wait_for_nodes()
    with RayPool(cluster.address, workers_per_node=1, fingerprints="ratio") as pool:
        req = request(str(tmp_path), params={"UNROLL": 2})
        pool.submit(req)
        result = _all(pool, 1)[req.key]
    assert result.status is Status.OK and result.metrics["ranked_by"] == "vs_reference"
    assert result.fitness == result.metrics["vs_reference"] and result.metrics["fitness_measured"] > 0


def test_a_cluster_that_cannot_be_reached_is_one_clear_error_not_a_hang():
    t0 = time.monotonic()
    with pytest.raises(ClusterUnavailable, match="no Ray cluster answers at 127.0.0.1:9"):
        RayPool("127.0.0.1:9")
    assert time.monotonic() - t0 < 15


def test_a_node_without_the_compiler_is_one_clear_error(cluster):
    cluster.wait_for_nodes()
    with pytest.raises(ClusterUnavailable, match="no-such-cc"):
        RayPool(cluster.address, cc="no-such-cc")


def test_candidate_code_cannot_reach_rays_control_plane(pool, cluster, tmp_path):
    from runtime.sandbox.filters import filter_available

    if not filter_available():
        pytest.skip("libseccomp is not installed")
    host, port = cluster.address.rsplit(":", 1)
    source = rf"""
#include <arpa/inet.h>
#include <sys/socket.h>
#include <unistd.h>
void kernel(int n, float a, float b, const float *x, float *y) {{
    int s = socket(AF_INET, SOCK_STREAM, 0), reached = 0;
    if (s >= 0) {{
        struct sockaddr_in addr = {{0}};
        addr.sin_family = AF_INET; addr.sin_port = htons({port});
        inet_pton(AF_INET, "{host}", &addr.sin_addr);
        reached = connect(s, (struct sockaddr *)&addr, sizeof addr) == 0;
        close(s);
    }}
    for (int i = 0; i < n; i++) y[i] = a * x[i] + b + (s >= 0 || reached ? 1.0f : 0.0f);
}}
"""
    req = request(str(tmp_path), source)
    pool.submit(req)
    result = _all(pool, 1)[req.key]
    assert result.status is Status.OK, result.error  # its socket was refused: its outputs stayed right


def test_an_evaluator_reserves_what_it_measures_with(cluster):
    """Ray places nothing else on the CPUs a node's evaluator measures with (all of them for an engine's
    load test); a CUDA task takes every GPU of a node, one slot each, and leaves out nodes without one."""
    from runtime.executors.ray import node_reservation

    assert node_reservation({"CPU": 8}, workers_per_node=None, whole_machine=False, gpus=False) == (8, 0)
    assert node_reservation({"CPU": 8}, workers_per_node=2, whole_machine=False, gpus=False) == (2, 0)
    assert node_reservation({"CPU": 8}, workers_per_node=1, whole_machine=True, gpus=False) == (8, 0)
    assert node_reservation({"CPU": 8, "GPU": 2}, workers_per_node=None, whole_machine=False, gpus=True) == (1, 2)
    assert node_reservation({"CPU": 8}, workers_per_node=None, whole_machine=False, gpus=True) == (1, 0)

    ray.init(address=cluster.address, log_to_driver=False)  # this test's own connection: the pools reuse it
    try:
        _ensure_nodes(cluster, 2)
        cluster.add_node(num_cpus=2, num_gpus=1, object_store_memory=80 * 2**20)
        cluster.wait_for_nodes()

        @ray.remote(num_cpus=1)
        def other_work() -> str:
            return ray.get_runtime_context().get_node_id()

        said: list[str] = []
        with RayPool(cluster.address, workers_per_node=1, whole_machine=True, say=said.append) as p:
            assert all(n["reserved"]["CPU"] == n_cpus(n["node"]) for n in p.nodes())
            ref = other_work.remote()
            ready, _ = ray.wait([ref], timeout=3)
            assert not ready, "Ray placed other work on a machine an engine evaluator holds"
        assert ray.get(ref, timeout=60)  # placed once the evaluators let the machines go
        said.clear()
        with RayPool(cluster.address, gpus=True, say=said.append) as p:
            (node,) = p.nodes()  # only the node with a GPU
            assert node["reserved"] == {"CPU": 1, "GPU": 1} and p.slots == 1
        assert any("no GPU" in line for line in said)
    finally:
        ray.shutdown()


def n_cpus(node_id: str) -> int:
    return next(int(n["Resources"]["CPU"]) for n in ray.nodes() if n["NodeID"] == node_id)
