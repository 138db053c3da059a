"""Errors a user can cause and fix: the CLI prints them as one line and exits with code 2."""

from __future__ import annotations

__all__ = ["UserError"]


class UserError(Exception):
    """A problem with the user's input (config, arguments, environment), with the fix in the message."""
