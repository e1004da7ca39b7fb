"""Byte sizes and memory budgets: parsing and formatting.

Sizes (`parse_size`) accept a number with an optional unit, case-insensitive, spaces allowed:

    B, bytes                 bytes                     "4096", "4096 B"
    KB, MB, GB, TB, PB       powers of 1000 (SI)       "1.5GB" == 1_500_000_000
    KiB, MiB, GiB, TiB, PiB  powers of 1024 (IEC)      "512 MiB" == 536_870_912
    K, M, G, T, P            shorthand for KiB ... PiB "16G" == 16 GiB

Budgets (`parse_budget`) are either an absolute size or a fraction of the baseline peak (the
unmodified step's memory): "40%", or a float in (0, 1] such as 0.4. An int is a size in bytes.

Formatting: `format_bytes` is for humans ("1.50 GiB", "312.0 KiB", "12 B": 2 decimals below 10,
1 decimal from 10, whole bytes below 1 KiB); `format_size` is exact and parses back to the same
int ("6GiB", "1536MiB", "1500MB", "4097").
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

__all__ = ["Budget", "Size", "parse_size", "parse_budget", "format_bytes", "format_size"]

_BINARY = {"k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4, "p": 1024**5}
_UNITS: dict[str, int] = {"": 1, "b": 1, "byte": 1, "bytes": 1}
for _prefix, _factor in _BINARY.items():
    _UNITS[_prefix] = _factor  # K, M, G, T, P: binary shorthand
    _UNITS[_prefix + "ib"] = _factor  # KiB ...
    _UNITS[_prefix + "b"] = 1000 ** (list(_BINARY).index(_prefix) + 1)  # KB ... (SI)

_UNIT_HELP = ("use B, KB/MB/GB/TB (powers of 1000), KiB/MiB/GiB/TiB (powers of 1024) "
              "or K/M/G/T (short for KiB/MiB/GiB/TiB)")
_SIZE_RE = re.compile(r"^\s*([+-]?)((?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)\s*([A-Za-z]*)\s*$")
_PCT_RE = re.compile(r"^\s*([+-]?(?:\d+(?:\.\d*)?|\.\d+))\s*%\s*$")

SIZE_EXAMPLE = "a size like '4GiB' or '512 MiB'"
BUDGET_EXAMPLE = "a size like '4GiB' or '40%'"


class Size(int):
    """A number of bytes. Use it as a field type in a pass's options dataclass to accept size
    strings ('4GiB', '512 MiB', 4096); the policy layer stores a `Size` (an int)."""

    def __repr__(self) -> str:
        return f"Size({int(self)})"


def parse_size(size: str | int | float) -> int:
    """'6GiB', '512 MiB', '1.5GB', '4096', '16G' (= 16 GiB) -> bytes (an int >= 0).

    Raises ValueError naming what was expected."""
    if isinstance(size, bool):
        raise ValueError(f"expected {SIZE_EXAMPLE}, got {size!r}")
    if isinstance(size, int):
        if size < 0:
            raise ValueError(f"a size cannot be negative, got {size}")
        return int(size)
    if isinstance(size, float):
        if not math.isfinite(size) or size < 0 or size != int(size):
            raise ValueError(f"expected {SIZE_EXAMPLE} (a whole number of bytes), got {size!r}")
        return int(size)
    if not isinstance(size, str):
        raise ValueError(f"expected {SIZE_EXAMPLE}, got {size!r}")
    match = _SIZE_RE.match(size)
    if not match:
        raise ValueError(f"expected {SIZE_EXAMPLE}, got {size!r}")
    sign, number, unit = match.groups()
    factor = _UNITS.get(unit.lower())
    if factor is None:
        raise ValueError(f"unknown unit {unit!r} in {size!r}; {_UNIT_HELP}")
    if sign == "-":
        raise ValueError(f"a size cannot be negative, got {size!r}")
    if re.fullmatch(r"\d+", number):
        return int(number) * factor  # exact for big integers
    value = float(number) * factor
    if not math.isfinite(value):
        raise ValueError(f"{size!r} is too large to be a size in bytes")
    if factor == 1 and value != int(value):
        raise ValueError(f"expected a whole number of bytes, got {size!r}")
    return int(round(value))


def _pct(fraction: float) -> str:
    """Shortest percentage string that parses back to exactly `fraction` (else the float)."""
    for decimals in range(0, 17):
        text = f"{fraction * 100:.{decimals}f}"
        if float(text) / 100 == fraction:
            return text + "%"
    return repr(fraction)  # no percentage is exact (e.g. 1/3); a bare float parses back exactly


@dataclass(frozen=True)
class Budget:
    """A memory budget: exactly one of `bytes` (absolute) or `fraction` (of the baseline peak)."""

    bytes: int | None = None
    fraction: float | None = None

    def __post_init__(self) -> None:
        if (self.bytes is None) == (self.fraction is None):
            raise ValueError("a Budget has exactly one of bytes or fraction")
        if self.bytes is not None and (isinstance(self.bytes, bool) or not isinstance(self.bytes, int)
                                       or self.bytes <= 0):
            raise ValueError(f"a byte budget must be a positive int, got {self.bytes!r}")
        if self.fraction is not None and not (0 < self.fraction <= 1):
            raise ValueError(f"a fractional budget must be in (0, 1], got {self.fraction!r}")

    @property
    def is_fraction(self) -> bool:
        return self.fraction is not None

    def resolve(self, baseline_bytes: int) -> int:
        """Bytes allowed, given the baseline peak. Fractions round down (never above the budget)."""
        if self.bytes is not None:
            return self.bytes
        if baseline_bytes < 0:
            raise ValueError(f"baseline_bytes must be >= 0, got {baseline_bytes}")
        return math.floor(self.fraction * baseline_bytes)

    def __str__(self) -> str:
        """'40%' or an exact size ('6GiB'); `parse_budget(str(b)) == b`."""
        return _pct(self.fraction) if self.fraction is not None else format_size(self.bytes)

    def describe(self, baseline_bytes: int | None = None) -> str:
        """Human text: '40% of baseline (1.20 GiB)' or '6.00 GiB'."""
        if self.bytes is not None:
            return format_bytes(self.bytes)
        text = f"{_pct(self.fraction)} of baseline"
        if baseline_bytes is not None:
            text += f" ({format_bytes(self.resolve(baseline_bytes))})"
        return text


def parse_budget(budget: str | int | float | Budget) -> Budget:
    """'40%' or 0.4 -> fraction; '6GiB', '512 MiB', 4096 -> bytes. Raises ValueError."""
    if isinstance(budget, Budget):
        return budget
    if isinstance(budget, bool):
        raise ValueError(f"expected {BUDGET_EXAMPLE}, got {budget!r}")
    if isinstance(budget, float):
        if not (0 < budget <= 1):
            raise ValueError(f"expected a fraction in (0, 1] such as 0.4, or {BUDGET_EXAMPLE}, got {budget!r}")
        return Budget(fraction=budget)
    if isinstance(budget, int):
        if budget <= 0:
            raise ValueError(f"a budget must be more than 0 bytes, got {budget}")
        return Budget(bytes=budget)
    if not isinstance(budget, str):
        raise ValueError(f"expected {BUDGET_EXAMPLE}, got {budget!r}")
    match = _PCT_RE.match(budget)
    if match:
        pct = float(match.group(1))
        if not (0 < pct <= 100):
            raise ValueError(f"expected a percentage in (0%, 100%], got {budget!r}")
        return Budget(fraction=pct / 100)
    match = _SIZE_RE.match(budget)
    if not match:
        raise ValueError(f"expected {BUDGET_EXAMPLE}, got {budget!r}")
    if not match.group(3) and not re.fullmatch(r"\s*\+?\d+\s*", budget):
        # a bare non-integer number written as a string: same rule as the float form
        value = float(budget)
        if not (0 < value <= 1):
            raise ValueError(f"expected a fraction in (0, 1] such as 0.4, or {BUDGET_EXAMPLE}, got {budget!r}")
        return parse_budget(value)
    try:
        size_bytes = parse_size(budget)
    except ValueError as error:
        raise ValueError(f"expected {BUDGET_EXAMPLE}, got {budget!r} ({error})") from None
    if size_bytes <= 0:
        raise ValueError(f"a budget must be more than 0 bytes, got {budget!r}")
    return Budget(bytes=size_bytes)


_FMT_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def format_bytes(num_bytes: int | float) -> str:
    """Human, deterministic: '12 B', '312.0 KiB', '1.50 GiB', '-3.25 MiB'.

    Below 1 KiB whole bytes; otherwise the largest binary unit, with 2 decimals below 10 and
    1 decimal from 10 up (so about three significant digits)."""
    if isinstance(num_bytes, float) and not math.isfinite(num_bytes):
        return f"{num_bytes} B"
    sign = "-" if num_bytes < 0 else ""
    num_bytes = abs(num_bytes)
    if num_bytes < 1024:
        return f"{sign}{int(round(num_bytes))} B"
    unit_index = 0
    value = float(num_bytes)
    while unit_index < len(_FMT_UNITS) - 1 and value >= 1024:
        value /= 1024
        unit_index += 1
    decimals = 2 if value < 10 else 1
    if round(value, decimals) >= 1024 and unit_index < len(_FMT_UNITS) - 1:
        value /= 1024
        unit_index += 1
        decimals = 2
    return f"{sign}{value:.{decimals}f} {_FMT_UNITS[unit_index]}"


def format_size(num_bytes: int) -> str:
    """Exact size string that `parse_size` reads back to `num_bytes`: '6GiB', '1.5GiB', '1500MB', '4097'."""
    num_bytes = int(num_bytes)
    if num_bytes <= 0:
        return str(num_bytes)
    binary = (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024))
    for unit, factor in binary + (("TB", 1000**4), ("GB", 1000**3), ("MB", 1000**2), ("KB", 1000)):
        if num_bytes % factor == 0:
            return f"{num_bytes // factor}{unit}"
    for unit, factor in binary:
        if num_bytes >= factor:
            for decimals in (1, 2):
                text = f"{num_bytes / factor:.{decimals}f}"
                if parse_size(text + unit) == num_bytes:
                    return text + unit
    return str(num_bytes)
