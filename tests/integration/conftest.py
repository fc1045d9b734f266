"""Shared fixtures of the integration tier: a real SGLang server on the tiny model.

One server serves the whole session (startup is ~25 s on 2 cores, and the machine fits only
one at a time). Tests that change its weights or kill it leave it serving and healthy; a test
that needs known weights reads `tiny_engine.weights_path` instead of assuming the originals.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import ray

from actors.engines.sglang import EngineConfig, SGLangEngine
from runtime.models import provision_tiny

_HERE = Path(__file__).resolve().parent


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "integration: needs real servers (tests/integration)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Every test in this directory is an integration test; `-m "not integration"` skips them.
    for item in items:
        if _HERE in Path(item.fspath).resolve().parents:
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    """The tiny random Llama folder (provisioned once into the model cache)."""
    return provision_tiny()


@pytest.fixture(scope="session")
def tiny_engine(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory):
    """A running fp32 CPU SGLang server on the tiny model, stopped after the session."""
    cfg = EngineConfig(max_total_tokens=4096, random_seed=0, startup_timeout_s=300)
    engine = SGLangEngine("tiny", tiny_model_path, cfg, tmp_path_factory.mktemp("engine-logs"))
    engine.start()
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray instance for tests that wire actors by hand (reused if one is up)."""
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()

