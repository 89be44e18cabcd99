"""The one error type for bad input: a draft's or target's config, a server option, a data file."""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """Bad input. Names the field, the value and the fix; raised at the earliest point that can see it."""

    def __init__(self, field: str, value: Any, problem: str, fix: str):
        self.field, self.value, self.problem, self.fix = field, value, problem, fix
        super().__init__(f"{field}={value!r}: {problem}. Fix: {fix}")


def combined(errors: list[ConfigError]) -> ConfigError:
    """One error carrying all of `errors` (the first's field, value and fix; the others in its problem)."""
    first = errors[0]
    if len(errors) == 1:
        return first
    return ConfigError(first.field, first.value,
                       first.problem + " (and: " + "; ".join(str(e) for e in errors[1:]) + ")", first.fix)
