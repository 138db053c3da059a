"""The engine factory: one long-running job from a model to a promoted engine that keeps getting faster
(``evo factory CONFIG``; see :mod:`evo.factory.run`; its directory's files: :class:`archive.FactoryDir`)."""

from evo.factory.config import FactoryConfig, load_factory_config
from evo.factory.run import Factory

__all__ = ["Factory", "FactoryConfig", "load_factory_config"]
