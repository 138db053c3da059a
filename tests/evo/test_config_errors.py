"""A user's mistake in a config ends in one line naming the file, the key and the fix, with exit code 2."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from cli_testlib import evo_here

GOOD = {
    "task": {"name": "matmul", "args": {"m": 64, "n": 64, "k": 64}},
    "archive": {"descriptors": ["register_tile_area"]},
}


def evo(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "evo", *args], capture_output=True, text=True, cwd=cwd, timeout=60)


def write(tmp_path: Path, data) -> Path:
    p = tmp_path / "job.yaml"
    p.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return p


def merged(**patch):
    out = yaml.safe_load(yaml.safe_dump(GOOD))
    for dotted, value in patch.items():
        node = out
        *parents, leaf = dotted.split("__")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return out


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (merged(search__wrokers=2), "search.wrokers: unknown key"),
        (merged(budget__max_evals="many"), "budget.max_evals: Input should be a valid integer"),
        (merged(task__args__m=-3), "task.args.m"),
        (merged(task__args__size=3), "task.args.size: unknown key"),
        (merged(space={"params": {"MR": [4, 8]}, "constraints": ["MR %% 2"]}), "space.constraints"),
        (merged(space={"params": {"MR": [4, 8]}, "constraints": ["__import__('os')"]}), "not allowed"),
        (merged(archive__descriptors=["colour"]), "archive.descriptors: 'colour' is not offered"),
        (merged(task__name="nosuchtask"), "task.name: unknown task 'nosuchtask'"),
        (merged(archive__bins=[2, 3]), "bins has 2 entries for 1 descriptors"),
        ("task: [unclosed", "not valid YAML at line 1"),
        ("- a list\n", "expected a mapping"),
    ],
)
def test_config_errors_are_one_line_with_exit_code_2(tmp_path, data, expected):
    cfg = write(tmp_path, data)
    proc = evo_here("run", str(cfg), "--run-dir", str(tmp_path / "run"), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"error: {cfg}") or lines[0].startswith("error: ")
    assert expected in lines[0]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()


def test_missing_config_file(tmp_path):
    proc = evo("run", "nope.yaml", cwd=tmp_path)
    assert proc.returncode == 2
    expected = "error: config file not found: nope.yaml (check the path; ready configs are in configs/)"
    assert proc.stderr.strip() == expected


def test_missing_compiler_is_one_clear_line(tmp_path):
    cfg = write(tmp_path, merged(evaluation={"compiler": {"cc": "no-such-cc-xyz"}}))
    proc = evo("run", str(cfg), "--run-dir", str(tmp_path / "run"), cwd=tmp_path)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "no-such-cc-xyz" in lines[0], proc.stderr


def test_archive_commands_on_a_missing_run(tmp_path):
    proc = evo("archive", "best", str(tmp_path / "nowhere"), cwd=tmp_path)
    assert proc.returncode == 2
    assert "no run in" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_usage_errors_exit_2(tmp_path):
    proc = evo("run", cwd=tmp_path)
    assert proc.returncode == 2
    proc = evo("archive", "best", str(tmp_path), "--top", "0", cwd=tmp_path)
    assert proc.returncode == 2


def test_ready_configs_validate():
    from evo.config import load_config
    from evo.factory import load_factory_config

    for path in sorted(Path(__file__).parents[2].joinpath("configs").glob("*.yaml")):
        if path.name.startswith("factory_"):  # a factory's config, not a run's
            assert load_factory_config(path).budget.rounds >= 1
            continue
        config = load_config(path)
        assert config.make_task().space() is not None


def test_export_to_an_unwritable_path_is_a_user_error(tmp_path):
    cfg = write(tmp_path, merged(budget={"max_evals": 1}, search={"workers": 1, "initial_random": 0},
                                 evaluation={"timing": {"max_seconds": 0.05}}, memory={"enabled": False}))
    assert evo("run", str(cfg), "--run-dir", str(tmp_path / "run"), cwd=tmp_path).returncode == 0
    import sqlite3

    (cid,) = sqlite3.connect(tmp_path / "run" / "archive.db").execute("SELECT id FROM candidates").fetchone()
    target = str(tmp_path / "no" / "such" / "x.c")
    proc = evo("archive", "export", str(tmp_path / "run"), cid, "-o", target, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.startswith("error: cannot write") and "Traceback" not in proc.stderr


def test_resume_accepts_the_runs_own_seed_and_refuses_another(tmp_path):
    """An unchanged value is not a change: --resume --seed S on a run of seed S goes on."""
    cfg = write(tmp_path, merged(budget={"max_evals": 1}, search={"workers": 1, "initial_random": 0},
                                 evaluation={"timing": {"max_seconds": 0.05}}, memory={"enabled": False}))
    run = str(tmp_path / "run")
    assert evo("run", str(cfg), "--run-dir", run, "--seed", "3", cwd=tmp_path).returncode == 0
    same = evo("run", str(cfg), "--run-dir", run, "--resume", "--seed", "3", "--max-evals", "2", cwd=tmp_path)
    assert same.returncode == 0, same.stderr[-2000:]
    other = evo("run", str(cfg), "--run-dir", run, "--resume", "--seed", "4", cwd=tmp_path)
    assert other.returncode == 2 and "this run's seed is 3" in other.stderr and "Traceback" not in other.stderr
