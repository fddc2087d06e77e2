"""``python -m runbrake.worker --index I --concurrency N``: one worker process (started by ``runbrake worker``)."""

from __future__ import annotations

import argparse
import sys

from runbrake.shared.settings import Settings
from runbrake.worker.process import DEFAULT_CONCURRENCY, run_worker_process


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m runbrake.worker", description=__doc__)
    parser.add_argument("--index", type=int, default=0, help="this process's index (metrics port offset)")
    parser.add_argument("--concurrency", "--threads", type=int, default=DEFAULT_CONCURRENCY,
                        help="runs in flight at most (--threads: the former name)")
    parser.add_argument("--noop", action="store_true", help="also consume the benchmark's no-op queue")
    args = parser.parse_args()
    sys.exit(run_worker_process(Settings.from_env(), concurrency=args.concurrency, index=args.index,
                                include_noop=args.noop))


if __name__ == "__main__":
    main()
