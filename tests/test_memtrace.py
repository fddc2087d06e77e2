"""bench/_memtrace.py, the soak's memory diagnostic (docs/benchmarks.md, "Soak: the RSS growth"): a process
run under it writes one line of heap figures per SIGUSR2, from a thread of its own, and otherwise runs its
module unchanged."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from tests.polling import poll_until

REPO = Path(__file__).resolve().parent.parent
TARGET = """
import sys, time
from pathlib import Path
Path(sys.argv[1] + ".tmp").write_text(repr(sys.argv))
Path(sys.argv[1] + ".tmp").rename(sys.argv[1])  # whole when the test sees it
while not Path(sys.argv[2]).exists():
    time.sleep(0.05)  # the test's stop flag, polled
"""


def dumps(directory: Path, pid: int) -> list[dict[str, Any]]:
    path = directory / f"{pid}.jsonl"
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text.splitlines(keepends=True) if line.endswith("\n")]  # whole lines


def written(directory: Path, pid: int, count: int) -> bool:
    return len(dumps(directory, pid)) == count


@pytest.mark.parametrize("options", [[], ["--trace"], ["--garbage"], ["--trace", "--garbage"]])
def test_each_sigusr2_writes_one_line_of_heap_figures_and_the_module_runs_as_main(
    tmp_path: Path, options: list[str],
) -> None:
    (tmp_path / "target.py").write_text(TARGET)
    started, stop, out = tmp_path / "started", tmp_path / "stop", tmp_path / "dumps"
    command = [sys.executable, "-m", "bench._memtrace", *options, str(out),
               "target", str(started), str(stop), "--flag"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    process = subprocess.Popen(command, cwd=REPO, env=env)
    try:
        def gone() -> bool:
            return process.poll() is not None

        poll_until(started.exists, timeout=60, failure=lambda: "the module did not start", give_up=gone)
        # As ``python -m target …`` would: argv[0] the module's file, then its own arguments.
        assert started.read_text() == repr([str(tmp_path / "target.py"), str(started), str(stop), "--flag"])
        for count in (1, 2):
            os.kill(process.pid, signal.SIGUSR2)
            poll_until(partial(written, out, process.pid, count), timeout=60, give_up=gone,
                       failure=lambda: f"dump not written: {dumps(out, process.pid)}")
        stop.touch()
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    entries = dumps(out, process.pid)
    assert len(entries) == 2
    for entry in entries:
        assert entry["rss_kib"] > 0
        assert entry["pymalloc_blocks"] > 0
        assert entry["malloc"]["in_use"] > 0  # glibc 2.33 on (mallinfo2)
        assert entry["arenas"] >= 1
        assert len(entry["gc_stats"]) == 3  # one per generation
        assert ("traced_kib" in entry) is ("--trace" in options)
        assert ("garbage_types" in entry) is ("--garbage" in options)
        assert ("after_collect" in entry) is ("--garbage" in options)
    if "--trace" in options:
        assert isinstance(entries[1]["top_grown"], list)


def test_without_a_module_it_says_how_it_is_called(tmp_path: Path) -> None:
    finished = subprocess.run([sys.executable, "-m", "bench._memtrace", str(tmp_path)], cwd=REPO,
                              capture_output=True, text=True, timeout=60, check=False)
    assert finished.returncode == 2
    assert "usage: python -m bench._memtrace [--trace] [--garbage] DIR MODULE [ARGS...]" in finished.stderr
