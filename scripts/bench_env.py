"""The header every benchmark prints first: the CPU it ran on and what `dtype: auto` chose there.

Figures from two machines are only comparable when this line matches: a bf16 step is ~100×
slower on a CPU without native bf16 (runtime/dtype.py). The load average says how much other
work shared the cores while the figures were taken.
"""
from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install

from runtime.dtype import DtypeChoice, auto_dtype, cpu_bf16_flags  # noqa: E402


def cpu_model() -> str:
    """The CPU's `model name` from /proc/cpuinfo (the platform's name elsewhere)."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def dtype_header(device: str = "cpu") -> tuple[DtypeChoice, str]:
    """The dtype `auto` resolves to on `device`, and the header lines saying why."""
    choice = auto_dtype(device)
    flags = "+".join(cpu_bf16_flags()) or "none"
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    text = (f"cpu: {cpu_model()} (bf16 flags: {flags}), {os.cpu_count()} cores, "
            f"load average {load} (other jobs share them)\n"
            f"dtype auto on {device} -> {choice.dtype}: {choice.reason}")
    return choice, text


class HeldBytes:
    """Bytes a benchmark side holds, measured alike for every side: tracemalloc (Python
    objects and numpy data) plus Arrow's memory pool, counted from `start`.

    Arrow's pool has no resettable peak, so `note` reads it after every message; `peak` is
    tracemalloc's peak plus the highest pool reading. Does nothing when `on` is False.
    """

    def __init__(self, on: bool) -> None:
        self.on = on
        self.arrow_before = 0
        self.arrow_peak = 0

    def start(self) -> None:
        if self.on:
            import gc
            import tracemalloc

            import pyarrow as pa

            gc.collect()
            self.arrow_before = pa.total_allocated_bytes()
            tracemalloc.start()

    def note(self) -> None:
        if self.on:
            import pyarrow as pa

            self.arrow_peak = max(self.arrow_peak,
                                  pa.total_allocated_bytes() - self.arrow_before)

    def held(self) -> int | None:
        """Bytes allocated now (after a collection); None when off."""
        if not self.on:
            return None
        import gc
        import tracemalloc

        import pyarrow as pa

        gc.collect()
        return tracemalloc.get_traced_memory()[0] + pa.total_allocated_bytes() - self.arrow_before

    def stop(self) -> int | None:
        """The peak bytes, and tracemalloc stopped; None when off."""
        if not self.on:
            return None
        import tracemalloc

        peak = tracemalloc.get_traced_memory()[1] + self.arrow_peak
        tracemalloc.stop()
        return peak
