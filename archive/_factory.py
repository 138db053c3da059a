"""A factory directory: the one place that knows its files (what ``evo factory`` writes, the factory's
report, ``evo factory status`` and ``evo serve --follow`` read).

    factory.yaml          the config, frozen at the start
    events.jsonl          each decision and when, with its reason
    promotions.jsonl      every promoted engine with its figures (what ``evo serve --follow`` serves)
    swaps.jsonl           each swap ``evo serve --follow`` made to a promotion (or why it failed)
    profiles/round-N.json where the incumbent engine's time went, measured at the start of round N
    plans/round-N.json    the searches of round N, each with its budget and why (and why not, per slot)
    duels/round-N.json    round N's best engine against the incumbent: held-out similarity, side-by-side load
    runs/<task>           one kernel run per slot task, extended every round it is planned; its
                          factory-rounds.json holds the run's best before and after each round's search
    runs/engine-rN        round N's engine search (factory-done in it once the search is over)
    configs/<run>.yaml    each run's config; logs/<run>.log its search's output
    logs/measurements     the measuring worker's logs; cache/ its compile cache

The ``.jsonl`` files are appended a record a line; reading skips a line torn by a kill (or anything not a
record): the step it records is redone on ``--resume``. Every other record is written whole or not at all.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import yaml

from archive._store import is_run

__all__ = ["FactoryDir", "RoundFiles"]

Record = dict[str, Any]


def _read_jsonl(path: Path) -> list[Record]:
    """The records of a JSON-lines file, oldest first (none when it does not exist)."""
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out


def _append(path: Path, record: Record, *, default: Any = None) -> None:
    with path.open("a") as f:
        f.write(json.dumps(record, default=default) + "\n")


def _write_whole(path: Path, data: Any) -> None:
    """Written whole or not at all: a step's evidence is there only once the step is done."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)


class RoundFiles:
    """A folder of one JSON record per round, ``round-N.json`` (a factory's profiles, plans or duels)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def path(self, n: int) -> Path:
        return self.directory / f"round-{n}.json"

    def has(self, n: int) -> bool:
        """Whether round ``n``'s record is there (written whole: its step is done)."""
        return self.path(n).exists()

    def read(self, n: int) -> Any:
        """Round ``n``'s record (``FileNotFoundError`` when there is none)."""
        return json.loads(self.path(n).read_text())

    def write(self, n: int, data: Any) -> None:
        _write_whole(self.path(n), data)

    def files(self) -> list[Path]:
        return sorted(self.directory.glob("round-*.json"))

    def all(self) -> dict[int, Record]:
        """Every round's record by round, in order, as far as each can be read (an unreadable one is left out)."""
        out = {}
        for p in self.files() if self.directory.is_dir() else ():
            try:
                n, data = int(p.stem.removeprefix("round-")), json.loads(p.read_text())
            except (OSError, ValueError):
                continue
            if isinstance(data, dict):
                out[n] = data
        return dict(sorted(out.items()))


class FactoryDir:
    """The files of the factory in ``path``: where each lives, and its one reader and one writer."""

    ENGINE = "engine"
    """The task name a factory's events give its engine searches (whose runs are ``engine-rN``)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.profiles = RoundFiles(self.path / "profiles")
        self.plans = RoundFiles(self.path / "plans")
        self.duels = RoundFiles(self.path / "duels")

    # -- the frozen config ---------------------------------------------------------------------------

    @property
    def config_file(self) -> Path:
        return self.path / "factory.yaml"

    def exists(self) -> bool:
        """Whether ``path`` holds a factory (its frozen config) rather than, say, a run."""
        return self.config_file.is_file()

    def read_config(self) -> Any:
        """The frozen config as its YAML reads (``OSError`` or ``yaml.YAMLError`` when it cannot be read)."""
        return yaml.safe_load(self.config_file.read_text())

    def write_config(self, config: Record) -> None:
        self.config_file.write_text(yaml.safe_dump(config, sort_keys=False))

    # -- the factory's own logs ----------------------------------------------------------------------

    def events(self) -> list[Record]:
        """Every decision of the factory and when, oldest first."""
        return _read_jsonl(self.path / "events.jsonl")

    def add_event(self, event: str, **fields: Any) -> Record:
        """Appends the decision ``event`` (stamped now) with its ``fields``; returns the record."""
        record = {"at": time.time(), "event": event, **fields}
        _append(self.path / "events.jsonl", record, default=str)
        return record

    def promotions(self) -> list[Record]:
        """Every promotion of the factory, oldest first."""
        return _read_jsonl(self.path / "promotions.jsonl")

    def latest_promotion(self) -> Record | None:
        """The last promotion (``None``: none yet); a torn last line, being written, is skipped."""
        promotions = self.promotions()
        return promotions[-1] if promotions else None

    def add_promotion(self, record: Record) -> None:
        _append(self.path / "promotions.jsonl", record)

    def swaps(self) -> list[Record]:
        """Every swap of a server following the factory, oldest first."""
        return _read_jsonl(self.path / "swaps.jsonl")

    def add_swap(self, record: Record) -> None:
        _append(self.path / "swaps.jsonl", record)

    def record_files(self) -> list[Path]:
        """The factory's own records (not its runs'): what changes each time it records a step."""
        return [self.path / "events.jsonl", self.path / "promotions.jsonl",
                *(p for r in (self.profiles, self.plans, self.duels) for p in r.files())]  # fmt: skip

    # -- its runs ------------------------------------------------------------------------------------

    @classmethod
    def run_name(cls, task: str, n: object) -> str:
        """The run of round ``n``'s search of ``task``: a kernel task's own, or the round's engine run."""
        return f"engine-r{n}" if task == cls.ENGINE else task

    @staticmethod
    def is_engine_run(name: str) -> bool:
        return name.startswith("engine-")

    def run_dir(self, name: str) -> Path:
        """The directory of the run ``name`` (a task's, or :meth:`run_name`'s)."""
        return self.path / "runs" / name

    def engine_run(self, n: int) -> Path:
        """Round ``n``'s engine run."""
        return self.run_dir(self.run_name(self.ENGINE, n))

    def run_dirs(self) -> list[Path]:
        """Every run of the factory that ``evo run`` has started, by name."""
        runs = self.path / "runs"
        return sorted(d for d in runs.iterdir() if is_run(d)) if runs.is_dir() else []

    def kernel_tasks(self) -> list[str]:
        """The tasks of the kernel runs the factory has started, by name."""
        return [d.name for d in self.run_dirs() if not self.is_engine_run(d.name)]

    def history(self, task: str) -> dict[int, dict[str, float | None]]:
        """Round -> ``task``'s kernel run's best before and after that round's search."""
        path = self.run_dir(task) / "factory-rounds.json"
        return {int(k): v for k, v in json.loads(path.read_text()).items()} if path.exists() else {}

    def write_history(self, task: str, history: dict[int, dict[str, float | None]]) -> None:
        _write_whole(self.run_dir(task) / "factory-rounds.json", {str(k): v for k, v in history.items()})

    def engine_done(self, n: int) -> bool:
        """Whether round ``n``'s engine search is over (every search of the round is)."""
        return (self.engine_run(n) / "factory-done").exists()

    def mark_engine_done(self, n: int) -> None:
        (self.engine_run(n) / "factory-done").write_text("")

    def run_config(self, name: str) -> Path:
        """The config the run ``name`` was started with."""
        return self.path / "configs" / f"{name}.yaml"

    def write_run_config(self, name: str, config: Record) -> Path:
        path = self.run_config(name)
        path.parent.mkdir(exist_ok=True)
        path.write_text(yaml.safe_dump(config))
        return path

    def search_log(self, name: str) -> Path:
        """Where the search of the run ``name`` appends its output (its folder made)."""
        path = self.path / "logs" / f"{name}.log"
        path.parent.mkdir(exist_ok=True)
        return path

    # -- its measurements ----------------------------------------------------------------------------

    @property
    def cache_dir(self) -> Path:
        """The measurements' compile cache."""
        return self.path / "cache"

    @property
    def measurement_logs(self) -> Path:
        """The measuring worker's logs."""
        return self.path / "logs" / "measurements"
