"""``evo serve``: host a run's engine elite, or a GGUF chat model, over HTTP (the ``serve`` extra; see
:mod:`serving`)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from evo.errors import UserError

__all__ = ["serve"]


@click.command()
@click.argument("run_dir", type=click.Path(path_type=Path), required=False)
@click.option("--follow", "follow", metavar="FACTORY_DIR", type=click.Path(path_type=Path),
              help="serve what the factory in FACTORY_DIR promotes, swapping to each new promotion (no RUN_DIR)")
@click.option("--gguf", "gguf", metavar="FILE", type=click.Path(path_type=Path),
              help="serve the chat model of a GGUF file on the decoder engine: /v1/chat/completions and "
              "/v1/completions (no RUN_DIR)")
@click.option("--elite", default="best", show_default=True,
              help="engine elite id (or unique prefix), 'best', or 'default' (the default engine configuration)")
@click.option("--host", default="127.0.0.1", show_default=True, help="address to bind (loopback by default)")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535), help="port to listen on")
@click.option("--api-key-env", metavar="NAME", help="environment variable holding the API key (bearer token); "
              "required for /admin, and then for /v1 too")
@click.option("--max-in-flight", default=256, show_default=True, type=click.IntRange(min=1),
              help="embeddings requests served at once; more get 429")
@click.option("--drain-timeout", default=30.0, show_default=True, type=click.FloatRange(min=0),
              help="seconds to finish in-flight requests after SIGTERM")
@click.option("--warmup", default=8, show_default=True, type=click.IntRange(min=1),
              help="texts run through an engine before it serves (at start-up and on a switch)")
@click.option("--body-timeout", default=30.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="seconds a request's body may take to arrive; a slower one gets 408 and its connection closed")
@click.option("--kv-cache-mb", default=2048.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="--gguf: KV cache the running requests may hold together (each holds its prompt plus max_tokens)")
@click.option("--max-waiting", default=64, show_default=True, type=click.IntRange(min=0),
              help="--gguf: requests that wait for KV cache; more get 429")
@click.option("--step-tokens", default=64, show_default=True, type=click.IntRange(min=1),
              help="--gguf: tokens one engine step runs (a token of each decoding request, then prompt chunks)")
@click.option("--linear", default=None, metavar="numpy|PRECISION[:MATRIX=PRECISION,...]",
              help="--gguf: what runs the weight GEMMs and the LM head [default: fp32 where this CPU runs its C "
              "kernel (batch-invariant), else numpy]: numpy (fp32, BLAS) or the linear slot's C "
              "kernel in fp32, int8, bf16 or q8 (int8 with activations scaled per 32 values; weights quantised at "
              "load), a matrix (qkv, o, gate_up, down, "
              "lm_head) in another if named, e.g. int8:lm_head=fp32 (see the README for what each holds)")
@click.option("--slots", type=click.Choice(["c", "numpy"]), default="c", show_default=True,
              help="--gguf: the slots besides the GEMMs: c runs the attention (every request of a step in one call, "
              "decode steps and prompt chunks alike, batch-invariant) and RMSNorm on their tasks' C kernels; numpy "
              "runs them in numpy")
@click.option("--kv-dtype", type=click.Choice(["fp32", "f16"]), default="fp32", show_default=True,
              help="--gguf: the KV cache's type (f16: half the memory and the attention's reads; keys and values "
              "rounded to f16)")
@click.option("--head", type=click.Choice(["full", "topk"]), default="full", show_default=True,
              help="--gguf: the LM head: full logits (on --linear's kernels), or topk: steps whose sampling needs no "
              "more (greedy, top-k, up to 20 logprobs) keep each row's 64 likeliest tokens on the lm_head_topk kernel "
              "(q8), never writing the logits")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="--gguf: threads of the engine's GEMMs (BLAS or the C kernels) [default: every core]")
@click.option("--max-running", default=64, show_default=True, type=click.IntRange(1, 4096),
              help="--gguf: requests in the running batch at most; more wait for a place")
@click.pass_context
def serve(ctx: click.Context, run_dir: Path | None, follow: Path | None, gguf: Path | None, elite: str, host: str,
          port: int, api_key_env: str | None, max_in_flight: int, drain_timeout: float, warmup: int,
          body_timeout: float, kv_cache_mb: float, max_waiting: int, step_tokens: int, linear: str | None,
          slots: str, kv_dtype: str, head: str, threads: int | None, max_running: int) -> None:
    """Serve RUN_DIR's engine elite: OpenAI-compatible /v1/embeddings, archive queries, kernel invocation,
    /health, /ready, /metrics. A run that is not an engine run (or has no ok engine candidate) is served
    with the default engine configuration, and says so. SIGTERM drains in-flight requests, then exits 0.
    With --follow FACTORY_DIR, serves the factory's latest promotion and swaps to each new one. With
    --gguf FILE, serves that chat model: /v1/chat/completions and /v1/completions, continuously batched."""
    try:
        from serving import Limits, ServeError, serve_gguf
        from serving import serve as run_server
    except ImportError as exc:
        raise UserError(f"evo serve needs the serve extra ({exc.name} is missing): "
                        "pip install -c constraints.txt -e '.[serve,engine]'") from None
    if sum(x is not None for x in (run_dir, follow, gguf)) != 1:
        raise UserError("give one of RUN_DIR, --follow FACTORY_DIR or --gguf FILE (see evo serve --help)")
    chat_only = ("kv_cache_mb", "max_waiting", "step_tokens", "linear", "slots", "kv_dtype", "head", "threads",
                 "max_running")
    _refuse_unused(ctx, ("elite", "max_in_flight", "warmup") if gguf else chat_only)
    from evo.unfiltered import warn_if_unfiltered

    warn_if_unfiltered()
    limits = Limits(max_in_flight=max_in_flight, body_timeout_s=body_timeout)
    try:
        if gguf is not None:
            from pydantic import ValidationError

            from runtime.decoder import SchedulerConfig
            from runtime.decoder.engine import ChatEngine

            try:
                chosen = {} if linear is None else {"linear": linear}
                engine = ChatEngine(**chosen, slots=slots, kv_dtype=kv_dtype, head=head, step_tokens=step_tokens,
                                    max_running=max_running, threads=threads)  # fmt: skip
            except ValidationError as exc:
                err = exc.errors()[0]
                flag = str(err["loc"][0]).replace("_", "-")
                raise UserError(f"--{flag} {err['input']}: {err['msg'].removeprefix('Value error, ')}") from None
            budgets = SchedulerConfig(kv_budget_bytes=int(kv_cache_mb * 2**20), max_waiting=max_waiting)
            code = serve_gguf(gguf, engine=engine, host=host, port=port, api_key_env=api_key_env, limits=limits,
                              budgets=budgets, drain_timeout=drain_timeout)  # fmt: skip
        else:
            code = run_server(run_dir, follow=follow, elite=elite, host=host, port=port, api_key_env=api_key_env,
                              limits=limits, drain_timeout=drain_timeout, warmup=warmup)  # fmt: skip
    except ServeError as exc:
        raise UserError(str(exc)) from None
    sys.exit(code)


def _refuse_unused(ctx: click.Context, names: tuple[str, ...]) -> None:
    """Options given that do not apply to what is served are refused, not ignored."""
    from click.core import ParameterSource

    given = [f"--{n.replace('_', '-')}" for n in names if ctx.get_parameter_source(n) == ParameterSource.COMMANDLINE]
    if given and ctx.params.get("gguf") is not None:
        raise UserError(f"{', '.join(given)} does not apply to a chat model (--gguf): drop it")
    if given:
        raise UserError(f"{', '.join(given)} applies to --gguf only: drop it, or serve a GGUF file")
