"""What ``RUNBRAKE_REDIS_MIN_REPLICAS_ACK=1`` costs: the round trip of a durable transition (create, the
cancel fence) with and without the ``WAIT 1`` after it, on a primary and a replica of the bench's own.

Starts two redis-servers (AOF on, ``appendfsync everysec``, as deployed) on free loopback ports in a
temporary folder, the second a replica of the first, and times ``--ops`` creates and as many cancels through
the synchronous store (the CLI's and the API's), alternating blocks of 50 without and with the WAIT so that
the machine's load falls on both alike. On loopback the WAIT measures what it adds to a round trip, not a
network; across hosts add one round trip to the replica. Results: ``bench/results/replica_ack.json``.

    python -m bench.replica_ack [--ops 2000]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import redis

from bench._harness import RESULTS_DIR, free_port, summary_ms
from runbrake.shared import _store_core as core
from runbrake.shared.logging import configure_logging
from runbrake.shared.store import RunStore

BLOCK = 50


def _start(folder: Path, port: int, *extra: str) -> subprocess.Popen[bytes]:
    folder.mkdir()
    process = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(folder), "--appendonly", "yes",
         "--appendfsync", "everysec", "--save", "", *extra], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port, socket_timeout=1)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.RedisError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)  # a bench waiting for its own server to boot
    client.close()
    return process


def _replica_up(port: int) -> bool:
    info = redis.Redis(port=port, decode_responses=True).info("replication")
    return info.get("role") == "slave" and info.get("master_link_status") == "up"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=2000, help="creates (and as many cancels) per setting")
    args = parser.parse_args()
    configure_logging("WARNING")  # not a line per run created
    primary_port, replica_port = free_port(), free_port()
    namespace = f"bench-ack-{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory(prefix="runbrake-bench-") as scratch:
        processes = [_start(Path(scratch) / "primary", primary_port)]
        try:
            processes.append(_start(Path(scratch) / "replica", replica_port, "--replicaof", "127.0.0.1",
                                    str(primary_port)))
            deadline = time.monotonic() + 10
            while not _replica_up(replica_port):
                if time.monotonic() > deadline:
                    raise RuntimeError("the replica did not connect")
                time.sleep(0.05)  # waiting for the replica's first sync
            stores = {replicas: RunStore(redis.Redis(port=primary_port, decode_responses=True), namespace,
                                         replication=core.Replication(replicas, 1.0)) for replicas in (0, 1)}
            timings: dict[str, list[float]] = {f"{op}_{replicas}": [] for op in ("create", "cancel")
                                               for replicas in (0, 1)}
            request = {"input": "bench", "model": {"provider": "scripted", "turns": [{"content": "ok"}]}}
            for _ in range(args.ops // BLOCK):
                for replicas, store in stores.items():
                    for _ in range(BLOCK):
                        began = time.perf_counter()
                        run_id = store.create(request).run_id
                        created = time.perf_counter()
                        store.cancel(run_id, reason="bench", requested_by="bench")
                        timings[f"create_{replicas}"].append(created - began)
                        timings[f"cancel_{replicas}"].append(time.perf_counter() - created)
            results = {name: summary_ms(values) for name, values in timings.items()}
            stores[0].delete_namespace()
            for store in stores.values():
                store.close()
        finally:
            for process in processes:
                process.terminate()
                process.wait(timeout=10)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / "replica_ack.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    for name, summary in results.items():
        print(f"{name:10} p50 {summary['p50']:.3f} ms  p99 {summary['p99']:.3f} ms  mean {summary['mean']:.3f} ms")


if __name__ == "__main__":
    main()
