"""The linear kernels an engine run offers, in the engine's own ``linear`` slot, against numpy, one core.

    python bench/engine_linear_slot.py --run-dir factories/xeon_avx2/runs/engine-r1 --id 34723f631bf7
    EVOFORGE_CPU_ISA=avx2 python bench/engine_linear_slot.py --run-dir DIR --id ID --ms 16 32 75 256 \\
        --kernels 02ec7aeafd48eb6c 479e94cf30a88cf4@linear_int8_avx2

Each kernel (default: every one the run's ``kernel_linear`` gene offers) is put in the elite's linear slot
(``load_elite`` with the slot overridden) and called as a forward pass calls it: ``ops.linear(x, w, b)`` on the
model's own weights, its four GEMMs of a layer (MiniLM: QKV, attention output, feed-forward up and down) in turn
over every layer, so each call finds its weights where a forward pass leaves them. Printed: GFLOP/s (int8
kernels' ops counted alike) at each m, the range over the weight shapes, one row per kernel, numpy's
(``x @ w + b``, its BLAS on one thread) first. A kernel's task and id are in its name (``<id>@<task>`` where two
tasks' kernels share an id). Figures of one run compare; timings drift between runs.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from runtime import isa

isa.exec_masked()  # before numpy's BLAS loads under EVOFORGE_CPU_ISA=avx2

from threadpoolctl import threadpool_limits  # noqa: E402

from archive import Run  # noqa: E402
from runtime.engine import elite_task, load_elite  # noqa: E402
from runtime.timing import pinned  # noqa: E402


def model_weights(model: Any) -> dict[tuple[int, int], list[np.ndarray]]:
    """The model's weights of its linear layers, by shape (``k, n``: hidden to 3 x hidden, hidden, intermediate,
    and intermediate to hidden), in the layers' order."""
    found: dict[tuple[int, int], list[np.ndarray]] = {}

    def walk(obj: object, depth: int) -> None:
        if isinstance(obj, np.ndarray):
            if obj.ndim == 2 and obj.dtype == np.float32 and min(obj.shape) >= 64:
                found.setdefault(obj.shape, []).append(obj)
        elif depth < 4 and isinstance(obj, list | tuple):
            for x in obj:
                walk(x, depth + 1)
        elif depth < 4 and hasattr(obj, "__dict__"):
            for x in vars(obj).values():
                walk(x, depth + 1)

    walk(model, 0)
    h, i = model.config.hidden, model.config.intermediate
    return {shape: ws for shape, ws in found.items() if shape in ((h, 3 * h), (h, h), (h, i), (i, h))}


def rates(linear, weights: dict[tuple[int, int], list[np.ndarray]], m: int, seconds: float) -> list[float]:
    """GFLOP/s of ``linear`` at ``m`` rows for each weight shape, cycling that shape's weights."""
    rng = np.random.default_rng(m)
    out = []
    for (k, n), ws in sorted(weights.items()):
        x, b = rng.standard_normal((m, k)).astype(np.float32), np.zeros(n, np.float32)
        for w in ws:  # packs each weight once, as the first forward pass does
            linear(x, w, b)
        calls, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            for w in ws:
                linear(x, w, b)
            calls += len(ws)
        out.append(2.0 * m * k * n * calls / (time.perf_counter() - t0) / 1e9)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", required=True, help="an engine run whose kernel_linear gene offers the kernels")
    ap.add_argument("--id", required=True, help="the elite whose engine hosts them (its other slots stay)")
    ap.add_argument("--kernels", nargs="*", help="offered names (default: every one the run offers)")
    ap.add_argument("--ms", nargs="*", type=int, default=[16, 32, 75, 256], help="rows of x (tokens of a call)")
    ap.add_argument("--seconds", type=float, default=0.3, help="timing per shape and m")
    args = ap.parse_args()
    with Run.open(args.run_dir) as run:
        task, config, _, _ = elite_task(run, args.id)
        names = args.kernels or task.kernel_choices().get("linear", [])
        weights = model_weights(task.model())
        print(f"linear slot of {args.id} ({run.path}), one core, CPU level {isa.level()}; GFLOP/s, the range over "
              f"the shapes {sorted(weights)}")
        print("| kernel | " + " | ".join(f"m = {m}" for m in args.ms) + " |")
        print("| --- |" + " --- |" * len(args.ms))
        with pinned(None, 1), threadpool_limits(1):  # numpy's BLAS on the one core too
            for name in ["numpy", *names]:
                kernels = {k: v for k, v in config.kernels.items() if k != "linear"}
                if name != "numpy":
                    kernels["linear"] = name
                engine = load_elite(run, args.id, overrides={"kernels": kernels})
                try:
                    cells = [rates(engine.ops.linear, weights, m, args.seconds) for m in args.ms]
                finally:
                    engine.close()
                print(f"| {name} | " + " | ".join(f"{min(c):.1f}-{max(c):.1f}" for c in cells) + " |", flush=True)


if __name__ == "__main__":
    main()
