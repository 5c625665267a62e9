"""A streaming worker serving one schedule, for the cron tests and the lateness script.

Usage: python tests/procs/cron_worker.py SERVER_URL [--cron '*/2 * * * * *'] [--functions 1]

Serves ``tick`` (or ``tick0`` .. ``tickN-1`` with ``--functions N``) on the
schedule; each run returns its tick's ``scheduled_at_epoch`` and when its
handler started (the worker's clock). Prints ``READY <pid>`` once connected.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import worker_loop  # noqa: E402  (tests/procs, beside this file)

import ironflow  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("server")
    parser.add_argument("--cron", default="*/2 * * * * *")
    parser.add_argument("--functions", type=int, default=1)
    args = parser.parse_args()

    async def handler(ctx: Any) -> Any:
        return {"scheduled_at": ctx.event.data["scheduled_at_epoch"], "started": time.time()}

    ids = ["tick"] if args.functions == 1 else [f"tick{i}" for i in range(args.functions)]
    functions = [
        ironflow.function(id=fid, triggers=[ironflow.cron(args.cron)])(handler) for fid in ids
    ]
    worker = ironflow.StreamingWorker(
        args.server, functions, max_concurrent_jobs=100, reconnect_delay=0.2
    )

    worker_loop.serve(worker)


if __name__ == "__main__":
    main()
