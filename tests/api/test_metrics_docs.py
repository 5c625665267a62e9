"""The Grafana dashboard and the Metrics section of docs/operations.md only name series the node exports."""

from __future__ import annotations

import re
from pathlib import Path

from ironflow.engine import metrics

ROOT = Path(__file__).resolve().parents[2]
SERIES = re.compile(r"\bironflow_[a-z_]+")


def _exported() -> set[str]:
    """Every sample name the registry can produce (counters' _total, histograms' _bucket…)."""
    names: set[str] = set()
    for family in metrics.REGISTRY.collect():
        names.add(family.name)
        names.update(sample.name for sample in family.samples)
        if family.type == "counter":
            names.add(family.name + "_total")
        if family.type == "histogram":
            names.update(family.name + s for s in ("_bucket", "_sum", "_count"))
    return names


def test_every_series_the_grafana_dashboard_queries_is_exported() -> None:
    queried = set(SERIES.findall((ROOT / "docs" / "grafana-dashboard.json").read_text()))
    assert queried, "the dashboard queries nothing"
    assert queried - _exported() == set()


def test_every_metric_the_operations_guide_names_is_exported_and_every_new_one_is_documented() -> None:
    guide = (ROOT / "docs" / "operations.md").read_text()
    section = guide.split("\n## Metrics\n", 1)[1].split("\n## ", 1)[0]
    named = set(SERIES.findall(section))
    assert named - _exported() == set()
    for family in ("ironflow_emit_to_dispatch_seconds", "ironflow_step_commit_seconds",
                   "ironflow_run_duration_seconds", "ironflow_queue_depth",
                   "ironflow_active_leases", "ironflow_sessions", "ironflow_wake_lateness_seconds",
                   "ironflow_store_call_seconds"):
        assert family in named, family
