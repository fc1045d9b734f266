"""The workflow registry: a workflow module registers its class and its own config dataclass.

    @register("mathchat", MathChatConfig)
    class MathChat: ...

Every module of this package is imported once (`discover`), so adding a workflow touches only
its own module, its configs and its tests (DESIGN §14). A workflow's settings live under
`workflow.params` in the run config and are validated against its dataclass here, with errors
that name `workflow.params.<field>`.
"""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Any, Callable

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

_NOT_WORKFLOWS = {"base", "registry", "tools"}  # helpers, not workflows


@dataclass(frozen=True)
class Entry:
    """A registered workflow: its class (built from one config instance) and that config's type."""

    name: str
    cls: type
    config_cls: type


REGISTRY: dict[str, Entry] = {}
_discovered = False


def register(name: str, config_cls: type) -> Callable[[type], type]:
    """Class decorator: make `cls` the workflow called `name`, configured by `config_cls`."""

    def decorate(cls: type) -> type:
        known = REGISTRY.get(name)
        if known is not None and known.cls.__qualname__ != cls.__qualname__:
            raise ValueError(f"workflow {name!r} is registered twice ({known.cls.__module__} and "
                             f"{cls.__module__}); rename one")
        REGISTRY[name] = Entry(name, cls, config_cls)
        return cls

    return decorate


def discover() -> dict[str, Entry]:
    """Import every workflow module of this package once; returns the registry."""
    global _discovered
    if not _discovered:
        package = importlib.import_module("actors.workflows")
        for module in pkgutil.iter_modules(package.__path__):
            if module.name not in _NOT_WORKFLOWS and not module.name.startswith("_"):
                importlib.import_module(f"actors.workflows.{module.name}")
        _discovered = True
    return REGISTRY


def workflow_names() -> list[str]:
    return sorted(discover())


def entry(name: str) -> Entry:
    registry = discover()
    if name not in registry:
        raise ValueError(f"workflow.name={name!r} is unknown; choose one of {sorted(registry)}")
    return registry[name]


def make_settings(name: str, params: dict[str, Any]) -> Any:
    """`workflow.params` validated into the workflow's own config dataclass."""
    config_cls = entry(name).config_cls
    try:
        merged = OmegaConf.merge(OmegaConf.structured(config_cls), params or {})
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        raise ValueError(f"workflow.params of {name}: {exc}".replace("\n", " ")) from None
