"""The CPU compatibility layer for megatron-core: each of the six fixes, on this CUDA-less box."""
from __future__ import annotations

import pytest
import torch

from learners.megatron import compat

pytestmark = pytest.mark.skipif(compat.cuda_present(),
                                reason="the compatibility layer is inert when CUDA is present")


def test_cuda_device_arguments_become_cpu_inside_the_scope():
    with compat.device_scope():
        made = [
            torch.empty(3, device="cuda"),
            torch.zeros(2, device=torch.cuda.current_device()),  # fix 1: an ordinal
            torch.ones(1, device=torch.device("cuda", 0)),
            torch.tensor([1.0], device="cuda:0"),  # fix 3: literal device strings
            torch.arange(2).cuda(),
            torch.arange(2).to("cuda"),
        ]
    assert all(t.device.type == "cpu" for t in made)
    with pytest.raises((RuntimeError, AssertionError)):
        torch.empty(3, device="cuda")  # outside the scope nothing is rewritten


def test_streams_are_no_ops():
    compat.install()
    stream = torch.cuda.Stream(device=torch.cuda.current_device())  # fix 4
    with torch.cuda.stream(stream):
        stream.wait_stream(torch.cuda.default_stream())
    torch.cuda.synchronize()


def test_rng_tracker_forks_a_reproducible_named_stream():
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    compat.install()
    tracker = get_cuda_rng_tracker()  # fix 2: megatron's accessor returns the CPU tracker
    assert isinstance(tracker, compat.CpuRNGStatesTracker)
    tracker.reset()
    tracker.add("model-parallel-rng", 1234)
    torch.manual_seed(0)
    outer_expected = torch.rand(3)
    torch.manual_seed(0)
    with tracker.fork():
        inside = torch.rand(3)
    outer = torch.rand(3)
    torch.testing.assert_close(outer, outer_expected, atol=0, rtol=0)  # outer stream untouched
    assert torch.equal(inside, torch.rand(3, generator=torch.Generator().manual_seed(1234)))
    with tracker.fork():  # the named stream continues where it stopped
        continued = torch.rand(3)
    generator = torch.Generator().manual_seed(1234)
    torch.rand(3, generator=generator)
    assert torch.equal(continued, torch.rand(3, generator=generator))
    with pytest.raises(ValueError, match="already tracked"):
        tracker.add("other", 1234)


def test_tensor_type_names_read_as_cuda_inside_the_scope():
    with compat.device_scope():
        assert torch.zeros(1).type() == "torch.cuda.FloatTensor"  # fix 5
        assert torch.zeros(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
        assert torch.zeros(1).type(torch.float64).dtype == torch.float64  # conversions untouched
    assert torch.zeros(1).type() == "torch.FloatTensor"


def test_megatron_grad_norm_and_clip_run_on_cpu_gradients():
    from megatron.core.optimizer import optimizer as megatron_optimizer
    from megatron.core.optimizer.clip_grads import get_grad_norm_fp32

    compat.install()
    params = [torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(2, 2))]
    params[0].grad = torch.full((4,), 3.0)
    params[1].grad = torch.full((2, 2), 4.0)
    import torch.distributed as dist

    from learners.megatron.parallel import init_parallel

    init_parallel(1, 1, seed=0)
    with compat.device_scope():  # fix 3: the norm helpers allocate on "cuda"
        norm = get_grad_norm_fp32([p.grad for p in params],
                                  grad_stats_parallel_group=dist.group.WORLD)
        megatron_optimizer.clip_grad_by_total_norm_fp32(params, max_norm=1.0, total_norm=norm)
    assert norm == pytest.approx(10.0)
    clipped = torch.cat([p.grad.flatten() for p in params]).norm().item()
    assert clipped == pytest.approx(1.0, rel=1e-5)  # fix 5: CPU gradients scaled, no assertion


def test_flash_mla_probe_is_a_clean_import_error():
    import sys

    assert "flash_mla" in sys.modules and sys.modules["flash_mla"] is None
    with pytest.raises(ImportError):
        import flash_mla  # noqa: F401
