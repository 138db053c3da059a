"""How the search *moves*: the config, the controller, selection, operators and the ``evo`` CLI."""

from evo.config import RunConfig, load_config
from evo.errors import UserError
from evo.search import RunSummary, Search

__all__ = ["RunConfig", "RunSummary", "Search", "UserError", "load_config"]
