"""Facts about this host that kernel and thread choices depend on."""

from __future__ import annotations

_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def last_level_cache_bytes(default: int = 32 << 20) -> int:
    """The largest CPU cache of cpu0 (Linux sysfs), or ``default`` where it cannot be read."""
    sizes = []
    for index in range(8):
        try:
            with open(f"/sys/devices/system/cpu/cpu0/cache/index{index}/size") as handle:
                text = handle.read().strip()
        except OSError:
            break
        try:
            sizes.append(int(text[:-1]) * _UNITS[text[-1]] if text[-1] in _UNITS else int(text))
        except (ValueError, IndexError):
            continue
    return max(sizes, default=default)
