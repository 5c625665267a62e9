"""scripts/chaos.py for 30 seconds on SQLite: faults of every kind are injected
under load and every invariant holds (the script's exit status and its report),
the wait workload (``--waits``) among the load."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "chaos.py"
# A fixed seed: a failure in CI replays with
# `python scripts/chaos.py --seconds 30 --seed 13 --waits`.
SEED = 13

pytestmark = pytest.mark.slow


def test_thirty_seconds_of_chaos_inject_every_fault_kind_and_break_no_invariant(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--seconds", "30", "--seed", str(SEED), "--waits",
         "--report", str(report)],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-4000:]
    figures = json.loads(report.read_text())
    assert figures["violations"] == 0
    for kind in ("actor-crash", "worker-kill", "worker-freeze", "worker-drain"):
        assert figures["faults_injected"].get(kind, 0) >= 1, (kind, figures["faults_injected"])
    assert figures["events"] >= 60, figures["events"]
    waits = figures["checks"]["waits resolved by their event"]
    judged = re.match(r"(\d+) waits judged", waits["detail"])
    assert judged and int(judged[1]) >= 5, waits
    assert "violations: 0" in done.stdout
