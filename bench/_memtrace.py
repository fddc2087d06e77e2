"""``python -m bench._memtrace [--trace] [--garbage] DIR MODULE ARGS…``: run ``MODULE`` as ``__main__``, and on
each SIGUSR2 write what its heap holds to ``DIR`` (``bench/soak.py --memory-dir DIR [--tracemalloc] [--garbage]``).

A diagnostic of the soak's RSS growth (docs/benchmarks.md, "Soak: the RSS growth"): it tells a leak (the memory in
use grows with RSS) from the allocator holding freed memory (RSS grows, the memory in use does not). Each SIGUSR2
appends one JSON line to ``DIR/<pid>.jsonl``: the RSS; glibc's ``mallinfo2()`` (``in_use`` bytes handed out by
malloc, ``free_held`` bytes freed but kept in its arenas, ``mmapped`` in blocks of their own, the number of
``arenas``); the blocks pymalloc has handed out (``sys.getallocatedblocks``); and the objects the collector tracks.
That costs a few milliseconds, so the hour's soak runs with it. With ``--trace`` the process also runs under
``tracemalloc`` and each line adds the traced heap, the live objects by type and the 25 tracebacks whose
allocations grew most since the first dump; that slows the process severalfold (a worker's start took over two
minutes on the loaded machine) and adds to its RSS, so it is for short runs.
With ``--garbage`` each dump runs a full collection that keeps what it frees (``gc.DEBUG_SAVEALL``) and adds
the types of those objects (the garbage only the cycle collector frees, which piles up between its full
collections) and the heap's figures once they are freed (``after_collect``: the live heap, comparable between
dumps). Every line has the collector's counts per generation (``gc.get_stats``).
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import runpy
import signal
import sys
import threading
import time
import tracemalloc
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

FRAMES = 8
"""Frames kept per allocation: enough to see which of runbrake's calls made it, few enough to stay cheap."""
TOP = 25
OPTIONS = ("--trace", "--garbage")


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _mallinfo() -> dict[str, int] | None:
    """glibc's view of the heap (``mallinfo2``, glibc 2.33 on), summed over its arenas; ``None`` elsewhere."""
    try:
        libc = ctypes.CDLL(None)
        call = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    call.restype = _Mallinfo2
    info = call()
    return {"in_use": info.uordblks, "free_held": info.fordblks, "mmapped": info.hblkhd,
            "sbrk_and_arenas": info.arena, "arenas_chunks_free": info.ordblks}


def _arenas() -> int | None:
    """How many malloc arenas the process has (``malloc_info``'s ``<heap nr=…>`` elements)."""
    try:
        libc = ctypes.CDLL(None)
        libc.open_memstream.restype = ctypes.c_void_p
        buffer, size = ctypes.c_char_p(), ctypes.c_size_t()
        stream = libc.open_memstream(ctypes.byref(buffer), ctypes.byref(size))
        libc.malloc_info(0, ctypes.c_void_p(stream))
        libc.fclose(ctypes.c_void_p(stream))
        text = ctypes.string_at(buffer, size.value).decode()
        libc.free(buffer)
    except (OSError, AttributeError):
        return None
    return text.count("<heap nr=")


def _rss_kib() -> int | None:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return None


class Dumper(threading.Thread):
    """Writes one dump per SIGUSR2, on a thread of its own: the handler only sets a flag (a dump of a large heap
    takes seconds, and a signal that comes during it must not start another inside it)."""

    def __init__(self, directory: Path, *, trace: bool = False, garbage: bool = False) -> None:
        super().__init__(name="memtrace-dumper", daemon=True)
        self.trace = trace
        self.garbage = garbage
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"{os.getpid()}.jsonl"
        self.wanted = threading.Event()
        self.baseline: tracemalloc.Snapshot | None = None
        self.baseline_types: Counter[str] = Counter()

    def on_signal(self, _signum: int, _frame: FrameType | None) -> None:
        self.wanted.set()

    def run(self) -> None:
        while True:
            self.wanted.wait()
            self.wanted.clear()  # signals during the dump ask for one more after it, not one each
            self.dump()

    def dump(self) -> None:
        started = time.monotonic()
        entry: dict[str, Any] = {"t": time.time(), "rss_kib": _rss_kib(), "malloc": _mallinfo(), "arenas": _arenas(),
                                 "pymalloc_blocks": sys.getallocatedblocks(), "gc_tracked": len(gc.get_objects())}
        entry["gc_stats"] = gc.get_stats()
        if self.trace:
            entry |= self._traced()
        if self.garbage:
            entry |= self._garbage()
        entry["dump_s"] = round(time.monotonic() - started, 3)
        with self.path.open("a", encoding="utf-8") as out:
            out.write(json.dumps(entry) + "\n")

    @staticmethod
    def _garbage() -> dict[str, Any]:
        """What a full collection frees now, by type: the cyclic garbage made since the last one."""
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            gc.collect()
            found = Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.garbage)
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
        gc.collect()  # the cycles just kept are still cycles: this frees them
        # What is left once the garbage is gone: the live heap, comparable between dumps.
        after = {"rss_kib": _rss_kib(), "malloc": _mallinfo(), "pymalloc_blocks": sys.getallocatedblocks(),
                 "gc_tracked": len(gc.get_objects())}
        return {"garbage_objects": sum(found.values()), "garbage_types": found.most_common(TOP), "after_collect": after}

    def _traced(self) -> dict[str, Any]:
        snapshot = tracemalloc.take_snapshot()
        types = Counter(type(o).__qualname__ for o in gc.get_objects())
        traced, peak = tracemalloc.get_traced_memory()
        if self.baseline is None:
            self.baseline, self.baseline_types = snapshot, types
        grown = snapshot.compare_to(self.baseline, "traceback")[:TOP]
        return {
            "traced_kib": traced // 1024, "peak_kib": peak // 1024,
            "types_grown": (types - self.baseline_types).most_common(TOP),
            "top_grown": [{"kib": s.size_diff // 1024, "count": s.count_diff, "size_kib": s.size // 1024,
                           "where": [f"{f.filename}:{f.lineno}" for f in s.traceback][-FRAMES:]} for s in grown],
        }


def main() -> None:
    arguments = sys.argv[1:]
    options = set()
    while arguments and arguments[0] in OPTIONS:
        options.add(arguments.pop(0))
    if len(arguments) < 2 or arguments[0].startswith("-"):
        print("usage: python -m bench._memtrace [--trace] [--garbage] DIR MODULE [ARGS...]", file=sys.stderr)
        raise SystemExit(2)
    trace = "--trace" in options
    directory, module = Path(arguments[0]), arguments[1]
    sys.argv = [module, *arguments[2:]]
    if trace:
        tracemalloc.start(FRAMES)
    dumper = Dumper(directory, trace=trace, garbage="--garbage" in options)
    dumper.start()
    signal.signal(signal.SIGUSR2, dumper.on_signal)
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
