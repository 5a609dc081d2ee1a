"""Cluster mode benchmark: prints figures, asserts nothing.

    .venv/bin/python bench/cluster_bench.py [--seconds 20] [--clients 8]

Starts a real PostgreSQL and SeaweedFS (as the cluster suite does), then:

- one plain ``shoal serve`` (the embedded default): ``/health``, session create
  and a trivial exec, p50 and p99: the single-node figures;
- a Ray cluster of three sandbox host nodes and a front end: the same three
  figures through the front end, each as a ratio to the single-node figure and
  to the front end's own ``/health``;
- throughput through a front end with one, two and three host nodes: ``--clients``
  threads each creating a session, running five trivial execs and releasing it,
  for ``--seconds``; execs per second and the exec p50 and p99.

Through the cluster, a create includes Ray's scheduling of one ``shoal_slot``
(shoal.cluster.slots): the front end asks Ray where the session goes.

Every node of the cluster is on this machine and shares its two cores, so what
more nodes add here is coordination, not capacity: the throughput figures say
what routing costs, not how a cluster of real hosts scales.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.cluster.conftest import Postgres, RayCluster, SeaweedFS  # noqa: E402
from tests.serving import start_server  # noqa: E402

EXEC = {"tool": "code_execution", "input": {"code": "print(1)"}}


def p(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


def timed(call) -> float:
    started = time.perf_counter()
    call()
    return (time.perf_counter() - started) * 1000


def latencies(url: str, rounds: int = 60) -> dict[str, list[float]]:
    with httpx.Client(base_url=url, timeout=120) as http:
        for _ in range(100):
            http.get("/health")
        health = [timed(lambda: http.get("/health")) for _ in range(500)]
        create, run = [], []
        for _ in range(rounds):
            made: dict = {}
            create.append(timed(lambda: made.update(http.post("/sessions", json={}).json())))
            session = made["session_id"]
            http.post(f"/sessions/{session}/exec", json=EXEC)  # the first call: warm
            run += [timed(lambda: http.post(f"/sessions/{session}/exec", json=EXEC))
                    for _ in range(3)]
            http.delete(f"/sessions/{session}")
            time.sleep(0.05)  # the pool refills between rounds, as between real users
    return {"health": health, "create": create, "exec": run}


def throughput(url: str, seconds: float, clients: int) -> tuple[float, list[float]]:
    samples: list[float] = []
    done = [0]
    lock = threading.Lock()
    deadline = time.monotonic() + seconds

    def client() -> None:
        with httpx.Client(base_url=url, timeout=120) as http:
            while time.monotonic() < deadline:
                made = http.post("/sessions", json={})
                if made.status_code != 201:
                    time.sleep(0.05)  # full: the 503 says come back
                    continue
                session = made.json()["session_id"]
                for _ in range(5):
                    took = timed(lambda: http.post(f"/sessions/{session}/exec", json=EXEC))
                    with lock:
                        samples.append(took)
                        done[0] += 1
                http.delete(f"/sessions/{session}")

    started = time.monotonic()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return done[0] / (time.monotonic() - started), samples


def front_end(scratch: Path, cluster: RayCluster, postgres_url: str, seaweed, bucket: str,
              hosts: int):
    secret = scratch / "s3.secret"
    secret.write_text(seaweed.secret_key)
    server = start_server(scratch / f"front{hosts}", uid_base=998_000, cluster=cluster.address,
                          database_url=postgres_url, object_store=f"s3://{bucket}/shoal",
                          object_store_endpoint=seaweed.endpoint,
                          object_store_access_key=seaweed.ACCESS_KEY,
                          object_store_secret_key=f"@{secret}")
    deadline = time.monotonic() + 300
    while httpx.get(f"{server.url}/health").json()["ready"] < hosts:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the front end saw fewer than {hosts} hosts:\n{server.log()}")
        time.sleep(0.5)
    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--clients", type=int, default=8)
    args = parser.parse_args()
    postgres, seaweed = Postgres(), SeaweedFS()
    try:
        with tempfile.TemporaryDirectory() as scratch:
            root = Path(scratch)
            single = start_server(root / "single", uid_base=990_000, pool_size=4)
            try:
                alone = latencies(single.url)
                rate, samples = throughput(single.url, args.seconds, args.clients)
                alone["throughput"] = [rate]
                alone["loaded"] = samples
            finally:
                single.stop()
            base = {k: statistics.median(v) for k, v in alone.items() if k != "loaded"}
            print(f"single node: /health p50 {base['health']:.2f} ms; create p50 "
                  f"{base['create']:.2f} ms ({base['create'] / base['health']:.1f}x), exec p50 "
                  f"{base['exec']:.2f} ms ({base['exec'] / base['health']:.1f}x)", flush=True)
            print(f"single node: {rate:.0f} execs/s with {args.clients} clients, exec p50 "
                  f"{statistics.median(samples):.1f} ms, p99 {p(samples, 0.99):.1f} ms", flush=True)
            for hosts in (3, 2, 1):
                bucket = seaweed.new_bucket()
                cluster = RayCluster(hosts, postgres.new_database(), seaweed, bucket,
                                     uid_base=991_000)
                try:
                    server = front_end(root, cluster, cluster.nodes[0]["env"]["SHOAL_DATABASE_URL"],
                                       seaweed, bucket, hosts)
                    try:
                        if hosts == 3:
                            routed = latencies(server.url)
                            fe = statistics.median(routed["health"])
                            for name in ("create", "exec"):
                                value = statistics.median(routed[name])
                                print(f"cluster (3 hosts): {name} p50 {value:.2f} ms "
                                      f"({value / base[name]:.2f}x single node, {value / fe:.1f}x "
                                      f"the front end's /health {fe:.2f} ms), p99 "
                                      f"{p(routed[name], 0.99):.2f} ms", flush=True)
                        rate, samples = throughput(server.url, args.seconds, args.clients)
                        print(f"cluster ({hosts} host{'s' if hosts > 1 else ''}): {rate:.0f} "
                              f"execs/s with {args.clients} clients ({rate / base['throughput']:.2f}x "
                              f"single node), exec p50 {statistics.median(samples):.1f} ms, p99 "
                              f"{p(samples, 0.99):.1f} ms", flush=True)
                    finally:
                        server.stop()
                finally:
                    cluster.stop()
    finally:
        seaweed.stop()
        postgres.stop()


if __name__ == "__main__":
    main()
