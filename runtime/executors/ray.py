"""``RayPool``: the :class:`~runtime.executors.base.Executor` on a Ray cluster, a local pool on every node.

The driver (the controller: store, archive, memory, model calls) keeps everything it keeps with a local
pool; only requests and results travel. Each node runs one :class:`NodeEvaluator` actor, which owns a
:class:`runtime.executors.local.LocalPool` of sandboxed workers there: the same trust boundary, rlimits and privilege
drop as on one machine, the node's own compile cache, and the timing lock file of its host (Ray nodes on
one host share it, so timing stays serialised per physical machine). Ray places nothing else: each
request goes to the node with the most free slots, and a duel is one request, so both contestants run
side by side on one node.

What travels: the request, and the source files of a user's task module (the driver reads them; the
node writes them into a directory of its own and imports from there). An engine task's kernels travel
inside its arguments (read from their runs when the task was resolved): no path of the driver's disk is
needed on a node. Each node evaluates one engine at a time
(``workers_per_node`` defaults to 1 for engine tasks): its load test wants the machine. A node's
environment is scrubbed when its actor starts (Ray workers inherit the environment of whoever started
the node), so no API key reaches a node.

Faults: a node that dies with requests in flight gives them back to the queue once; a request whose
second node dies too ends ``crash``. A node that joins later gets work. Results carry the node that
measured them (``metrics.node``) and its hardware fingerprint. ``fingerprints: same`` (the default)
refuses a cluster whose nodes differ in what decides speed (CPU model and flags, compiler, BLAS);
``ratio`` ranks by ``vs_reference`` measured on each node instead (``fitness`` becomes it, the measured
figure stays in ``metrics.fitness_measured``).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import glob
import hashlib
import importlib.util
import itertools
import logging
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from runtime import isa
from runtime.executors.base import EvalRequest, Executor
from runtime.executors.local import LocalPool, request_backend
from runtime.result import EvalResult, Status

__all__ = ["ClusterUnavailable", "MixedHardware", "NodeEvaluator", "RayPool", "speed_differences",
           "speed_fingerprint"]

Fingerprints = Literal["same", "ratio"]
_KEPT_ENV_PREFIXES = ("RAY_", "PYTHON", "OMP_", "OPENBLAS_", "MKL_", "CUDA_", "LC_")
_KEPT_ENV = ("PATH", "HOME", "LANG", "TZ", "TMPDIR", "USER", "LOGNAME")
_SPEED_KEYS = ("cpu_model", "machine", "cpu_flags_sha256", "compiler", "blas", "numpy")
_DISCOVER_EVERY_S = 2.0


class ClusterUnavailable(RuntimeError):
    """The Ray cluster cannot be reached or used (the message says how to fix it)."""


class MixedHardware(RuntimeError):
    """The cluster's nodes differ in what decides speed, and the run asked for one fingerprint."""


def speed_fingerprint(hardware: dict[str, Any]) -> dict[str, Any]:
    """What decides speed in a hardware fingerprint: CPU model and flags, compiler, BLAS, numpy (not the
    core counts a node was given, the OS release or the Python patch version)."""
    return {k: hardware.get(k) for k in _SPEED_KEYS}


def speed_differences(first: dict[str, Any], other: dict[str, Any]) -> list[str]:
    """The keys of two speed fingerprints (:func:`speed_fingerprint`) that differ."""
    return [k for k in _SPEED_KEYS if first.get(k) != other.get(k)]


def _require_reachable(address: str | None, timeout: float = 5.0) -> None:
    """A ``host:port`` (or ``ray://host:port``) that no one answers on is an error now: Ray itself would
    retry for minutes. ``auto`` (or none) is left to Ray, which fails at once when no cluster runs here."""
    if not address or address == "auto" or address == "local":
        return
    hostport = address.removeprefix("ray://")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise ClusterUnavailable(f"execution.address {address!r} is not host:port or ray://host:port")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as exc:
        raise ClusterUnavailable(f"no Ray cluster answers at {address} ({exc.strerror or exc}): start one with "
                                 "`ray start --head`, check the address, or run without --ray") from None


def _scrub_environment() -> None:
    level = isa.carried()  # the node's instruction-set level stays: its workers compile and run at it
    for key in list(os.environ):
        if key not in _KEPT_ENV and key not in level and not key.startswith(_KEPT_ENV_PREFIXES):
            del os.environ[key]


# --- on a node -------------------------------------------------------------------------------------------


_HOME_PREFIX = "evoforge-node-"


def sweep_node_homes(tmp: str) -> list[str]:
    """Removes the node directories in ``tmp`` whose actor process is gone without closing (a node or driver
    killed); returns them. A directory without an owner's pid is left alone."""
    removed = []
    for home in glob.glob(os.path.join(tmp, _HOME_PREFIX + "*")):
        try:
            with open(os.path.join(home, "owner.pid")) as f:
                pid = int(f.read())
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(home, ignore_errors=True)
            removed.append(home)
        except (OSError, ValueError):  # not ours to judge: no pid file, or a process of another user
            continue
    return removed


class NodeEvaluator:
    """One node's evaluations: a local pool of ``workers`` sandboxed workers (created as a Ray actor)."""

    def __init__(self, workers: int, cc: str = "cc") -> None:
        from runtime.sandbox.limits import make_undumpable

        _scrub_environment()
        make_undumpable()
        sweep_node_homes(tempfile.gettempdir())
        self.home = tempfile.mkdtemp(prefix=_HOME_PREFIX)
        with open(os.path.join(self.home, "owner.pid"), "w") as f:
            f.write(str(os.getpid()))
        self.workers, self.cc = workers, cc
        self.pool = LocalPool(workers=workers, log_dir=os.path.join(self.home, "logs"))
        self._waiting: dict[str, concurrent.futures.Future[EvalResult]] = {}
        self._seq = itertools.count()
        self._closed = False
        import ray

        self._node = ray.get_runtime_context().get_node_id()
        threading.Thread(target=self._collect, name="evoforge-node-results", daemon=True).start()

    def describe(self) -> dict[str, Any]:
        """This node: its id, host, slots, hardware fingerprint, and whether the compiler runs here."""
        import ray

        from runtime.hardware import fingerprint
        from runtime.toolchain.cc import CompilerNotFound, compiler_version

        try:
            compiler_version(self.cc)
            missing = None
        except CompilerNotFound as exc:
            missing = str(exc)
        hardware = fingerprint(self.cc)
        return {"node": ray.get_runtime_context().get_node_id(), "host": socket.gethostname(),
                "workers": self.workers, "hardware": hardware, "speed": speed_fingerprint(hardware),
                "compiler_missing": missing, "environment": sorted(os.environ)}  # fmt: skip

    def _collect(self) -> None:
        while not self._closed:
            got = self.pool.next_result(0.5)
            if got is not None:
                fut = self._waiting.pop(got[0].key, None)
                if fut is not None:
                    fut.set_result(got[1])

    def _localize(self, request: EvalRequest, modules: dict[str, str]) -> EvalRequest:
        """The request with this node's compile cache (one per driver cache) and the shipped module files."""
        cache = os.path.join(self.home, "cache", hashlib.sha256(request.cache_dir.encode()).hexdigest()[:16])
        sys_path: tuple[str, ...] = ()
        if modules:
            digest = hashlib.sha256(repr(sorted(modules.items())).encode()).hexdigest()[:16]
            root = os.path.join(self.home, "modules", digest)
            if not os.path.isdir(root):
                for rel, text in modules.items():
                    path = os.path.join(root, rel)
                    os.makedirs(os.path.dirname(path), exist_ok=True)
                    with open(path, "w") as f:
                        f.write(text)
            sys_path = (root,)
        return dataclasses.replace(request, cache_dir=cache, sys_path=sys_path)

    def evaluate(self, request: EvalRequest, modules: dict[str, str]) -> EvalResult:
        """Evaluates ``request`` in this node's pool (one of the actor's threads waits on it); the result says
        which node measured it."""
        local = self._localize(request, modules)
        key = f"{request.key}@{next(self._seq)}"
        fut: concurrent.futures.Future[EvalResult] = concurrent.futures.Future()
        self._waiting[key] = fut
        self.pool.submit(dataclasses.replace(local, key=key))
        result = fut.result()
        return dataclasses.replace(result, metrics={**result.metrics, "node": self._node})

    def close(self) -> None:
        """Stops the pool (killing its workers) and removes this node's directory (caches, copies, logs)."""
        self._closed = True
        self.pool.close()
        shutil.rmtree(self.home, ignore_errors=True)


# --- the driver ------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Job:
    request: EvalRequest
    modules: dict[str, str]
    attempts: int = 0
    lost_on: list[str] = dataclasses.field(default_factory=list)


def node_reservation(resources: dict[str, float], *, workers_per_node: int | None, whole_machine: bool,
                     gpus: bool) -> tuple[int, int]:  # fmt: skip
    """``(CPUs, GPUs)`` an evaluator reserves on a node with these Ray ``resources`` (see :class:`RayPool`)."""
    total_cpus = max(1, int(resources.get("CPU", 1)))
    total_gpus = int(resources.get("GPU", 0))
    if gpus:
        return (1 if not whole_machine else total_cpus), total_gpus
    if whole_machine:
        return total_cpus, 0
    return min(workers_per_node or total_cpus, total_cpus), 0


@dataclasses.dataclass
class _Node:
    actor: Any
    info: dict[str, Any]
    free: int


class RayPool(Executor):
    """Evaluates requests on every node of the Ray cluster at ``address`` (see the module docstring).

    ``workers_per_node``: slots per node (default: the CPUs Ray gives the node, or its GPUs with ``gpus``);
    ``use_head``: evaluate on the head node too (where the driver usually runs); ``evaluator``: the actor
    class (its ``describe``, ``evaluate`` and ``close``; a benchmark's simulated evaluations).

    What a node's evaluator reserves from Ray, so that Ray places nothing else on what it measures with:
    a CPU per slot; every CPU of the node with ``whole_machine`` (an engine's load test wants the
    machine); with ``gpus`` (a CUDA task), every GPU of the node, one slot per GPU, and a node without
    a GPU is left out. Raises
    :class:`ClusterUnavailable` when the cluster cannot be reached or a node cannot compile, and
    :class:`MixedHardware` for nodes of different speed fingerprints under ``fingerprints="same"``."""

    def __init__(self, address: str | None = "auto", *, workers_per_node: int | None = None,
                 fingerprints: Fingerprints = "same", use_head: bool = True, cc: str = "cc",
                 whole_machine: bool = False, gpus: bool = False, start_timeout_s: float = 120.0,
                 say: Callable[[str], None] | None = None, evaluator: type = NodeEvaluator) -> None:  # fmt: skip
        try:
            import ray
        except ImportError:
            raise ClusterUnavailable("Ray is not installed: pip install -e '.[ray]'") from None
        self._ray = ray
        self.fingerprints, self.cc, self.workers_per_node, self.use_head = fingerprints, cc, workers_per_node, use_head
        self._evaluator = evaluator
        self.whole_machine, self.gpus, self.start_timeout_s = whole_machine, gpus, start_timeout_s
        self._say = say or (lambda line: print(f"evoforge: {line}", file=sys.stderr, flush=True))
        self._owns_ray = not ray.is_initialized()
        if not self._owns_ray and address not in (None, "auto", "local"):
            current = ray.get_runtime_context().gcs_address
            if address.removeprefix("ray://") != current:
                raise ClusterUnavailable(f"this process is connected to the Ray cluster at {current}, not {address}")
        if self._owns_ray:
            _require_reachable(address)
            try:
                ray.init(address=address, log_to_driver=False, include_dashboard=False,
                         logging_level=logging.WARNING)  # fmt: skip
            except (ConnectionError, RuntimeError, ValueError) as exc:
                raise ClusterUnavailable(f"no Ray cluster at {address!r} ({str(exc).splitlines()[0]}): start one "
                                         "with `ray start --head`, or run without --ray") from None  # fmt: skip
        self._nodes: dict[str, _Node] = {}
        self._lost: set[str] = set()
        self._speed: dict[str, Any] | None = None
        self._refs: dict[Any, tuple[_Job, str]] = {}
        self._queue: collections.deque[_Job] = collections.deque()
        self._ready: collections.deque[Any] = collections.deque()  # refs found done, not returned yet
        self._modules: dict[str, dict[str, str]] = {}
        self._last_discovery = 0.0
        self._closed = False
        try:
            self._discover()
        except BaseException:
            self.close()
            raise
        if not self._nodes:
            self.close()
            raise ClusterUnavailable(f"the Ray cluster at {address!r} has no node evoforge can use")

    # --- nodes ------------------------------------------------------------------------------------

    @property
    def slots(self) -> int:
        """Evaluation slots over every live node."""
        return sum(n.info["workers"] for n in self._nodes.values())

    def nodes(self) -> list[dict[str, Any]]:
        """What each live node said of itself (id, host, slots, fingerprint)."""
        return [n.info for n in self._nodes.values()]

    def _discover(self) -> None:
        """Starts an evaluator on every live node that has none yet."""
        ray = self._ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self._last_discovery = time.monotonic()
        evaluator = ray.remote(self._evaluator)
        for node in ray.nodes():
            nid = node["NodeID"]
            if not node.get("Alive") or nid in self._nodes or nid in self._lost:
                continue
            if not self.use_head and "node:__internal_head__" in node.get("Resources", {}):
                continue
            cpus, gpus = node_reservation(node.get("Resources", {}), workers_per_node=self.workers_per_node,
                                          whole_machine=self.whole_machine, gpus=self.gpus)  # fmt: skip
            if self.gpus and not gpus:
                self._say(f"node {nid[:12]} left out: it has no GPU for this CUDA task")
                self._lost.add(nid)
                continue
            workers = self.workers_per_node or (gpus if self.gpus else max(1, cpus))
            actor = evaluator.options(
                num_cpus=cpus, num_gpus=gpus, max_restarts=0, max_concurrency=workers + 8,
                scheduling_strategy=NodeAffinitySchedulingStrategy(nid, soft=False),
            ).remote(workers, self.cc)  # fmt: skip
            try:
                info = ray.get(actor.describe.remote(), timeout=self.start_timeout_s)
            except Exception as exc:  # noqa: BLE001 - a node that cannot start one is left out, and said so
                held = f"the {cpus} CPU(s)" + (f" and {gpus} GPU(s)" if gpus else "")
                why = (f"did not start within {self.start_timeout_s:.0f} s: other Ray work may hold {held} it "
                       "reserves" if isinstance(exc, ray.exceptions.GetTimeoutError)
                       else f"did not start ({exc!r:.200})")  # fmt: skip
                self._say(f"node {nid[:12]} left out: its evaluator {why}")
                self._stop(actor)
                self._lost.add(nid)
                continue
            info = {**info, "reserved": {"CPU": cpus, "GPU": gpus}}
            if info["compiler_missing"]:
                self._stop(actor)
                raise ClusterUnavailable(f"node {nid[:12]} ({info['host']}): {info['compiler_missing']}")
            self._check_speed(nid, info)
            self._nodes[nid] = _Node(actor, info, info["workers"])
            self._say(f"node {nid[:12]} ({info['host']}): {info['workers']} slot(s), "
                      f"{info['hardware'].get('cpu_model')}")  # fmt: skip

    def _check_speed(self, nid: str, info: dict[str, Any]) -> None:
        if self._speed is None:
            self._speed = info["speed"]
            return
        differs = speed_differences(self._speed, info["speed"])
        if not differs:
            return
        where = f"node {nid[:12]} ({info['host']})"
        if self.fingerprints == "same":
            raise MixedHardware(f"{where} differs from the others in {', '.join(differs)}: fitness measured there "
                                "would not compare; use nodes of one kind, or set execution.fingerprints: ratio to "
                                "rank by vs_reference measured on each node")  # fmt: skip
        self._say(f"{where} differs in {', '.join(differs)}: results are ranked by vs_reference (fingerprints: ratio)")

    def _node_lost(self, nid: str) -> None:
        node = self._nodes.pop(nid, None)
        self._lost.add(nid)
        if node is not None:
            self._say(f"node {nid[:12]} ({node.info['host']}) is gone; its requests go to the others")
            with contextlib.suppress(Exception):
                self._ray.kill(node.actor)

    # --- Executor ---------------------------------------------------------------------------------

    def _modules_for(self, request: EvalRequest) -> dict[str, str]:
        """The source files of a user's task module (``module:Class``), relative to their import root."""
        module = request.task.name.partition(":")[0] if ":" in request.task.name else ""
        if not module:
            return {}
        if module not in self._modules:
            files: dict[str, str] = {}
            added = [p for p in request.sys_path if p not in sys.path]
            sys.path[:0] = added
            try:
                spec = importlib.util.find_spec(module.split(".")[0])
            finally:
                for p in added:
                    sys.path.remove(p)
            if spec is not None and spec.origin and spec.origin.endswith(".py"):
                origin = Path(spec.origin)
                if origin.name == "__init__.py":  # a package: every module in it
                    for f in origin.parent.rglob("*.py"):
                        files[str(f.relative_to(origin.parent.parent))] = f.read_text()
                else:
                    files[origin.name] = origin.read_text()
            self._modules[module] = files
        return self._modules[module]

    def submit(self, request: EvalRequest) -> None:
        """Queues ``request``; raises here, in the driver, when the task's backend does not offer its stage."""
        if self._closed:
            raise RuntimeError("the pool is closed")
        backend = request_backend(request)
        if backend is not None:
            backend.require(request.stages)
        self._queue.append(_Job(request, self._modules_for(request)))
        self._dispatch()

    def _dispatch(self) -> None:
        while self._queue and self._nodes:
            nid, node = max(self._nodes.items(), key=lambda kv: kv[1].free)
            if node.free <= 0:
                return
            job = self._queue.popleft()
            ref = node.actor.evaluate.remote(job.request, job.modules)
            node.free -= 1
            self._refs[ref] = (job, nid)

    def next_result(self, timeout: float | None = None) -> tuple[EvalRequest, EvalResult] | None:
        ray = self._ray
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if time.monotonic() - self._last_discovery > _DISCOVER_EVERY_S:
                self._discover()
                self._dispatch()
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not self._refs and not self._ready:
                if deadline is not None and left == 0.0:
                    return None
                time.sleep(min(0.05, left if left is not None else 0.05))
                continue
            if not self._ready:
                refs = list(self._refs)
                first, _ = ray.wait(refs, num_returns=1, timeout=min(left, 1.0) if left is not None else 1.0)
                if not first:
                    if deadline is not None and time.monotonic() >= deadline:
                        return None
                    continue
                # every other one that is done too: one scan of the in-flight refs per batch, not per result
                done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
                self._ready.extend(done or first)
            ref = self._ready.popleft()
            job, nid = self._refs.pop(ref)
            if nid in self._nodes:
                self._nodes[nid].free += 1
            try:
                result: EvalResult = ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.NodeDiedError, ray.exceptions.WorkerCrashedError,
                    ray.exceptions.ObjectLostError) as exc:  # fmt: skip
                self._node_lost(nid)
                job.attempts += 1
                job.lost_on.append(nid[:12])
                if job.attempts >= 2:
                    return job.request, EvalResult(status=Status.CRASH, error=(
                        f"the node evaluating it died, twice (nodes {', '.join(job.lost_on)}): {type(exc).__name__}"))
                self._queue.appendleft(job)
                self._dispatch()
                continue
            except ray.exceptions.RayTaskError as exc:
                result = EvalResult(status=Status.INVALID, error=f"internal error on node {nid[:12]}:\n{exc}"[:4000])
            self._dispatch()
            if self.fingerprints == "ratio" and result.fitness is not None:
                vs = result.metrics.get("vs_reference")
                if isinstance(vs, (int, float)):
                    result = dataclasses.replace(
                        result, fitness=float(vs),
                        metrics={**result.metrics, "fitness_measured": result.fitness, "ranked_by": "vs_reference"})
            return job.request, result

    @property
    def in_flight(self) -> int:
        return len(self._refs) + len(self._queue)

    def placement(self) -> dict[str, str]:
        """Request key -> the node evaluating it now (requests still queued are not placed)."""
        return {job.request.key: nid for job, nid in self._refs.values()}

    def _stop(self, actor: Any) -> None:
        with contextlib.suppress(Exception):
            self._ray.get(actor.close.remote(), timeout=30)
        with contextlib.suppress(Exception):
            self._ray.kill(actor)

    def close(self) -> None:
        """Stops every node's pool (killing its workers) and, if this pool connected to Ray, disconnects."""
        if self._closed:
            return
        self._closed = True
        for node in self._nodes.values():
            self._stop(node.actor)
        self._nodes.clear()
        if self._owns_ray:
            with contextlib.suppress(Exception):
                self._ray.shutdown()
