"""argparse types for numbers typed on a command line: each refuses what it cannot bound with 'must ..., got X'
(nan, inf, and integers of thousands of digits, which int() itself refuses with a ValueError of its own)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

_MAX_DIGITS = 18  # any count a flag takes fits; int() of 4,300+ digits raises, and we never want to reach it


def _ascii_int(text: str, signed: bool) -> int | None:
    """The integer written in ASCII digits (with a sign where allowed), at most _MAX_DIGITS of them; else None
    (int() alone takes '٣' for 3 and 4,000 digits)."""
    digits = text.strip()
    body = digits[1:] if signed and digits[:1] in "+-" else digits
    return int(digits) if body.isascii() and body.isdigit() and len(body) <= _MAX_DIGITS else None


def whole_number(text: str) -> int:
    """A count: 0 or more, in ASCII digits."""
    value = _ascii_int(text, signed=False)
    if value is None:
        raise argparse.ArgumentTypeError(f"not a whole number of 0 or more: {text[:40]!r}")
    return value


def integer(text: str) -> int:
    """An integer in ASCII digits with an optional sign; its range is the setting's to check."""
    value = _ascii_int(text, signed=True)
    if value is None:
        raise argparse.ArgumentTypeError(f"not a whole number: {text[:40]!r}")
    return value


def bounded_float(ok: Callable[[float], bool], must: str, what: str = "a number") -> Callable[[str], float]:
    """A float that ok() accepts (write ok so that nan and inf fail it), else 'must, got X'."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {what}: {text[:40]!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{must}, got {text[:40]!r}")
        return value

    return parse
