"""`dtype: auto`: bf16 where the machine computes it natively, fp32 elsewhere.

bf16 halves memory and, on hardware built for it, runs faster than fp32. On a CPU without
native bf16 it is emulated and ~100× slower (measured on an AVX2-only EPYC: a
2048×576×1536 matmul on 2 threads at 137.5 GFLOP/s in fp32, 1.2 GFLOP/s in bf16), so the
choice must follow the machine, not the config author's laptop:

- CUDA: bf16.
- CPU: bf16 only when the CPU advertises a bf16 instruction set (`amx_bf16` or
  `avx512_bf16` in /proc/cpuinfo) AND a short matmul probe confirms bf16 runs at a native
  rate, not an emulated one (flags can be present while the library's kernels do not use
  them); fp32 otherwise.

`resolve_dtype` is called by the controller (engines and learners) and by the benchmarks;
the decision and its evidence are logged once per process.
"""
from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("troupe")

BF16_FLAGS = ("amx_bf16", "avx512_bf16")
# bf16 must reach this share of the fp32 matmul rate to be chosen: native kernels run at 1-3×
# fp32, emulated ones at ~0.01×. The bar sits far from both, so a burst of load from other
# processes during the probe cannot flip the choice (seen with a 0.8 bar: 7.3 vs 29.8).
MIN_BF16_SPEEDUP = 0.3
PROBE_ROUNDS = 3  # fp32 and bf16 measured alternately, best of each: load hits both alike


@dataclass(frozen=True)
class DtypeChoice:
    """The resolved dtype and why."""

    dtype: str  # "bfloat16" | "float32"
    reason: str  # one line for the log and the run's summary


def cpu_bf16_flags(cpuinfo: str | None = None) -> list[str]:
    """The bf16 instruction-set flags this CPU advertises (empty off Linux)."""
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        cpuinfo = path.read_text() if path.exists() else ""
    words = set(cpuinfo.split())
    return [flag for flag in BF16_FLAGS if flag in words]


def matmul_gflops(dtype_name: str, size: tuple[int, int, int] = (1024, 576, 1536),
                  seconds: float = 0.3, threads: int = 2) -> float:
    """GFLOP/s of repeated [m,k]×[k,n] CPU matmuls in `dtype_name` for about `seconds`."""
    import torch

    dtype = getattr(torch, dtype_name)
    m, k, n = size
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a = torch.randn(m, k).to(dtype)
        b = torch.randn(k, n).to(dtype)
        a @ b  # warm-up: the first call picks and loads kernels
        calls, start = 0, time.perf_counter()
        while True:
            a @ b
            calls += 1
            elapsed = time.perf_counter() - start
            if elapsed >= seconds:
                return 2 * m * k * n * calls / elapsed / 1e9
    finally:
        torch.set_num_threads(previous)


@functools.lru_cache(maxsize=None)
def _cpu_choice() -> DtypeChoice:
    flags = cpu_bf16_flags()
    if not flags:
        return DtypeChoice("float32", f"CPU lacks native bf16 ({'/'.join(BF16_FLAGS)} absent)")
    rates: dict[str, float] = {"float32": 0.0, "bfloat16": 0.0}
    for _ in range(PROBE_ROUNDS):
        for name in rates:
            rates[name] = max(rates[name], matmul_gflops(name, seconds=0.1))
    fp32, bf16 = rates["float32"], rates["bfloat16"]
    evidence = f"{'+'.join(flags)}; matmul probe bf16 {bf16:.1f} vs fp32 {fp32:.1f} GFLOP/s"
    if bf16 >= MIN_BF16_SPEEDUP * fp32:
        return DtypeChoice("bfloat16", f"CPU has native bf16 ({evidence})")
    return DtypeChoice("float32", f"bf16 flags present but slow ({evidence})")


def auto_dtype(device: str) -> DtypeChoice:
    """The dtype `auto` means on `device` ("cuda" or "cpu") of this machine."""
    if device == "cuda":
        return DtypeChoice("bfloat16", "CUDA device")
    return _cpu_choice()


def resolve_dtype(dtype: str, device: str, what: str = "") -> str:
    """`dtype` itself, or the machine's choice when it is "auto" (logged with its reason)."""
    if dtype != "auto":
        return dtype
    choice = auto_dtype(device)
    log.info("dtype auto%s -> %s: %s", f" for {what}" if what else "", choice.dtype,
             choice.reason)
    return choice.dtype
