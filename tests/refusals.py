"""Collects what a series of refused calls say, so that a test can check each message by position."""

from __future__ import annotations


def value_error_messages(*calls) -> list[str]:
    """The message of each call that raises ValueError, in order; a call that does not raise adds nothing (so a
    missing refusal shows as a short list)."""
    messages = []
    for call in calls:
        try:
            call()
        except ValueError as error:
            messages.append(str(error))
    return messages
