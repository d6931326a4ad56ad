"""Figures as people read them: one formatter per unit for every table and message."""

from __future__ import annotations


def human_bytes(n: float) -> str:
    """``n`` bytes in binary units: ``1.5 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def human_count(n: float, suffix: str = "") -> str:
    """``n`` in decimal units: ``1.30 G`` (parameters, FLOPs)."""
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}{suffix}"
    return f"{n:.0f} {suffix}".rstrip()


def human_time(s: float) -> str:
    """``s`` seconds as s, ms or us: ``12.345 ms``."""
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3f} ms"
    return f"{s * 1e6:.1f} us"


__all__ = ["human_bytes", "human_count", "human_time"]
