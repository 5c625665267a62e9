"""A streaming worker for load tests: many short runs of three trivial steps.

Usage: python tests/procs/load_worker.py SERVER_URL [--max-jobs 50]

Serves ``load3`` (event ``load.go``): steps ``s0``, ``s1``, ``s2``, each
returning its index. Prints ``READY <pid>`` once connected.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import worker_loop  # noqa: E402  (tests/procs, beside this file)

import ironflow  # noqa: E402

STEPS = 3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("server")
    parser.add_argument("--max-jobs", type=int, default=50)
    args = parser.parse_args()

    async def trivial(i: int) -> int:
        return i

    @ironflow.function(id="load3", triggers=[ironflow.event("load.go")])
    async def load3(ctx: Any) -> Any:
        for i in range(STEPS):
            await ctx.step.run(f"s{i}", trivial, i)
        return {"ok": True}

    worker = ironflow.StreamingWorker(
        args.server, [load3], max_concurrent_jobs=args.max_jobs, reconnect_delay=0.2
    )

    worker_loop.serve(worker)


if __name__ == "__main__":
    main()
