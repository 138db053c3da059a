"""Kernel runs offering an engine task its slots' kernels: the ``kernels:`` argument of the encoder's ``engine``
task and the decoder's ``chat_engine`` task, and what :class:`runtime.followed_runs.FollowsRuns` asks of them.

A slot names one kernel run or several (:class:`KernelRun`). Each is read once, where the task is resolved: its
``top`` elites (or the listed ``ids``) are frozen into the arguments with their rendered sources, so a resumed
run, a worker, a Ray node or a server offers exactly these kernels, even when that kernel run went on evolving.
A run marked ``follow`` is read again during the search, and its new elites join the offer. The genome chooses a
slot's kernel with a ``kernel_<slot>`` gene (``numpy``: the slot's built-in path).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, field_validator

from genome import ChoiceParam, Genome, ParamSpace, SpaceError
from runtime.engine.kernel_runs import KernelSource, RunNotFound, kernel_offer
from runtime.followed_runs import FollowsRuns, OpenRun

__all__ = ["KernelOfferArgs", "KernelOffers", "KernelRun", "OfferedKernel", "absolute_runs"]

log = logging.getLogger(__name__)


class OfferedKernel(BaseModel):
    """A kernel elite a run offers, as read when the task was resolved: what the engine compiles."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    source: str
    flags: list[str] = Field(default_factory=list)
    task: str = ""
    args: dict[str, Any] = Field(default_factory=dict)  # the run's task arguments, which it was rendered with


class KernelRun(BaseModel):
    """Where a slot's kernel choices come from: the ``top`` elites of a kernel run (or the listed ``ids``).

    ``offered`` and ``unreadable`` are filled when the task is resolved, not written by hand: the elites the run
    offered then, or why it could not be read."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    run_dir: str = Field(description="the kernel run's directory (relative: to where `evo run` runs)")
    top: int = Field(3, ge=1, description="the fittest elites offered as choices")
    ids: list[str] | None = Field(None, description="offer exactly these elite ids instead of the top ones")
    optional: bool = Field(False, description="no such run (or no ok elite in it) leaves the slot to its built-in "
                           "kernel instead of being an error")
    follow: bool = Field(False, description="offer each new elite of the run's top ones as it lands during the "
                         "search (read every `follow_every_s`), not only those there when the search started")
    offered: dict[str, OfferedKernel] | None = Field(None, description="elite id -> its kernel, as read")
    unreadable: str | None = Field(None, description="why the run could not be read when the task was resolved")

    @field_validator("run_dir")
    @classmethod
    def _absolute(cls, v: str) -> str:
        # a config's relative paths were made absolute when it was loaded (absolute_runs)
        return os.path.abspath(v)


class KernelOfferArgs(BaseModel):
    """The task arguments naming the kernel runs that offer an engine's slots their kernels."""

    kernels: dict[str, KernelRun | list[KernelRun]] = Field(
        default_factory=dict, description="slot -> the kernel run(s) offering choices (a list: several runs, "
        "e.g. bf16 and int8 kernels for the linear slot)")
    follow_every_s: float = Field(10.0, gt=0, description="how often the kernel runs marked `follow` are read "
                                  "for new elites during the search")

    def kernel_runs(self, slot: str) -> list[KernelRun]:
        runs = self.kernels.get(slot, [])
        return runs if isinstance(runs, list) else [runs]


def absolute_runs(args: Mapping[str, Any], cwd: str) -> dict[str, Any]:
    """``args`` with every kernel run's directory made absolute against ``cwd`` (workers run elsewhere)."""

    def absolute(kr: Any) -> Any:
        if isinstance(kr, Mapping) and isinstance(kr.get("run_dir"), str):
            return {**kr, "run_dir": os.path.join(cwd, kr["run_dir"])}
        return [absolute(k) for k in kr] if isinstance(kr, list) else kr

    out = dict(args)
    kernels = out.get("kernels")
    if isinstance(kernels, Mapping):
        out["kernels"] = {slot: absolute(kr) for slot, kr in kernels.items()}
    return out


class KernelOffers(FollowsRuns):
    """What an engine task whose arguments are a :class:`KernelOfferArgs` adds: its slots' kernel genes, the
    offers read from the runs, followed during the search. A task sets :attr:`kernel_slots` and
    :meth:`check_fills`, and calls :meth:`kernel_genes` and :meth:`kernel_source` from its own space and build."""

    kernel_slots: ClassVar[tuple[str, ...]] = ()
    args: Any

    @classmethod
    def check_fills(cls, slot: str, task: str) -> None:
        """Raises ValueError where ``task``'s kernels cannot fill ``slot`` of this task's engines."""
        raise NotImplementedError

    def _offer_state(self) -> tuple[dict[str, list[str]] | None, dict[tuple[str, str], KernelSource]]:
        if not hasattr(self, "_kernel_choices"):
            self._kernel_choices: dict[str, list[str]] | None = None
            self._kernel_sources: dict[tuple[str, str], KernelSource] = {}  # (slot, offered id) -> its kernel
        return self._kernel_choices, self._kernel_sources

    # --- reading the runs (where the task is resolved) ----------------------------------------------

    @classmethod
    def read_runs(cls, args: Mapping[str, Any], runs: OpenRun) -> dict[str, Any]:
        """Each kernel run read once (``runs``: ``archive.Run.open``): its ``top`` elites frozen into its ``ids``
        and their rendered sources into ``offered``, or why it could not be read into ``unreadable``."""

        def read(kr: Any, slot: str) -> Any:
            if isinstance(kr, Mapping) and isinstance(kr.get("run_dir"), str):
                return cls._read(dict(kr), slot, runs)
            return [read(k, slot) for k in kr] if isinstance(kr, list) else kr

        out = dict(args)
        kernels = out.get("kernels")
        if isinstance(kernels, Mapping):
            out["kernels"] = {slot: read(kr, slot) for slot, kr in kernels.items()}
        return out

    @classmethod
    def _read(cls, kr: dict[str, Any], slot: str, runs: OpenRun) -> dict[str, Any]:
        """A kernel run entry of ``slot`` with what the run offers read into it (as given when read already)."""
        if kr.get("offered") is not None or kr.get("unreadable") is not None:
            return kr  # read once already: a resumed run offers what it did (a followed run grows by new_offers)
        try:
            run = runs(kr["run_dir"])
            try:
                ids = kr.get("ids")
                offer = kernel_offer(run, slot, list(ids) if ids is not None else None,
                                     int(kr.get("top", KernelRun.model_fields["top"].default)),
                                     fills=cls.check_fills)  # fmt: skip
            finally:
                run.close()
        except (RunNotFound, ValueError, TypeError) as exc:
            return {**{k: v for k, v in kr.items() if k != "unreadable"}, "unreadable": str(exc)}
        return {**{k: v for k, v in kr.items() if k != "unreadable"}, "ids": [k.id for k in offer],
                "offered": {k.id: {"source": k.source, "flags": list(k.flags), "task": k.task, "args": k.args}
                            for k in offer}}  # fmt: skip

    def offers_every_s(self) -> float:
        followed = any(kr.follow for slot in self.args.kernels for kr in self.args.kernel_runs(slot))
        return self.args.follow_every_s if followed else 0.0

    @classmethod
    def new_offers(cls, args: Mapping[str, Any], runs: OpenRun) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
        """Each followed kernel run's top elites that it did not offer yet added to its offer (a run not there
        yet, or with no ok elite, is read again next time)."""
        added: list[dict[str, Any]] = []

        def grow(kr: Any, slot: str) -> Any:
            if isinstance(kr, list):
                return [grow(k, slot) for k in kr]
            if not (isinstance(kr, Mapping) and kr.get("follow")):
                return kr
            got = cls._read({k: v for k, v in kr.items() if k not in ("ids", "offered", "unreadable")}, slot, runs)
            offered = dict(kr.get("offered") or {})
            new = {cid: k for cid, k in (got.get("offered") or {}).items() if cid not in offered}
            if not new:
                return kr
            added.extend({"slot": slot, "run_dir": kr["run_dir"], "id": cid, "task": k["task"]}
                         for cid, k in new.items())  # fmt: skip
            rest = {k: v for k, v in kr.items() if k != "unreadable"}
            return {**rest, "ids": [*(kr.get("ids") or []), *new], "offered": {**offered, **new}}

        kernels = args.get("kernels")
        if not isinstance(kernels, Mapping):
            return None
        grown = {slot: grow(kr, slot) for slot, kr in kernels.items()}
        return ({**args, "kernels": grown}, added) if added else None

    def offer_seeds(self, base: Genome | None, added: Sequence[Mapping[str, Any]]) -> list[Genome]:
        """``base`` (else :meth:`offer_start`) with a kernel in every slot that has one (kernels found for
        different slots are tried together: each alone may not lift an engine another slot holds back), then with
        each new kernel alone in its slot where it runs in ``base`` as it is (:meth:`fit_kernels` changes nothing
        else: one that needs another engine is a choice of the space, not worth an evaluation of its own on it).
        Together, a slot gets the first of its new kernels (fittest first), then its older ones (newest first),
        that runs in ``base`` as it is, else its fittest new one."""
        start = dict((base or self.offer_start()).params)
        together = dict(start)
        for slot, ids in self.kernel_choices().items():
            new = [self.offered_name(a) for a in added if a["slot"] == slot]  # fittest first
            ranked = [*new, *(cid for cid in reversed(ids) if cid not in new)]
            if ranked:
                together[f"kernel_{slot}"] = next((c for c in ranked if self._keeps(start, slot, c)), ranked[0])
        together = Genome(params=self.fit_kernels(together))
        alone = [Genome(params={**start, f"kernel_{a['slot']}": self.offered_name(a)}) for a in added
                 if self._keeps(start, a["slot"], self.offered_name(a))]  # fmt: skip
        return [together, *(g for g in alone if g.id != together.id)]

    def offered_name(self, offer: Mapping[str, Any]) -> str:
        """The choice that names ``offer`` (a record of :meth:`new_offers`: slot, id and task; without a task,
        the first kernel of that id) in the genome."""
        self.kernel_choices()
        _, sources = self._offer_state()
        task = offer.get("task")
        return next((name for (slot, name), k in sources.items()
                     if slot == offer["slot"] and k.id == offer["id"] and task in (None, k.task)),
                    str(offer["id"])[:16])  # fmt: skip

    def _keeps(self, params: Mapping[str, Any], slot: str, cid: str) -> bool:
        """Whether kernel ``cid`` runs in ``slot`` of ``params`` with nothing else of it changed (an engine of the
        space as it is)."""
        given = {**params, f"kernel_{slot}": cid}
        return self.fit_kernels(dict(given)) == given and not self.space().violations(given)  # type: ignore[attr-defined]

    def offer_start(self) -> Genome:
        """The genome offers build on while the search has no best yet (default: the task's first seed)."""
        return self.seeds()[0]  # type: ignore[attr-defined]

    def fit_kernels(self, params: dict[str, Any]) -> dict[str, Any]:
        """``params`` with what its chosen kernels need of the rest of the genome (default: nothing)."""
        return params

    # --- the genes ------------------------------------------------------------------------------------

    def kernel_choices(self) -> dict[str, list[str]]:
        """Slot -> elite ids offered (unique prefixes, as the genome names them; ``<prefix>@<task>`` for a kernel
        whose id another task's kernel offered first: the same template parameters in two tasks)."""
        choices, sources = self._offer_state()
        if choices is None:
            choices = {}
            for slot in self.args.kernels:
                if slot not in self.kernel_slots:
                    slots = ", ".join(self.kernel_slots)
                    raise SpaceError(f"task.args.kernels: unknown slot {slot!r} (slots: {slots})")
                ids: list[str] = []
                followed = False
                for kr in self.args.kernel_runs(slot):
                    followed = followed or kr.follow
                    if not kr.offered:
                        why = kr.unreadable or f"{kr.run_dir} was not read (the task's args were not resolved)"
                        if kr.optional:
                            log.info("task.args.kernels.%s: %s: not offered (yet)", slot, why)
                            continue
                        raise SpaceError(f"task.args.kernels.{slot}: {why}: evolve the kernels first, "
                                         f"or drop the slot (or mark it optional: true)")
                    for cid, kernel in kr.offered.items():
                        short = cid[:16]  # a unique prefix keeps params readable
                        known = sources.get((slot, short))
                        if known is not None and (known.task, known.source) != (kernel.task, kernel.source):
                            # another task's kernel of the same genome (the same template parameters): the
                            # first offered keeps the id, this one is named apart, not shadowed
                            short = f"{short}@{kernel.task}"
                        if short not in ids:
                            sources[(slot, short)] = KernelSource(slot, cid, kernel.source, tuple(kernel.flags),
                                                                  kernel.task, args=dict(kernel.args))  # fmt: skip
                            ids.append(short)
                if ids or followed:  # a followed run offers nothing yet: the slot's gene is there, built-in only
                    choices[slot] = ids
            self._kernel_choices = choices
        return choices

    def kernel_genes(self) -> dict[str, ChoiceParam]:
        """A ``kernel_<slot>`` choice for each slot a run offers kernels: ``numpy`` (the built-in path) or an id."""
        return {f"kernel_{slot}": ChoiceParam(type="choice", values=("numpy", *ids))
                for slot, ids in self.kernel_choices().items()}  # fmt: skip

    def complete_space(self, space: ParamSpace) -> ParamSpace:
        """A config's engine space plus a ``kernel_<slot>`` choice for each configured kernel run it does not
        name itself (the elite ids are known only once the runs are read)."""
        extra = {name: p for name, p in self.kernel_genes().items() if name not in space.names()}
        if not extra:
            return space
        return ParamSpace({**space.params, **extra}, [c.text for c in space.constraints])

    def kernel_source(self, slot: str, cid: str) -> KernelSource:
        """The kernel offered ``slot`` under id (or prefix) ``cid``, or ``<prefix>@<task>``: that task's kernel of the
        id, however the offers name it now (a genome of an earlier round named it apart from another task's kernel
        of the same id, which the offers may no longer hold); raises :class:`RunNotFound`."""
        self.kernel_choices()
        _, sources = self._offer_state()
        prefix, _, task = cid.partition("@")
        found = sources.get((slot, cid)) or next(
            (k for (sl, _), k in sources.items() if sl == slot and k.id.startswith(prefix) and task in ("", k.task)),
            None)  # fmt: skip
        if found is None:
            raise RunNotFound(f"no kernel run of the {slot} slot offers a kernel {cid!r}")
        return found
