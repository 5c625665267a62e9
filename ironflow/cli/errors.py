"""How a command fails: a message and hints on stderr, and the exit code.

Exit codes: 0 success; 1 the engine refused the request or could not be
reached; 2 bad usage (unknown flag, malformed ``--data``, invalid config).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import IO, Any, NoReturn

import click

EXIT_FAILURE = 1
EXIT_USAGE = 2


class CliFailure(click.ClickException):
    """Printed as ``error: <message>`` (plus optional hint lines) on stderr; exit code 1."""

    exit_code = EXIT_FAILURE

    def __init__(self, message: str, *, hints: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.hints = list(hints)

    def show(self, file: IO[Any] | None = None) -> None:
        click.echo(f"error: {self.message}", err=True)
        for hint in self.hints:
            click.echo(f"hint: {hint}", err=True)


class UsageFailure(CliFailure):
    """Bad input from the caller (malformed --data, invalid config): exit code 2."""

    exit_code = EXIT_USAGE


def usage_failure(message: str) -> NoReturn:
    raise UsageFailure(message)
