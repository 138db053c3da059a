"""What is *kept*: a run (:class:`Run`: its directory, opened once) with the SQLite store of every candidate and
its lineage, MAP-Elites archives, queries, and the files of a factory directory."""

from archive._base import AddStatus, Archive, Descriptors, Elite, QDSnapshot, QDStats
from archive._candidate import Candidate
from archive._cvt import CVTArchive
from archive._errors import AmbiguousIdError, CandidateNotFoundError, SchemaVersionError, StoreError
from archive._factory import FactoryDir, RoundFiles
from archive._grid import GridArchive
from archive._llm import OUTCOME_RANK, LLMCall
from archive._query import LAYOUT_KEY, best_per_cell, load_archive, operator_stats, rebuild_archive, save_layout
from archive._run import OFFERS_KEY, Objective, Run, RunExists, RunNotFound, pareto_front
from archive._schema import SCHEMA_VERSION
from archive._store import PendingEntry, Store, is_run, run_db

__all__ = [
    "LAYOUT_KEY",
    "OFFERS_KEY",
    "OUTCOME_RANK",
    "SCHEMA_VERSION",
    "AddStatus",
    "AmbiguousIdError",
    "Archive",
    "CVTArchive",
    "Candidate",
    "CandidateNotFoundError",
    "Descriptors",
    "Elite",
    "FactoryDir",
    "GridArchive",
    "LLMCall",
    "Objective",
    "PendingEntry",
    "QDSnapshot",
    "QDStats",
    "RoundFiles",
    "Run",
    "RunExists",
    "RunNotFound",
    "SchemaVersionError",
    "Store",
    "StoreError",
    "best_per_cell",
    "is_run",
    "load_archive",
    "operator_stats",
    "pareto_front",
    "rebuild_archive",
    "run_db",
    "save_layout",
]
