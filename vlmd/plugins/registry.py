"""Model families and the registry that maps HF architectures to them."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import structlog

log = structlog.get_logger(__name__)


def resolve(target: str | Any) -> Any:
    """Import ``"package.module:attr"``; pass objects through unchanged."""
    if not isinstance(target, str):
        return target
    module_name, _, attr = target.partition(":")
    if not attr:
        raise ValueError(f"expected 'module:attr', got {target!r}")
    return getattr(importlib.import_module(module_name), attr)


@dataclass(frozen=True)
class ModelFamily:
    """A processor / info / dummy-inputs triple plus the model class, for some architectures.

    Each of ``model``, ``processing_info``, ``processor`` and ``dummy_inputs`` is a class
    or a lazy ``"module:attr"`` string, so registering a family imports no torch.
    """

    name: str
    architectures: tuple[str, ...]
    model: str | type
    processing_info: str | type
    processor: str | type
    dummy_inputs: str | type

    def load(self, part: str) -> Any:
        return resolve(getattr(self, part))


class FamilyRegistry:
    def __init__(self) -> None:
        self._by_architecture: dict[str, ModelFamily] = {}

    def register(self, family: ModelFamily) -> None:
        if not family.architectures:
            raise ValueError(f"family {family.name!r} names no architectures")
        for architecture in family.architectures:
            previous = self._by_architecture.get(architecture)
            if previous is not None:
                log.warning(
                    "architecture registered twice; the later registration wins",
                    architecture=architecture,
                    previous=previous.name,
                    new=family.name,
                )
            self._by_architecture[architecture] = family

    def families(self) -> list[ModelFamily]:
        return list(dict.fromkeys(self._by_architecture.values()))

    def architectures(self) -> list[str]:
        return sorted(self._by_architecture)

    def for_architectures(self, architectures: list[str]) -> ModelFamily:
        for architecture in architectures:
            if architecture in self._by_architecture:
                return self._by_architecture[architecture]
        raise LookupError(
            f"no installed model family serves {architectures}; installed: {self.architectures() or 'none'}"
        )
