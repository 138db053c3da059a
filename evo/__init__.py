"""How the search *moves*: the config, the controller, selection, operators and the ``evo`` CLI."""

from evo.config import RunConfig, load_config
from evo.errors import UserError
from evo.rundir import RunDir
from evo.search import RunSummary, Search

__all__ = ["RunConfig", "RunDir", "RunSummary", "Search", "UserError", "load_config"]
