"""How numbers, times and dates read on the pages: the Jinja filters, one place for each unit.

A missing value prints as an em dash, never as 0. Speedups carry "×", fractions print as percent,
times in ms, rates with their units (TFLOP/s = 10^12 FLOP/s, GB/s = 10^9 B/s).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from markupsafe import Markup, escape

MISSING = "—"


def speedup(value: float | None) -> str:
    """'12.3×': two decimals below 10, one below 100, none above (e.g. 0.87×, 12.3×, 245×)."""
    if value is None:
        return MISSING
    digits = 2 if value < 10 else 1 if value < 100 else 0
    return f"{value:.{digits}f}×"


def pct(fraction: float | None) -> str:
    """A fraction as percent: 0.4123 -> '41.2%', 0.0123 -> '1.23%'."""
    if fraction is None:
        return MISSING
    value = 100.0 * fraction
    return f"{value:.{2 if value < 10 else 1}f}%"


def ms(value: float | None) -> str:
    """Milliseconds with four significant digits: '0.01234', '1.235', '123.5'."""
    if value is None:
        return MISSING
    return f"{value:#.4g}".rstrip(".") if value < 1e4 else f"{value:,.0f}"


def num(value: float | None, digits: int = 1) -> str:
    """A plain number with thousands separators and `digits` decimals."""
    return MISSING if value is None else f"{value:,.{digits}f}"


def count(value: int | None) -> str:
    """An integer count with thousands separators: 1234567 -> '1,234,567'."""
    return MISSING if value is None else f"{value:,d}"


def when(value: datetime | None) -> str:
    """A UTC timestamp to the minute: '2026-11-29 19:00 UTC'."""
    if value is None:
        return MISSING
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M UTC")


def duration(seconds: float | None) -> str:
    """'42 s', '12 min', '1 h 05 min'."""
    if seconds is None:
        return MISSING
    if seconds < 90:
        return f"{seconds:.0f} s"
    minutes = round(seconds / 60)
    return f"{minutes} min" if minutes < 60 else f"{minutes // 60} h {minutes % 60:02d} min"


def usd(value: float | None) -> str:
    return MISSING if value is None else f"${value:,.2f}"


def orblank(value: Any) -> Any:
    """The value itself, or an em dash for None or an empty string."""
    return MISSING if value is None or value == "" else value


def breakable(text: str) -> Markup:
    """A long identifier (a run id, a kernel name) escaped, with a line-break opportunity (<wbr>) after each
    '_', '/' and ',': it wraps at its parts on a phone instead of widening the page or breaking mid-word."""
    return Markup(re.sub(r"([_/,])", r"\1<wbr>", str(escape(text))))


def model_slug(model: str) -> str:
    """A model key as one URL path part: lower-case letters, digits, '.', '_' and '-'.

    A key that is already such a part is its own slug ('fable-5'); any other gets the lossy form plus
    8 hex digits of its sha256, so two different keys never share a page ('evil-script-3f2a9c1d').
    """
    base = re.sub(r"[^a-z0-9._-]+", "-", model.lower()).strip("-._") or "model"
    if base == model and base != "index.html":
        return base
    return f"{base[:60]}-{hashlib.sha256(model.encode()).hexdigest()[:8]}"


#: Every filter the templates may use, by name.
FILTERS: dict[str, Callable[..., str]] = {
    "speedup": speedup,
    "pct": pct,
    "ms": ms,
    "num": num,
    "count": count,
    "when": when,
    "duration": duration,
    "usd": usd,
    "orblank": orblank,
    "breakable": breakable,
    "model_slug": model_slug,
}
