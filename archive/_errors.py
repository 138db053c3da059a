"""Errors the archive package raises; all derive from :class:`StoreError` or :class:`ValueError`."""

from __future__ import annotations

__all__ = ["AmbiguousIdError", "CandidateNotFoundError", "SchemaVersionError", "StoreError"]


class StoreError(Exception):
    """Something is wrong with a run's store (its file, its schema or a request made to it)."""


class SchemaVersionError(StoreError):
    """The database was written by another (usually newer) evoforge, or is not an evoforge store."""


class CandidateNotFoundError(StoreError, KeyError):
    """No candidate has this id (or id prefix)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class AmbiguousIdError(StoreError, KeyError):
    """An id prefix matches more than one candidate."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""
