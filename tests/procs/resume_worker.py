"""A worker process for the run-control test (``tests/integration/test_run_control_procs.py``).

Usage: python tests/procs/resume_worker.py SERVER_URL EFFECTS_FILE FLAG_FILE

Serves ``resume3`` (event ``resume.go``): steps ``one``, ``two``, ``three``,
each appending ``<run_id> <step>`` to EFFECTS_FILE when it runs; ``two``
fails non-retryably while FLAG_FILE exists. And ``pause2`` (event
``pause.go``): step ``one``, a durable sleep of ``data.nap`` seconds, step
``two``, recorded the same way.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import worker_loop  # noqa: E402  (tests/procs, beside this file)

import ironflow  # noqa: E402


def main() -> None:
    server, effects, flag = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])

    def record(run_id: str, what: str) -> None:
        with effects.open("a") as f:
            f.write(f"{run_id} {what}\n")

    @ironflow.function(id="resume3", triggers=[ironflow.event("resume.go")])
    async def resume3(ctx: Any) -> Any:
        run_id = ctx.run.id

        def one() -> int:
            record(run_id, "one")
            return 1

        def two() -> int:
            record(run_id, "two")
            if flag.exists():
                raise ironflow.NonRetryableError("flag file is there")
            return 2

        def three() -> int:
            record(run_id, "three")
            return 3

        return [await ctx.step.run(name, f) for name, f in (("one", one), ("two", two), ("three", three))]

    @ironflow.function(id="pause2", triggers=[ironflow.event("pause.go")])
    async def pause2(ctx: Any) -> Any:
        run_id = ctx.run.id
        await ctx.step.run("one", lambda: record(run_id, "one"))
        await ctx.step.sleep("nap", ctx.event.data.get("nap", 1.0))
        await ctx.step.run("two", lambda: record(run_id, "two"))
        return "done"

    worker = ironflow.StreamingWorker(server, [resume3, pause2], max_concurrent_jobs=2, reconnect_delay=0.2)

    worker_loop.serve(worker)


if __name__ == "__main__":
    main()
