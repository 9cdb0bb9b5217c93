"""Result files as append-only histories: a new run never rewrites or drops an earlier one.

``benchmarks/results/<name>.json`` is ``{"benchmark": <name>, "runs": [run, ...]}``, oldest
first; each run holds its own ``environment`` and a ``run_id``. A file in the older layout
(one run as the whole file) reads as a history of that one run and stays, unchanged, the
first entry once a run is added. No torch here: the results page renders without it.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parents[1] / "results"


def result_path(name: str) -> Path:
    """Where the benchmark ``name`` keeps its history."""
    return RESULTS_DIR / f"{name}.json"


def is_history(data) -> bool:
    return isinstance(data, dict) and "benchmark" in data and isinstance(data.get("runs"), list)


def read_runs(path: str | Path) -> list[dict]:
    """Every run recorded at ``path``, oldest first (none if the file does not exist)."""
    path = Path(path)
    if not path.exists():
        return []
    data = json.loads(path.read_text())
    return list(data["runs"]) if is_history(data) else [data]


def latest_run(path: str | Path) -> dict | None:
    """The newest run that is not a ``--smoke`` check of the script."""
    runs = [r for r in read_runs(path) if not r.get("smoke")]
    return runs[-1] if runs else None


class ResultLog:
    """One run's entry in a history file.

    :meth:`save` may be called as often as the run likes (after every record, so that a
    run cut off by a time limit keeps what it measured): it replaces this run's own entry
    and leaves every other entry as it found it. The environment is taken once, when the
    run starts, so the run's own writes do not mark the tree dirty. A run keeps its place in the
    history, oldest first, also when it is resumed (:meth:`resume`) after later runs were added.
    """

    def __init__(self, path: str | Path, environment: dict | None = None):
        if environment is None:
            from .environment import environment as probe

            environment = probe()
        self.path = Path(path)
        self.environment = environment
        self.run_id = f"{environment['date']}/{uuid.uuid4().hex[:8]}"

    @classmethod
    def resume(cls, path: str | Path, label: str, environment: dict) -> tuple["ResultLog", dict]:
        """Continue the newest run labelled ``label`` at ``path`` (one benchmark split over several
        commands), with its ``run_id`` and environment. It must have run on this host from the same
        sources, or its numbers and the new ones would not be comparable: anything else is refused."""
        runs = [r for r in read_runs(path) if r.get("run") == label]
        if not runs:
            raise ValueError(f"no run labelled {label!r} in {path} to resume")
        run = runs[-1]
        before = run.get("environment", {})
        for key in ("host", "source_sha256", "gpu"):
            if before.get(key) != environment.get(key):
                raise ValueError(f"run {run['run_id']} has {key}={before.get(key)!r}, this process "
                                 f"{environment.get(key)!r}: start a new run instead of resuming it")
        log = cls(path, before)
        log.run_id = run["run_id"]
        return log, run

    def save(self, run: dict) -> Path:
        entry = {"run_id": self.run_id, **run, "environment": self.environment}
        runs = read_runs(self.path)
        ids = [r.get("run_id") for r in runs]
        if self.run_id in ids:  # this run's entry, where it stands
            runs[ids.index(self.run_id)] = entry
        else:
            runs.append(entry)
        _write(self.path, {"benchmark": self.path.stem, "runs": runs})
        return self.path


def append_run(path: str | Path, run: dict, environment: dict | None = None) -> Path:
    """Add ``run`` (and its environment) to the history at ``path``."""
    return ResultLog(path, environment).save(run)


def _write(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")  # a run killed mid-write leaves the old file whole
    partial.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(partial, path)
