"""``evo check CONFIG``: compile (and, with a GPU, check) a config's seeds and a sample of its space
before a long run; and the pre-flight that stops ``evo run`` on a CUDA config without a GPU."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

import click
import numpy as np
from rich.console import Console
from rich.table import Table

from evo.config import RunConfig, load_config
from evo.errors import UserError
from genome import Genome
from runtime import Task

__all__ = ["check", "require_backend"]


def require_backend(config: RunConfig, config_path: Path | str) -> None:
    """Raises :class:`UserError` (one line, with the fix) when this machine cannot evaluate the config's task."""
    task = config.make_task()
    if task.backend != "cuda":
        return
    from runtime.backends.cuda import NvccNotFound, nvcc_version
    from runtime.backends.cuda_device import CudaUnavailable, require_gpu

    try:
        nvcc_version(config.evaluation.cuda.nvcc)
        require_gpu()
    except (NvccNotFound, CudaUnavailable) as exc:
        raise UserError(
            f"task {task.name!r} runs on an NVIDIA GPU, and this machine cannot: {exc}. "
            f"Without a GPU, check that its kernels compile with: evo check {config_path} --compile-only"
        ) from None


def _points(config: RunConfig, task: Task, n: int, seed: int) -> list[tuple[str, Genome]]:
    """Every seed, then ``n`` distinct valid points drawn from the space."""
    points = [(f"seed {i}", g) for i, g in enumerate(task.seeds())]
    space, rng, seen = config.make_space(task), np.random.default_rng(seed), {g.id for _, g in points}
    for _ in range(20 * n):
        if len(points) >= len(task.seeds()) + n:
            break
        g = Genome(params=space.sample(rng))
        if g.id not in seen:
            seen.add(g.id)
            points.append((f"sample {len(points) - len(task.seeds())}", g))
    return points


def _compile_one(config: RunConfig, task: Task, genome: Genome, arch: str | None, cache: str) -> dict[str, Any]:
    """Compiles one point in this process (seeds and template points are ours, not untrusted code)."""
    from runtime.cascade import Failure
    from runtime.result import Status

    t0 = time.perf_counter()
    try:
        if task.backend == "cuda":
            from runtime.backends.cuda import DEFAULT_ARCH
            from runtime.cuda_cascade import compile_candidate

            _, metrics = compile_candidate(
                task, genome, config.evaluation, arch=arch or config.evaluation.cuda.arch or DEFAULT_ARCH,
                cache_dir=cache,
            )  # fmt: skip
        else:
            from runtime.backends.c import CompileError, compile_source

            try:
                compile_source(task.render(genome), compiler=config.evaluation.compiler,
                               extra_flags=task.compile_flags(), cache_dir=cache)  # fmt: skip
            except CompileError as exc:
                raise Failure(Status.COMPILE_ERROR, exc.stderr) from None
            metrics = {}
        status, error = "ok", None
    except Failure as exc:
        status, error, metrics = str(exc.status), str(exc), {}
    metrics.pop("compile_cached", None)
    return {"status": status, "error": error, "compile_s": round(time.perf_counter() - t0, 3), **metrics}


def _table(rows: list[dict[str, Any]], title: str) -> Table:
    table = Table(title=title)
    cols = ("point", "status", "regs", "smem B", "spill B", "threads", "occupancy", "limited by", "compile s", "params")
    for col in cols:
        table.add_column(col, justify="left" if col in ("point", "status", "limited by", "params") else "right")
    for r in rows:
        occ = r.get("occupancy")
        table.add_row(
            r["point"], r["status"], str(r.get("registers", "-")), str(r.get("smem_bytes", "-")),
            str(r.get("spill_bytes", "-")), str(r.get("threads_per_block", "-")),
            f"{occ:.0%}" if occ is not None else "-", str(r.get("occupancy_limited_by", "-")), f"{r['compile_s']:.2f}",
            " ".join(f"{k}={v}" for k, v in r["params"].items()),
        )  # fmt: skip
    return table


@click.command()
@click.argument("config_path", metavar="CONFIG", type=click.Path(path_type=Path))
@click.option("--compile-only", is_flag=True, help="only compile (no GPU needed for CUDA tasks; nvcc is)")
@click.option("--points", default=4, show_default=True, type=click.IntRange(min=0), help="template points sampled")
@click.option("--arch", help="CUDA target for --compile-only, e.g. sm_90 [default: evaluation.cuda.arch or sm_80]")
@click.option("--seed", default=0, show_default=True, type=int, help="seed of the sampled points")
@click.option("--json", "as_json", is_flag=True, help="print JSON (a list of objects, one per point)")
def check(config_path: Path, compile_only: bool, points: int, arch: str | None, seed: int, as_json: bool) -> None:
    """Compile (and check) CONFIG's seeds and a sample of its space; report ptxas figures for CUDA tasks."""
    config = load_config(config_path)
    task = config.make_task()
    if task.backend not in ("c", "cuda"):
        raise UserError(f"evo check knows C and CUDA tasks; {task.name!r} is evaluated by backend {task.backend!r}")
    todo = _points(config, task, points, seed)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="evo-check-") as cache:
        if compile_only:
            try:
                for label, g in todo:
                    rows.append({"point": label, **_compile_one(config, task, g, arch, cache), "params": g.params})
            except Exception as exc:  # nvcc or cc missing: the user's environment
                if type(exc).__name__ in ("NvccNotFound", "CompilerNotFound"):
                    raise UserError(str(exc)) from None
                raise
        else:
            rows = _check_in_pool(config, config_path, task, todo, cache)
    if as_json:
        click.echo(json.dumps(rows, indent=2, default=str))
    else:
        what = "compiled" if compile_only else "checked"
        con = Console()
        if not con.is_terminal:  # piped: do not squeeze the table into 80 columns
            con = Console(width=220)
        con.print(_table(rows, f"{config_path}: {task.name}, {len(rows)} points {what}"))
        for r in rows:
            if r["error"]:
                click.echo(f"{r['point']}: {r['status']}: {r['error'].splitlines()[0][:200]}")
    bad = [r["point"] for r in rows if r["status"] != "ok"]
    if bad:
        raise UserError(f"{len(bad)} of {len(rows)} points failed ({', '.join(bad)}): see the table above")


def _check_in_pool(
    config: RunConfig, config_path: Path, task: Task, todo: list[tuple[str, Genome]], cache: str
) -> list[dict[str, Any]]:
    """Compiles and checks each point for correctness in the sandboxed pool (no timing)."""
    from runtime import EvalRequest, LocalPool
    from runtime.backends.c import CompilerNotFound

    require_backend(config, config_path)
    sys_path = (str(Path(config_path).parent.resolve()),)
    rows = []
    with LocalPool(workers=1) as pool:
        for label, g in todo:
            try:
                pool.submit(EvalRequest(key=label, genome=g, task=config.task, settings=config.evaluation,
                                        cache_dir=cache, sys_path=sys_path, stages="check"))  # fmt: skip
            except CompilerNotFound as exc:
                raise UserError(str(exc)) from None
            item = None
            while item is None:
                item = pool.next_result(timeout=1.0)
            result = item[1]
            compile_s = result.timings.get("compile_s", 0.0)
            rows.append({"point": label, "status": str(result.status), "error": result.error, "compile_s": compile_s,
                         **result.metrics, "params": g.params})  # fmt: skip
    return rows
