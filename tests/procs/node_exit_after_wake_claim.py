"""An engine node that crashes between the waker's claim and its resume.

Usage: python tests/procs/node_exit_after_wake_claim.py SERVE_FLAGS...

Exactly ``ironflow serve SERVE_FLAGS`` except that the first
``claim_elapsed_steps`` that claims anything is followed by ``os._exit(86)``
(no cleanup, like a crash), leaving the claimed steps ``waking``: what loop 2
exists to repair (tests/integration/test_wake_claims.py). A fault injected
from outside the engine, as ``tests/sim/bugs.py`` does.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import ironflow.node  # noqa: E402
from ironflow.cli import main  # noqa: E402
from ironflow.store import Store, open_store  # noqa: E402

EXIT_CODE = 86


def _exits_after_first_claim(url: str, **kwargs: Any) -> Store:
    store = open_store(url, **kwargs)
    claim = store.claim_elapsed_steps

    async def claim_then_exit(*args: Any, **kw: Any) -> Any:
        claimed = await claim(*args, **kw)
        if claimed:
            sys.stderr.write(f"test fault: exiting between claim and resume claimed={len(claimed)}\n")
            sys.stderr.flush()
            os._exit(EXIT_CODE)
        return claimed

    store.claim_elapsed_steps = claim_then_exit  # type: ignore[method-assign]
    return store


if __name__ == "__main__":
    ironflow.node.open_store = _exits_after_first_claim  # type: ignore[assignment]
    main(["serve", *sys.argv[1:]])
