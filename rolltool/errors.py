"""The project's one error type: a message for people, plus a hint on what to do."""

from __future__ import annotations


class RolltoolError(Exception):
    """A problem the user can fix (bad input, bad option, existing output).

    The CLI prints ``Error: <message>`` and, on the next line, ``Hint: <hint>``, then exits 1.
    Anything else that escapes is a bug and keeps its traceback.
    """

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message}\nHint: {self.hint}"


class OptionConflict(RolltoolError):
    """Settings that exclude each other, or one given without the setting it applies to: a
    usage mistake. The API and the CLI refuse the same combinations (declared once, where the
    settings live); the CLI exits 2 on it, as for its own usage errors."""
