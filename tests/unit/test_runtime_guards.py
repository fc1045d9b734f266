"""Runtime guards: dtype auto, non-finite metrics, the stall diagnosis (runtime/)."""
import math

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from runtime import dtype as dtype_module
from runtime.config import load_config
from runtime.metrics import MetricsWriter
from runtime.stall import Snapshot, diagnose


# ---------------------------------------------------------------- dtype auto

def test_cpu_flags_are_read_from_cpuinfo():
    assert dtype_module.cpu_bf16_flags("flags : fpu avx2 avx512f") == []
    assert dtype_module.cpu_bf16_flags("flags : avx2 avx512_bf16 amx_bf16") == ["amx_bf16",
                                                                                 "avx512_bf16"]


@pytest.mark.parametrize("flags, rates, expected", [
    ([], None, "float32"),  # no native bf16: fp32 without even probing
    (["avx512_bf16"], {"float32": 100.0, "bfloat16": 250.0}, "bfloat16"),
    (["avx512_bf16"], {"float32": 137.5, "bfloat16": 1.2}, "float32"),  # flags but emulated
])
def test_auto_picks_bf16_only_where_it_is_native_and_fast(monkeypatch, flags, rates, expected):
    dtype_module._cpu_choice.cache_clear()
    monkeypatch.setattr(dtype_module, "cpu_bf16_flags", lambda: flags)
    probed = []

    def fake_rate(name, **_):
        probed.append(name)
        return rates[name]

    monkeypatch.setattr(dtype_module, "matmul_gflops", fake_rate)
    try:
        choice = dtype_module.auto_dtype("cpu")
    finally:
        dtype_module._cpu_choice.cache_clear()
    assert choice.dtype == expected and choice.reason
    assert bool(probed) == bool(flags)
    assert dtype_module.auto_dtype("cuda").dtype == "bfloat16"


def test_explicit_dtypes_pass_through_and_auto_is_the_run_default(tmp_path):
    assert dtype_module.resolve_dtype("float32", "cpu") == "float32"
    assert dtype_module.resolve_dtype("auto", "cpu") in ("float32", "bfloat16")
    config = tmp_path / "c.yaml"
    config.write_text("workflow: {name: signal_game, agents: {sender: m, receiver: m}}\n"
                      "models: {m: {path: tiny}}\n")
    model = load_config(config).models["m"]
    assert model.engine.dtype == "auto" and model.learner.dtype == "auto"


def test_the_probe_measures_a_positive_rate():
    assert dtype_module.matmul_gflops("float32", size=(64, 64, 64), seconds=0.05) > 0


# ---------------------------------------------------------------- metrics

def test_non_finite_scalars_are_written_and_counted(tmp_path):
    writer = MetricsWriter(tmp_path)
    writer.scalars({"train/m/loss": 1.0}, 0)
    writer.scalars({"train/m/loss": float("nan"), "train/m/grad": float("inf")}, 1)
    writer.scalars({"train/m/loss": float("nan"), "x": None}, 2)
    assert writer.counts() == {"non_finite": {"train/m/loss": 2, "train/m/grad": 1},
                               "missing": {"x": 1}}
    writer.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    losses = [e.value for e in acc.Scalars("train/m/loss")]
    assert losses[0] == 1.0 and all(math.isnan(v) for v in losses[1:]) and len(losses) == 3
    assert math.isinf(acc.Scalars("train/m/grad")[0].value)


# ---------------------------------------------------------------- stall diagnosis

def snapshot(at, *, version=3, in_step_s=0.0, pending=0, dropped=0, failed=0, restarts=0,
             issued=8, limit=12, rounds=10, ready_units=0):
    return Snapshot(
        at=at,
        learners={"policy": {"version": version, "in_step_s": in_step_s}},
        buffers={"policy": {"pending_rows": pending, "ready_rows": 0, "ready_units": ready_units,
                            "rows_added": 100, "rows_trained": 80,
                            "dropped": {"stale": dropped, "timeout": 0}}},
        clock={"policy": {"issued_units": issued, "limit": limit, "version": version}},
        coach={"in_flight": 5.0, "queued": 2.0, "failures": 0.0},
        rollouts=[{"rounds": rounds, "rounds_failed": {"episode_error": failed},
                   "last_error": "arith-3: EngineError('unreachable')" if failed else ""}],
        engines={"policy-0": {"restarts": restarts}})


@pytest.mark.parametrize("now_kwargs, stage", [
    (dict(in_step_s=600.0), "learner step"),
    (dict(pending=24), "rows pending on the coach"),
    (dict(dropped=16), "dropped units"),
    (dict(failed=7), "engine errors"),
    (dict(restarts=1), "engine errors"),
    (dict(issued=12), "admission"),
    (dict(rounds=10), "rollouts"),
])
def test_diagnosis_names_the_stuck_stage(now_kwargs, stage):
    message = diagnose(snapshot(0.0), snapshot(600.0, **now_kwargs), {"policy": 4})
    assert message.startswith("no learner step for 600 s")
    assert f"stuck at {stage}" in message
    if stage == "engine errors" and now_kwargs.get("failed"):
        assert "EngineError('unreachable')" in message


def test_a_stage_closer_to_the_learner_wins():
    # rows wait on the coach AND admission is full (it is full because nothing trains)
    message = diagnose(snapshot(0.0), snapshot(900.0, pending=8, issued=12), {"policy": 4})
    assert "stuck at rows pending on the coach" in message


def test_an_unresolved_auto_never_reaches_an_engine_or_a_learner(tmp_path):
    from actors.engines.sglang import EngineConfig, SGLangEngine
    from learners.config import LearnerConfig
    from learners.protocol import build_learner

    engine = SGLangEngine("m", tmp_path, EngineConfig(dtype="auto"), tmp_path)
    with pytest.raises(ValueError, match="dtype='auto'.*resolve_dtype"):
        engine.start()
    with pytest.raises(ValueError, match="dtype='auto'.*resolve_dtype"):
        build_learner(LearnerConfig(dtype="auto"), "m", str(tmp_path), str(tmp_path))


def test_the_torch_learner_takes_fp32_under_auto(tmp_path):
    from runtime.controller import resolve_dtypes

    config = tmp_path / "c.yaml"
    config.write_text("workflow: {name: signal_game, agents: {sender: a, receiver: b}}\n"
                      "models: {a: {path: tiny, learner: {backend: torch}}, b: {path: tiny}}\n")
    cfg = load_config(config)
    resolve_dtypes(cfg)
    assert cfg.models["a"].learner.dtype == "float32"  # no fp32 main weights in that backend
    assert cfg.models["b"].learner.dtype == cfg.models["b"].engine.dtype  # megatron: the machine's
