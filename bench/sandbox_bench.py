"""Sandbox runtime benchmark: prints figures, asserts nothing.

    .venv/bin/python bench/sandbox_bench.py [--sandboxes 16] [--calls 2000]

Measures, on real sandboxes: lease latency from a warm pool, the first
``print(1)`` in a leased sandbox, the trivial-call round trip, ``import pandas``
in a freshly leased sandbox (preloaded, and cold for comparison), and the idle
memory (PSS) of one sandbox's processes.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shoal.config import Settings  # noqa: E402
from shoal.sandbox import SandboxPool  # noqa: E402
from tests.uid_slots import uid  # noqa: E402

# Away from the test suites' session pool (200000), in this process's uid slot.
BENCH_UID_BASE = 930_000


def summary(name: str, samples_ms: list[float]) -> None:
    ordered = sorted(samples_ms)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    print(f"{name:<44} p50 {statistics.median(ordered):8.3f} ms   p99 {p99:8.3f} ms"
          f"   (n={len(ordered)})", flush=True)


def pss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def progress(message: str) -> None:
    print(f"... {message}", file=sys.stderr, flush=True)


async def measure(launcher: str, preload: str, sandboxes: int, calls: int) -> None:
    label = f"launcher={launcher} preload={preload or 'none'}"
    settings = Settings(pool_size=sandboxes, preload_modules=preload, launcher=launcher,
                        run_dir=Path("/run/shoal-bench"), uid_base=uid(BENCH_UID_BASE))
    pool = SandboxPool(settings)
    progress(f"[{label}] warming {sandboxes} sandboxes")
    started = time.perf_counter()
    await pool.start()
    await pool.wait_warm(timeout=600)
    warm_seconds = time.perf_counter() - started
    print(f"\n== {label}: warmed {sandboxes} sandboxes in {warm_seconds:.1f} s "
          f"({warm_seconds / sandboxes * 1000:.0f} ms each on {settings.pool_size} slots)")

    leased, lease_ms, first_ms, pandas_ms, pss = [], [], [], [], []
    for _ in range(sandboxes):
        t0 = time.perf_counter()
        sandbox = await pool.lease()
        lease_ms.append((time.perf_counter() - t0) * 1000)
        leased.append(sandbox)
    await asyncio.sleep(0.5)  # let the refill settle before timing calls
    for sandbox in leased:
        pss.append(sum(pss_kib(pid) for pid in sandbox._cgroup.pids()) / 1024)
        t0 = time.perf_counter()
        await sandbox.run_python("print(1)")
        first_ms.append((time.perf_counter() - t0) * 1000)
        t0 = time.perf_counter()
        result = await sandbox.run_python("import pandas")
        pandas_ms.append((time.perf_counter() - t0) * 1000)
        assert result.return_code == 0, result.stderr
    summary("lease from warm pool", lease_ms)
    summary("first print(1) in a leased sandbox", first_ms)
    summary("import pandas in a freshly leased sandbox", pandas_ms)
    print(f"{'idle PSS per sandbox (all its processes)':<44} median {statistics.median(pss):6.1f} MiB"
          f"   max {max(pss):6.1f} MiB")

    progress(f"[{label}] {calls} trivial calls")
    sandbox = leased[0]
    for _ in range(200):
        await sandbox.run_python("x = 1")
    round_trip = []
    for _ in range(calls):
        t0 = time.perf_counter()
        await sandbox.run_python("x = 1")
        round_trip.append((time.perf_counter() - t0) * 1000)
    summary("trivial call round trip (x = 1)", round_trip)
    print_ms = []
    for _ in range(calls):
        t0 = time.perf_counter()
        await sandbox.run_python("print(1)")
        print_ms.append((time.perf_counter() - t0) * 1000)
    summary("trivial call round trip (print(1))", print_ms)
    bash_ms = []
    for _ in range(min(calls, 300)):
        t0 = time.perf_counter()
        await sandbox.run_bash("true")
        bash_ms.append((time.perf_counter() - t0) * 1000)
    summary("bash `true` round trip", bash_ms)

    progress(f"[{label}] closing")
    await asyncio.gather(*(s.close() for s in leased))
    await pool.close()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sandboxes", type=int, default=12)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    await measure("zygote", "numpy,pandas", args.sandboxes, args.calls)
    await measure("bwrap", "numpy,pandas", args.sandboxes, args.calls)
    await measure("bwrap", "", args.sandboxes, args.calls // 4)


if __name__ == "__main__":
    try:
        import uvloop
        uvloop.run(main())
    except ImportError:
        asyncio.run(main())
