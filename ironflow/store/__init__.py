"""Engine state: one interface (:mod:`ironflow.store.base`), two backends."""

from ironflow.store.base import *  # noqa: F403
