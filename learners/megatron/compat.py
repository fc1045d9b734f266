"""Running the released megatron-core on a machine without CUDA (DESIGN §6, §11 CPU profile).

megatron-core 0.16 assumes a CUDA device in six places (CPU-FACTS "megatron-core on CPU"):

1. `device=torch.cuda.current_device()` in buffers and layers,
2. attention always entering `get_cuda_rng_tracker().fork()`, whose tracker keeps CUDA RNG
   states,
3. literal `device="cuda"` in the pipeline schedules, the default causal mask, the optimizer
   and the grad-norm helpers,
4. CUDA streams and `synchronize` in megatron DDP and the p2p pipeline communication,
5. type checks on `tensor.type()` names: grad clipping asserts "torch.cuda.FloatTensor", the
   mixed-precision and distributed optimizers accept only "torch.cuda.*Tensor" parameters,
6. `get_megatron_optimizer` needing megatron DDP (whose gradients land in `main_grad`, so a
   plain torch optimizer beside it silently never learns).

Fixes, all inert when CUDA is present:

- `install()` (once per process): `torch.cuda.current_device` answers 0, the stream API is a
  set of no-ops, and the RNG tracker keeps CPU generator states behind the same API (1, 2, 4);
- `device_scope()`: a `TorchFunctionMode` that turns every CUDA device argument — "cuda",
  "cuda:N", an ordinal, a `torch.device` — into "cpu" (1, 3), and answers `tensor.type()` with
  the CUDA name of the tensor's type ("torch.cuda.BFloat16Tensor" for a CPU bf16 tensor), so
  megatron's type checks see the tensors as the devices it expects (5). Torch function modes
  are per-thread, so the learner enters it around each public call rather than once.
- (6) needs no patch: the learner always wraps its model in megatron DDP and builds the
  optimizer with `get_megatron_optimizer`.

Everything else in the learner is device-agnostic: it calls `install()` and `device_scope()`,
which do nothing on a CUDA machine.

Tiny-CPU check: `python -m pytest tests/unit/test_megatron_compat.py`.
"""
from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

# The `flash_mla` package (pulled in beside the inference engine) raises OSError instead of
# ImportError when no CUDA driver exists, and megatron-core probes for it on import. None in
# sys.modules makes that probe a clean ImportError, which megatron handles.
if not torch.cuda.is_available():
    sys.modules.setdefault("flash_mla", None)

_INSTALLED = False


def cuda_present() -> bool:
    """True when megatron-core can run as released (a CUDA device is visible)."""
    return torch.cuda.is_available()


def distributed_optimizer_available() -> bool:
    """megatron's DistributedOptimizer type-checks for CUDA tensors: on the CPU, data-parallel
    ranks keep full optimizer state (plain DDP all-reduce), which is exact, only less sharded."""
    return cuda_present()


def _is_cuda_device(device: object) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # A bare ordinal means a CUDA device in torch's factory functions.
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpu(TorchFunctionMode):
    """Inside the mode: CUDA device arguments become "cpu", `tensor.type()` names read CUDA."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)  # "torch.FloatTensor" -> "torch.cuda.FloatTensor" (fix 5)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.",
                                                                            1)
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to:
            args = tuple("cpu" if _is_cuda_device(a) and not isinstance(a, int) else a
                         for a in args)
        return func(*args, **kwargs)


@contextlib.contextmanager
def device_scope() -> Iterator[None]:
    """Run megatron-core code on the CPU when CUDA is absent; a no-op otherwise."""
    if cuda_present():
        yield
        return
    install()
    with _CudaToCpu():
        yield


class _NoStream:
    """Stands in for `torch.cuda.Stream`/`Event`: on the CPU every op is already ordered."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return _NoStream()

    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class CpuRNGStatesTracker:
    """megatron's `CudaRNGStatesTracker` API over CPU generator states (fixes 2).

    `fork(name)` swaps the CPU generator to the named state and back, so dropout inside a
    tensor-parallel region draws from a per-rank stream exactly as the CUDA tracker arranges.
    """

    def __init__(self) -> None:
        self.reset()

    def is_initialized(self) -> bool:
        return self._is_initialized

    def reset(self) -> None:
        self._is_initialized = False
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._is_initialized = True
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise ValueError(f"RNG seed {seed} is already tracked")
        if name in self.states_:
            raise ValueError(f"RNG state {name!r} is already tracked")
        self.seeds_.add(seed)
        generator = torch.Generator()
        generator.manual_seed(seed)
        self.states_[name] = generator.get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        if name not in self.states_:
            raise KeyError(f"RNG state {name!r} was never added to the tracker")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


def install() -> None:
    """Apply the process-wide CPU fixes (idempotent; does nothing when CUDA is present)."""
    global _INSTALLED
    if _INSTALLED or cuda_present():
        return
    from megatron.core.tensor_parallel import random as megatron_random

    torch.cuda.current_device = lambda: 0  # fix 1: the ordinal is mapped to "cpu" in scope
    torch.cuda.Stream = _NoStream  # fix 4
    torch.cuda.Event = _NoStream
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    torch.cuda.current_stream = lambda device=None: _NoStream()
    torch.cuda.default_stream = lambda device=None: _NoStream()
    torch.cuda.synchronize = lambda device=None: None
    megatron_random._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()  # fix 2
    megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    _INSTALLED = True
