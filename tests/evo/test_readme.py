"""The README's promises: its task example runs as written, its config reference matches the models."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from evo.config import RunConfig

README = (Path(__file__).parents[2] / "README.md").read_text()


def python_block_after(heading: str) -> str:
    section = README.split(heading, 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.slow
def test_the_readme_task_example_runs(tmp_path):
    (tmp_path / "scale_task.py").write_text(python_block_after("## Writing your own task"))
    cfg = {
        "task": {"name": "scale_task:Scale", "args": {"n": 4096}},
        "search": {"workers": 1, "initial_random": 3},
        "evaluation": {"timing": {"max_seconds": 0.2}},
        "budget": {"max_evals": 4},
        "archive": {"descriptors": ["source_lines"], "bins": 2},
        "memory": {"enabled": False},
    }
    (tmp_path / "scale.yaml").write_text(yaml.safe_dump(cfg))
    proc = subprocess.run([sys.executable, "-m", "evo", "run", "scale.yaml"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    best = subprocess.run([sys.executable, "-m", "evo", "archive", "best", "runs/scale", "--json"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    rows = yaml.safe_load(best.stdout)
    assert rows and rows[0]["status"] == "ok" and rows[0]["unit"] == "GB/s" and rows[0]["fitness"] > 0


def _keys(model, prefix=""):
    for name, field in model.model_fields.items():
        sub = next((t for t in (field.annotation, *getattr(field.annotation, "__args__", ()))
                    if isinstance(t, type) and hasattr(t, "model_fields")), None)
        if sub is not None and name != "space":
            yield from _keys(sub, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}"


def test_the_config_reference_lists_every_key():
    documented = set(re.findall(r"^\| `([a-z0-9_.]+)` \|", README, re.M))
    assert set(_keys(RunConfig)) <= documented
