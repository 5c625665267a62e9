"""A worker's lifecycle lines are visible out of the box, and never printed twice."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from ironflow.sdk import lifecycle

# Every test here runs on asyncio and on trio (tests/sdk/conftest.py).
pytestmark = pytest.mark.anyio


@pytest.fixture
def bare_logging(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Logging as in a fresh ``python worker.py``: no handlers anywhere, no levels chosen."""
    worker_log = logging.getLogger("ironflow.worker")
    monkeypatch.setattr(worker_log, "handlers", [])
    monkeypatch.setattr(worker_log, "level", logging.NOTSET)
    monkeypatch.setattr(logging.getLogger("ironflow"), "level", logging.NOTSET)
    monkeypatch.setattr(logging.getLogger("ironflow"), "handlers", [])
    monkeypatch.setattr(logging.getLogger("ironflow"), "propagate", True)
    worker_log.manager._clear_cache()  # type: ignore[attr-defined]
    # pytest adds its capturing handlers to root when the test body starts:
    # each test empties root's handlers itself.
    yield
    worker_log.manager._clear_cache()  # type: ignore[attr-defined]


def test_lifecycle_lines_reach_stderr_when_no_logging_is_configured(
    bare_logging: None, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(logging.root, "handlers", [])
    lifecycle._announce_lifecycle()
    lifecycle._announce_lifecycle()  # a second worker in the process adds nothing
    logging.getLogger("ironflow.worker").info("Draining worker...", extra={"fields": {"worker_id": "w1"}})
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1
    assert "INFO ironflow.worker: Draining worker... worker_id=w1" in err[0]


def test_an_application_that_configures_logging_gets_each_line_once(
    bare_logging: None, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(logging.root, "handlers", [])
    lifecycle._announce_lifecycle()
    seen: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    logging.root.addHandler(Collect())  # the application configures logging afterwards
    logging.getLogger("ironflow.worker").info("Waiting for 1 jobs to complete...")
    assert seen == ["Waiting for 1 jobs to complete..."]
    assert capsys.readouterr().err == ""


def test_a_level_the_application_chose_is_kept(
    bare_logging: None, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(logging.root, "handlers", [])
    logging.getLogger("ironflow").setLevel(logging.WARNING)
    lifecycle._announce_lifecycle()
    logging.getLogger("ironflow.worker").info("Draining worker...")
    logging.getLogger("ironflow.worker").warning("Drain deadline reached; cancelling 1 active jobs")
    err = capsys.readouterr().err
    assert "Draining worker..." not in err and "Drain deadline reached" in err
