"""Settings of the evaluation runtime. The config embeds these models; workers receive them as they are."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["CompilerSettings", "CudaSettings", "EvalSettings", "SandboxSettings", "TaskSpec", "TimingSettings"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TaskSpec(_Model):
    """Which task, with which arguments: a built-in name (``matmul``) or ``module:Class``."""

    name: str = Field(description="built-in task name or 'module:Class' of a user's task")
    args: dict[str, Any] = Field(default_factory=dict, description="the task's arguments (sizes, threads, ...)")


class CompilerSettings(_Model):
    cc: str = Field("cc", description="C compiler executable")
    flags: list[str] = Field(default_factory=lambda: ["-O3", "-march=native"], description="optimisation flags")
    timeout: float = Field(60.0, gt=0, description="seconds a compile may take")


class CudaSettings(_Model):
    """How CUDA candidates are compiled (nvcc) and timed; used by tasks whose backend is ``cuda``."""

    nvcc: str = Field("nvcc", description="nvcc executable (else found under $CUDA_HOME or /usr/local/cuda)")
    arch: str | None = Field(None, description="target, e.g. sm_90 (default: the GPU's own; sm_80 without a GPU)")
    flags: list[str] = Field(default_factory=lambda: ["-O3"], description="nvcc optimisation flags")
    fast_math: bool = Field(False, description="add --use_fast_math (changes numerics, so off by default)")
    timeout: float = Field(120.0, gt=0, description="seconds an nvcc compile may take")
    l2_flush: bool = Field(False, description="flush the GPU's L2 cache before every timed call (cold-cache timing)")


class TimingSettings(_Model):
    warmup: int = Field(2, ge=0, description="untimed calls of each function before timing")
    min_repeats: int = Field(5, ge=1, description="timed calls at least")
    max_repeats: int = Field(200, ge=1, description="timed calls at most")
    target_rel_spread: float = Field(
        0.02, gt=0, description="stop once the median's relative uncertainty is below this"
    )
    max_seconds: float = Field(2.0, gt=0, description="time cap of the timing stage (both functions)")
    min_seconds: float = Field(
        0.3, ge=0, description="the spread may stop timing only after this long (both functions): a shared "
        "machine's state changes within a second, and a ratio from one quiet 50 ms is luck"
    )  # fmt: skip
    overhead_budget_s: float = Field(
        0.005, gt=0, description="after min_repeats, stop once the time outside the timed calls (fresh inputs, "
        "checks) exceeds this plus twice the time inside them: microsecond kernels are not worth more"
    )  # fmt: skip
    core: int | None = Field(None, description="core the timing worker is pinned to (default: the last allowed)")
    lock_file: str = Field(
        "/tmp/evoforge-timing.lock", description="machine-wide lock: a timing holds it alone, every other stage of "
        "every worker shares it"
    )


class SandboxSettings(_Model):
    timeout: float = Field(120.0, gt=0, description="wall-clock seconds per evaluation; then the group is killed")
    cpu_seconds: int = Field(300, ge=1, description="RLIMIT_CPU per evaluation")
    memory_mb: int = Field(4096, ge=256, description="RLIMIT_AS of a worker")
    max_processes: int = Field(64, ge=1, description="RLIMIT_NPROC of the sandbox user")
    max_open_files: int = Field(256, ge=16, description="RLIMIT_NOFILE")
    max_file_mb: int = Field(64, ge=1, description="RLIMIT_FSIZE")


class EvalSettings(_Model):
    compiler: CompilerSettings = Field(default_factory=CompilerSettings)
    timing: TimingSettings = Field(default_factory=TimingSettings)
    sandbox: SandboxSettings = Field(default_factory=SandboxSettings)
    cuda: CudaSettings = Field(default_factory=CudaSettings)
    check_trials: int = Field(3, ge=1, description="fresh random trials on the small/odd cases")
    implausible_speedup: float = Field(
        20.0, gt=1, description="vs_reference above this is re-verified on new inputs, timed again (the slower "
        "timing counts) and flagged"
    )
