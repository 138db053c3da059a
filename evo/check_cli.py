"""``evo check CONFIG``: compile (and check) a config's seeds and a sample of its space before a long run,
with the columns the task's backend reports (ptxas' figures for CUDA); and the pre-flight that stops
``evo run`` on a machine that cannot evaluate the task (no compiler, a CUDA config without a GPU)."""

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
from runtime import BackendUnavailable, Task, backend_for
from runtime.backends import Column

__all__ = ["check", "require_backend"]


def require_backend(config: RunConfig, config_path: Path | str, *, compile_only: bool = False) -> None:
    """Raises :class:`UserError` (one line, with the fix) when this machine cannot evaluate (or, with
    ``compile_only``, compile) the config's task."""
    task = config.make_task()
    try:
        backend_for(task).preflight(task, config.evaluation, compile_only=compile_only)
    except BackendUnavailable as exc:
        hint = f". Its candidates can still be compiled here: evo check {config_path} --compile-only"
        raise UserError(f"{exc}{hint if exc.compile_only else ''}") from None


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
    """Compiles one point in this process. Nothing of it is loaded or run (a backend's compile stage only
    builds), so no sandbox is needed."""
    from runtime.backends import Failure, WorkerContext
    from runtime.toolchain.nvcc import DEFAULT_ARCH

    cuda = config.evaluation.cuda
    settings = config.evaluation.model_copy(update={"cuda": cuda.model_copy(update={"arch": arch or cuda.arch
                                                                                     or DEFAULT_ARCH})})
    t0 = time.perf_counter()
    try:
        metrics = backend_for(task).compile(task, genome, settings, WorkerContext(cache, None, None)).metrics
        status, error = "ok", None
    except Failure as exc:
        status, error, metrics = str(exc.status), str(exc), {}
    metrics.pop("compile_cached", None)
    return {"status": status, "error": error, "compile_s": round(time.perf_counter() - t0, 3), **metrics}


def _table(rows: list[dict[str, Any]], title: str, columns: tuple[Column, ...]) -> Table:
    table = Table(title=title)
    table.add_column("point")
    table.add_column("status")
    for col in columns:
        table.add_column(col.header, justify=col.justify)
    table.add_column("compile s", justify="right")
    table.add_column("params")
    for r in rows:
        cells = []
        for col in columns:
            v = r.get(col.metric)
            if v is None:
                cells.append("-")
            else:
                cells.append(f"{v:.0%}" if col.percent else f"{v:.4g}" if isinstance(v, float) else str(v))
        table.add_row(r["point"], r["status"], *cells, f"{r['compile_s']:.2f}",
                      " ".join(f"{k}={v}" for k, v in r["params"].items()))  # fmt: skip
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
    require_backend(config, config_path, compile_only=compile_only)
    todo = _points(config, task, points, seed)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="evo-check-") as cache:
        if compile_only:
            for label, g in todo:
                rows.append({"point": label, **_compile_one(config, task, g, arch, cache), "params": g.params})
        else:
            rows = _check_in_pool(config, config_path, task, todo, cache)
    if as_json:
        click.echo(json.dumps(rows, indent=2, default=str))
    else:
        what = "compiled" if compile_only else "checked"
        con = Console()
        if not con.is_terminal:  # piped: do not squeeze the table into 80 columns
            con = Console(width=220)
        title = f"{config_path}: {task.name}, {len(rows)} points {what}"
        con.print(_table(rows, title, backend_for(task).check_columns))
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
    from runtime.toolchain.cc import CompilerNotFound

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
