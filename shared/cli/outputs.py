"""The output paths of `run`, `report` and `export`, checked before anything is published, read or
computed: a run's --output was only opened after every model call had been paid for, and a bad
path then ended it with `FileExistsError ...`, exit 3. Each problem is refused (a ValueError: exit
2) in one line naming the option, the path and what is wrong with it.

A file option (`run --junit`, `report --html`/`--junit`, `export --output`) takes a path that is
not a folder (nor ends with `/`); an existing file is overwritten. A folder option (`run`/`report
--output`) takes a path that is not a file; an existing folder is written into (the files it
writes there are replaced). Missing parent folders are created, as they always were, so the
nearest existing one must be a folder and writable."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

# the files an --output folder receives (`shared.analysis.report.write_outputs`)
RUN_FILES = ("header.json", "summary.json", "results.jsonl")
AGGREGATE = "aggregate_stats.json"  # beside run_1/ .. run_N/ with --num-runs N (`write_multi_run`)

# (option, argparse dest[, a file name to suggest]) of each command's outputs
FILE_OPTIONS = {"run": (("--junit", "junit", "junit.xml"),),
                "report": (("--html", "html", "report.html"), ("--junit", "junit", "junit.xml")),
                "export": (("--output", "output", "results.json"),)}
FOLDER_OPTIONS = {"run": (("--output", "output"),), "report": (("--output", "output"),)}


def check_output_paths(args: argparse.Namespace) -> None:
    """Refuse (ValueError, naming the option and the path) an output path of this command that
    cannot be written as asked; nothing is created."""
    command = getattr(args, "command", None)
    targets: dict[Path, str] = {}  # every file this command would write -> who writes it

    def claim(path: Path, who: str) -> None:
        key = Path(os.path.abspath(path))
        if key in targets:
            raise ValueError(f"{who} and {targets[key]} name the same file: give each its own path")
        targets[key] = who

    for option, dest in FOLDER_OPTIONS.get(command, ()):
        value = getattr(args, dest, None)
        if not value:
            continue
        runs = getattr(args, "num_runs", 1) or 1
        problem = _folder_problem(Path(value), _folder_layout(runs if command == "run" else 1))
        if problem:
            raise ValueError(f"{option} {value}: {problem}")
        for name in _written_files(runs if command == "run" else 1):
            claim(Path(value) / name, f"{option} {value} (its {name})")
    for option, dest, example in FILE_OPTIONS.get(command, ()):
        value = getattr(args, dest, None)
        if not value:
            continue
        if command == "export" and getattr(args, "format", None):
            example = f"results.{args.format}"
        problem = _file_problem(str(value), example)
        if problem:
            raise ValueError(f"{option} {value}: {problem}")
        claim(Path(value), f"{option} {value}")


def _folder_layout(runs: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(files, subfolders) an --output folder receives: one run's files, or with --num-runs N
    run_1/ .. run_N/ and aggregate_stats.json."""
    if runs > 1:
        return (AGGREGATE,), tuple(f"run_{i}" for i in range(1, runs + 1))
    return RUN_FILES, ()


def _written_files(runs: int) -> list[str]:
    files, folders = _folder_layout(runs)
    return [*files, *(f"{d}/{f}" for d in folders for f in RUN_FILES)]


def _file_problem(value: str, example: str) -> str | None:
    """Why `value` cannot be written as a file, or None."""
    p = Path(value)
    if p.is_dir():
        return f"is a folder, where a file is needed: name the file, e.g. {p / example}"
    if value.endswith(("/", os.sep)):
        return "ends with '/', which names a folder, where a file is needed: name the file"
    if p.exists():
        return None if os.access(p, os.W_OK) else "exists and is not writable"
    return _creatable(p)


def _folder_problem(p: Path, layout: tuple[tuple[str, ...], tuple[str, ...]]) -> str | None:
    """Why `p` cannot be used as the output folder of this layout, or None."""
    files, folders = layout
    written = (f"{folders[0]}/ .. {folders[-1]}/ and " if folders else "") + ", ".join(files)
    if p.exists() and not p.is_dir():
        return f"exists and is a file, where a folder is needed (it receives {written}): name a folder"
    if not p.exists():
        return _creatable(p)
    if not os.access(p, os.W_OK | os.X_OK):
        return "is a folder that is not writable"
    for name in files:
        q = p / name
        if q.is_dir():
            return f"holds a folder {name}, where the file {name} is written"
        if q.exists() and not os.access(q, os.W_OK):
            return f"holds {name}, which is not writable"
    for name in folders:
        q = p / name
        if q.exists() and not q.is_dir():
            return f"holds a file {name}, where the folder {name}/ is written"
        problem = _folder_problem(q, (RUN_FILES, ())) if q.is_dir() else None
        if problem:
            return f"its {name}/ {problem}"
    return None


def _creatable(p: Path) -> str | None:
    """A missing path: its missing parents are created, so the nearest existing one must be a
    writable folder."""
    parent = Path(os.path.abspath(p)).parent
    while not parent.exists() and not parent.is_symlink() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        return f"cannot be created: {parent} is not a folder"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot be created: the folder {parent} is not writable"
    return None

