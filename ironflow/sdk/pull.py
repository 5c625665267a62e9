"""``PullWorker``: the HTTP long-poll transport (not implemented yet)."""

from __future__ import annotations


class PullWorker:
    def __init__(self, *args: object, **kwargs: object) -> None:
        raise NotImplementedError("PullWorker is not implemented yet")
