"""Suite-wide fixtures. This file sits at the repository root so that the packages import from this tree
(a conftest in tests/ would put tests/ first on sys.path, where tests/genome etc. would shadow them):
runs started by tests never touch the user's memory of discoveries."""

import os

import pytest


@pytest.fixture(autouse=True, scope="session")
def _private_memory_dir(tmp_path_factory: pytest.TempPathFactory) -> None:
    # inherited by every `evo` subprocess a test starts
    os.environ["EVOFORGE_MEMORY_DIR"] = str(tmp_path_factory.mktemp("memory"))
