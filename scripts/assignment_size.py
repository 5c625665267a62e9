"""The bytes of a job assignment on the wire, for a 3-step run like the
benchmark's: its first segment (no memo) and a later one (the three steps
memoised, e.g. after a sleep). Run it on two checkouts to compare
(docs/benchmarks.md, "Assignment size").

    python scripts/assignment_size.py
"""

from __future__ import annotations

import msgspec

from ironflow.protocol import EventInfo, JobAssignment, MemoStep

_encode = msgspec.json.Encoder().encode


def assignment(steps: int) -> JobAssignment:
    run_id = "run_18eee3155d47774d834bbba4060594e5"
    return JobAssignment(
        job_id=f"{run_id}/2",
        run_id=run_id,
        function_id="bench-load",
        event=EventInfo(id="evt_18eee3155d46b6f2960673f3e2f04f5e", name="bench.load", data={"i": 1}, received_at=1.8e9),
        attempt=1,
        max_attempts=3,
        completed_steps=[
            MemoStep(f"{run_id}:s{i}:0", f"s{i}", "run", "completed", {"i": i}) for i in range(steps)
        ],
        execution_seq=2 if steps else 1,
        lease_token="tok_0123456789abcdef0123456789abcdef",
    )


def main() -> None:
    for steps in (0, 3):
        print(f"{'first segment' if not steps else f'later segment, {steps} steps memoised'}: "
              f"{len(_encode(assignment(steps)))} bytes")


if __name__ == "__main__":
    main()
