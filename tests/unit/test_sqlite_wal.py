"""Stores opening one new SQLite file at once (several nodes started together):
each switches it to WAL, none gives up on the lock another holds."""

from __future__ import annotations

import sqlite3
import threading

from ironflow.store.sqlite import _to_wal


def test_stores_opening_one_new_sqlite_file_at_once_all_switch_it_to_wal(tmp_path):
    # SQLite answers a switch to WAL "database is locked" at once, without
    # its busy timeout, while another connection opening the new file holds
    # its lock (a few rounds in a hundred fail without the retry).
    failures: list[str] = []

    def open_one(path: str) -> None:
        try:
            conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
            conn.execute("PRAGMA auto_vacuum=INCREMENTAL")
            _to_wal(conn)
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("CREATE TABLE IF NOT EXISTS t (x)")
            conn.execute("COMMIT")
            assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)
            conn.close()
        except Exception as exc:  # collected: a thread's exception would not fail the test
            failures.append(repr(exc))

    for n in range(150):
        path = str(tmp_path / f"round{n}.db")
        threads = [threading.Thread(target=open_one, args=(path,)) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert failures == []
