"""Counts, in the driver process only, two start-up costs of evoforge's command line:

1. task builds per ``evo run``: how many task objects (instances of ``runtime.task.Task``, any subclass) the
   driver constructs during ``evo run configs/matmul_cpu.yaml --run-dir RUN --max-evals 4 --workers 1`` (a
   fresh run), and during ``--resume`` of that run with ``--max-evals 6``;
2. run opens per ``evo serve`` start: how many times the serving process opens the run's store (a
   ``sqlite3.connect`` whose target is ``RUN/archive.db``, ``file:...?mode=ro`` URIs included) from its start
   until it has answered its first request (``evo serve RUN --elite best``, on a free loopback port; the
   request is ``GET /ready``, sent once the engine's background load has finished, so the count covers the
   whole start: the CLI's checks, the app, the engine load and one answer).

Each command runs through the console script's entry point (``evo.cli:main``, which calls the click group
with ``standalone_mode=False``) in a fresh interpreter of its own, with two hooks installed before anything
of the project is imported:

- ``sqlite3.connect`` is wrapped (the module attribute, before any import, so even a ``from sqlite3 import
  connect`` gets the wrapper); a call counts when its target, made absolute (a URI's path unquoted), is the
  run's ``archive.db``. Other sqlite targets are listed apart.
- ``sys.settrace``/``threading.settrace`` see every Python ``__init__`` call; one counts when its ``self`` is a
  ``runtime.task.Task`` and no enclosing ``__init__`` frame has the same ``self`` (a subclass's ``__init__``
  calling ``super().__init__`` is one construction). Unpickled or copied tasks, which run no ``__init__``, are
  not constructions. Forked children drop the hooks; evaluation workers are other processes and not counted.

For every counted event the script records the innermost stack frame inside the tree under test
(``file:line:function``, this script excluded) and the chain of tree frames above it, and prints them
aggregated. The tree under test is the one this file lies in (``bench/..``): it goes first on the child's
``PYTHONPATH`` and the child checks that ``runtime``, ``evo``, ``archive`` and ``serving`` are imported from it.

    python bench/run_opens.py            # a table, then where the events come from
    python bench/run_opens.py --json     # JSON only
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

TREE = Path(__file__).resolve().parents[1]
SELF = Path(__file__).resolve()
CONFIG = "configs/matmul_cpu.yaml"


# --------------------------------------------------------------------------------------------------------------
# the child: hooks, then one evo command in process
# --------------------------------------------------------------------------------------------------------------


class _Recorder:
    def __init__(self, tree: Path, run_dir: Path, depth: int) -> None:
        self.tree = str(tree) + os.sep
        self.self_file = str(SELF)
        self.db = os.path.realpath(run_dir / "archive.db")
        self.depth = depth
        self.pid = os.getpid()
        self.phase = "start"
        self.events: list[dict[str, Any]] = []
        self.other_sqlite: Counter[str] = Counter()
        self._task_cls: Any = None

    # -- stacks --------------------------------------------------------------------------------------------
    def _in_tree(self, filename: str) -> bool:
        # the tree's own code: not this script, nor a virtual environment kept inside the tree (.venv/...)
        if not filename.startswith(self.tree) or filename == self.self_file:
            return False
        rel = filename[len(self.tree):]
        return not rel.startswith(".") and "site-packages" not in rel

    def _site(self, frame: Any) -> str:
        return f"{os.path.relpath(frame.f_code.co_filename, self.tree)}:{frame.f_lineno}:{frame.f_code.co_name}"

    def _chain(self, frame: Any) -> list[str]:
        out: list[str] = []
        f = frame
        while f is not None and len(out) < self.depth:
            if self._in_tree(f.f_code.co_filename):
                out.append(self._site(f))
            f = f.f_back
        return out or ["(no frame inside the tree)"]

    def _record(self, kind: str, frame: Any, **extra: Any) -> None:
        import threading

        if os.getpid() != self.pid:
            return
        chain = self._chain(frame)
        self.events.append({"kind": kind, "site": chain[0], "chain": chain, "phase": self.phase,
                            "thread": threading.current_thread().name, **extra})

    # -- sqlite3.connect -----------------------------------------------------------------------------------
    @staticmethod
    def _target(database: Any) -> str | None:
        from urllib.parse import unquote

        try:
            s = os.fsdecode(os.fspath(database))
        except TypeError:
            return None
        if s.startswith("file:"):
            s = s[len("file:"):].split("?", 1)[0].split("#", 1)[0]
            if s.startswith("//"):  # file://host/path
                s = "/" + s[2:].split("/", 1)[1] if "/" in s[2:] else ""
            s = unquote(s)
        if s in ("", ":memory:"):
            return s
        return os.path.realpath(s)

    def install_sqlite(self) -> None:
        import sqlite3

        original = sqlite3.connect
        rec = self

        def connect(*args: Any, **kwargs: Any) -> Any:
            database = args[0] if args else kwargs.get("database")
            target = rec._target(database)
            if target == rec.db or (target is None and rec.db in str(database)):
                rec._record("open", sys._getframe(1), target=str(database))
            elif os.getpid() == rec.pid:
                rec.other_sqlite[str(target if target is not None else database)] += 1
            return original(*args, **kwargs)

        connect.__wrapped__ = original  # type: ignore[attr-defined]
        sqlite3.connect = connect  # type: ignore[assignment]

    # -- Task constructions --------------------------------------------------------------------------------
    def _task(self) -> Any:
        if self._task_cls is None:
            mod = sys.modules.get("runtime.task")
            self._task_cls = getattr(mod, "Task", None) if mod is not None else None
        return self._task_cls

    @staticmethod
    def _self_of(frame: Any) -> Any:
        code = frame.f_code
        if not code.co_argcount:
            return None
        return frame.f_locals.get(code.co_varnames[0])

    def _on_init(self, frame: Any) -> None:
        task_cls = self._task()
        if task_cls is None:
            return
        obj = self._self_of(frame)
        if obj is None or not isinstance(obj, task_cls):
            return
        f = frame.f_back
        while f is not None:  # a super().__init__ inside a construction already counted
            if f.f_code.co_name == "__init__" and self._self_of(f) is obj:
                return
            f = f.f_back
        cls = type(obj)
        self._record("task", frame.f_back, cls=f"{cls.__module__}.{cls.__qualname__}")

    def install_tracer(self) -> None:
        import threading

        rec = self

        def tracer(frame: Any, event: str, arg: Any) -> None:
            if event == "call" and frame.f_code.co_name == "__init__":
                try:
                    rec._on_init(frame)
                except Exception:  # noqa: BLE001 - never disturb the program measured
                    pass
            return None

        sys.settrace(tracer)
        threading.settrace(tracer)

        def drop() -> None:  # a forked child is not the driver
            sys.settrace(None)
            threading.settrace(None)  # type: ignore[arg-type]

        os.register_at_fork(after_in_child=drop)


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _modules_from_tree(rec: _Recorder) -> dict[str, str]:
    import importlib

    out = {}
    for name in ("runtime", "evo", "archive", "serving"):
        mod = importlib.import_module(name)
        out[name] = str(Path(mod.__file__ or "?").resolve())
        if not out[name].startswith(rec.tree):
            raise SystemExit(f"run_opens: {name} is imported from {out[name]}, not from the tree {TREE}")
    return out


def _child(mode: str, run_dir: Path, out: Path, argv: list[str], depth: int, request: str,
           wait_load_s: float) -> None:
    rec = _Recorder(TREE, run_dir, depth)
    rec.install_sqlite()
    rec.install_tracer()
    result: dict[str, Any] = {"mode": mode, "argv": argv, "pid": os.getpid()}
    result["modules"] = _modules_from_tree(rec)

    def dump(**extra: Any) -> None:
        payload = {**result, **extra, "events": list(rec.events), "other_sqlite": dict(rec.other_sqlite)}
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(payload, indent=1))
        tmp.replace(out)

    import evo.cli

    if mode == "serve":
        import signal
        import socket
        import threading
        import urllib.error
        import urllib.request

        port = _free_port()
        argv = [*argv, "--host", "127.0.0.1", "--port", str(port)]
        result["argv"] = argv
        done = threading.Event()

        def client() -> None:
            deadline = time.monotonic() + wait_load_s
            try:
                while True:  # the port accepts (a bare connect: no HTTP request)
                    if time.monotonic() > deadline:
                        raise TimeoutError("the server never listened")
                    try:
                        socket.create_connection(("127.0.0.1", port), timeout=1).close()
                        break
                    except OSError:
                        time.sleep(0.05)
                rec.phase = "listening"
                t_listen = time.monotonic()
                while any(t.name == "evoforge-load" and t.is_alive() for t in threading.enumerate()):
                    if time.monotonic() > deadline:
                        raise TimeoutError("the engine's load thread never finished")
                    time.sleep(0.05)
                rec.phase = "request"
                t_req = time.monotonic()
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}{request}", timeout=60) as resp:
                        status, body = resp.status, resp.read(2000).decode(errors="replace")
                except urllib.error.HTTPError as exc:
                    status, body = exc.code, exc.read(2000).decode(errors="replace")
                rec.phase = "after first answer"
                dump(request=request, status=status, body=body, load_s=round(t_req - t_listen, 2),
                     answered=True)
            except Exception as exc:  # noqa: BLE001
                dump(error=f"{type(exc).__name__}: {exc}", answered=False)
            finally:
                done.set()
                os.kill(os.getpid(), signal.SIGTERM)  # evo serve drains and returns 0
                time.sleep(60)
                os._exit(0)  # it did not stop: the counts are written already

        threading.Thread(target=client, name="run_opens-client", daemon=True).start()
        try:
            evo.cli.main(argv)
        except SystemExit as exc:
            if not done.is_set():  # serve ended before answering: say why
                dump(error=f"evo serve exited with {exc.code} before answering", answered=False)
        return

    code: Any = None
    try:
        evo.cli.main(argv)
    except SystemExit as exc:
        code = exc.code
    dump(exit_code=code)


# --------------------------------------------------------------------------------------------------------------
# the parent: three children, then the table
# --------------------------------------------------------------------------------------------------------------


def _run_child(name: str, mode: str, argv: list[str], work: Path, run_dir: Path, args: argparse.Namespace,
               timeout: float) -> dict[str, Any]:
    out = work / f"{name}.json"
    log = work / f"{name}.log"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(TREE), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))])
    env.setdefault("EVOFORGE_MEMORY_DIR", str(work / "memory"))
    env["PYTHONUNBUFFERED"] = "1"
    cmd = [sys.executable, str(SELF), "--_child", mode, "--_run-dir", str(run_dir), "--_out", str(out),
           "--depth", str(args.depth), "--request", args.request, "--wait-load", str(args.wait_load), "--", *argv]
    t0 = time.monotonic()
    with open(log, "wb") as fh:
        proc = subprocess.run(cmd, cwd=TREE, env=env, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout,
                              check=False)
    if not out.exists():
        raise SystemExit(f"run_opens: {name} wrote no result (exit {proc.returncode}); see {log}")
    res = json.loads(out.read_text())
    res.update(name=name, wall_s=round(time.monotonic() - t0, 1), log=str(log), child_rc=proc.returncode)
    if res.get("error") or res.get("exit_code") not in (None, 0):
        print(f"run_opens: {name}: {res.get('error') or 'exit ' + str(res.get('exit_code'))}; see {log}",
              file=sys.stderr)
    return res


def _count(res: dict[str, Any], kind: str, *, serve: bool = False) -> int:
    return sum(1 for e in res["events"] if e["kind"] == kind and not (serve and e["phase"] == "after first answer"))


def _where(res: dict[str, Any], kind: str, *, serve: bool = False) -> dict[str, Any]:
    ev = [e for e in res["events"] if e["kind"] == kind and not (serve and e["phase"] == "after first answer")]
    return {
        "innermost": Counter(e["site"] for e in ev).most_common(),
        "chains": Counter(" <- ".join(e["chain"]) for e in ev).most_common(),
        "classes": Counter(e["cls"] for e in ev if "cls" in e).most_common(),
        "threads": Counter(f"{e['thread']} ({e['phase']})" for e in ev).most_common(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--json", action="store_true", help="print JSON only")
    p.add_argument("--max-evals", type=int, default=4, help="the fresh run's budget (default 4)")
    p.add_argument("--resume-evals", type=int, default=6, help="the resumed run's total budget (default 6)")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--depth", type=int, default=8, help="frames inside the tree kept per event (default 8)")
    p.add_argument("--request", default="/ready", help="the first request evo serve answers (default /ready)")
    p.add_argument("--wait-load", type=float, default=300.0, help="seconds for evo serve to listen and load")
    p.add_argument("--keep", action="store_true", help="keep the run directory and logs")
    p.add_argument("--no-serve", action="store_true", help="skip evo serve")
    p.add_argument("--_child", help=argparse.SUPPRESS)
    p.add_argument("--_run-dir", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--_out", type=Path, help=argparse.SUPPRESS)
    p.add_argument("rest", nargs="*", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args._child:
        _child(args._child, args._run_dir, args._out, args.rest, args.depth, args.request, args.wait_load)
        return

    work = Path(tempfile.mkdtemp(prefix="run_opens-"))
    run_dir = work / "run"
    common = ["--run-dir", str(run_dir), "--workers", str(args.workers)]
    results = {}
    try:
        results["run"] = _run_child("run", "run", ["run", CONFIG, *common, "--max-evals", str(args.max_evals)],
                                    work, run_dir, args, 1800)
        results["resume"] = _run_child("resume", "run", ["run", CONFIG, *common, "--max-evals",
                                                          str(args.resume_evals), "--resume"],
                                       work, run_dir, args, 1800)
        if not args.no_serve:
            results["serve"] = _run_child("serve", "serve", ["serve", str(run_dir), "--elite", "best"],
                                          work, run_dir, args, args.wait_load + 180)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    rows = [
        (f"task builds per `evo run` (fresh, --max-evals {args.max_evals})", "run", "task", False),
        (f"task builds per `evo run --resume` (--max-evals {args.resume_evals})", "resume", "task", False),
        ("run opens per `evo serve` start (to its first answer)", "serve", "open", True),
        ("  (also) archive.db opens per `evo run` (fresh)", "run", "open", False),
        ("  (also) archive.db opens per `evo run --resume`", "resume", "open", False),
        ("  (also) task builds per `evo serve` start (to its first answer)", "serve", "task", True),
    ]
    table = [{"what": what, "count": _count(results[r], kind, serve=serve), "from": r, "kind": kind}
             for what, r, kind, serve in rows if r in results]
    report = {
        "tree": str(TREE),
        "head": subprocess.run(["git", "-C", str(TREE), "rev-parse", "--short", "HEAD"], capture_output=True,
                               text=True, check=False).stdout.strip() or None,
        "dirty": bool(subprocess.run(["git", "-C", str(TREE), "status", "--porcelain", "--untracked-files=no"],
                                     capture_output=True, text=True, check=False).stdout.strip()),
        "python": sys.executable,
        "modules": results["run"]["modules"],
        "table": table,
        "commands": {k: {"argv": v["argv"], "exit_code": v.get("exit_code"), "wall_s": v["wall_s"],
                         "error": v.get("error"), "request": v.get("request"), "status": v.get("status"),
                         "body": v.get("body"), "load_s": v.get("load_s")} for k, v in results.items()},
        "where": {f"{row['from']}:{row['kind']}": _where(results[row["from"]], row["kind"],
                                                         serve=row["from"] == "serve") for row in table},
        "other_sqlite": {k: v["other_sqlite"] for k, v in results.items()},
        "work_dir": str(work) if args.keep else None,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return

    print(f"tree {report['tree']} (HEAD {report['head']}{', with uncommitted changes' if report['dirty'] else ''})")
    for name, path in report["modules"].items():
        print(f"  {name:8s} {path}")
    for k, c in report["commands"].items():
        extra = f", GET {c['request']} -> {c['status']} after a {c['load_s']} s load" if c.get("request") else ""
        err = f", ERROR {c['error']}" if c.get("error") else ""
        ended = f"exit {c['exit_code']}" if not c.get("request") else "stopped by SIGTERM after the answer"
        print(f"  {k:7s} evo {' '.join(c['argv'])}  ({ended}, {c['wall_s']} s{extra}{err})")
    print()
    width = max(len(r["what"]) for r in table)
    print(f"{'what':{width}s}  count")
    for r in table:
        print(f"{r['what']:{width}s}  {r['count']:5d}")
    for r in table:
        if r["what"].startswith("  (also)") or not r["count"]:
            continue
        w = report["where"][f"{r['from']}:{r['kind']}"]
        print(f"\n{r['what'].strip()}: {r['count']}")
        if w["classes"]:
            print("  classes:   " + ", ".join(f"{c} x{n}" for c, n in w["classes"]))
        print("  threads:   " + ", ".join(f"{t} x{n}" for t, n in w["threads"]))
        print("  innermost frame inside the tree:")
        for site, n in w["innermost"]:
            print(f"    {n:4d}  {site}")
        print(f"  chains (innermost first, up to {args.depth} tree frames):")
        for chain, n in w["chains"]:
            print(f"    {n:4d}  {chain}")
    others = {k: v for k, v in report["other_sqlite"].items() if v}
    if others:
        print("\nother sqlite3.connect targets (not counted): "
              + "; ".join(f"{k}: " + ", ".join(f"{t} x{n}" for t, n in v.items()) for k, v in others.items()))


if __name__ == "__main__":
    main()
