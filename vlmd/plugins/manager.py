"""Discovering plugins from entry points and collecting their families."""

from __future__ import annotations

import pluggy

from vlmd.plugins import hookspecs
from vlmd.plugins.registry import FamilyRegistry

ENTRY_POINT_GROUP = "vlmd.model_families"


def plugin_manager(load_entry_points: bool = True) -> pluggy.PluginManager:
    manager = pluggy.PluginManager("vlmd")
    manager.add_hookspecs(hookspecs)
    if load_entry_points:
        manager.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
    return manager


def build_registry(manager: pluggy.PluginManager | None = None) -> FamilyRegistry:
    manager = manager or plugin_manager()
    registry = FamilyRegistry()
    manager.hook.vlmd_register_model_families(registry=registry)
    return registry


def tiny_builders(manager: pluggy.PluginManager | None = None) -> dict[str, str]:
    """family -> "module:function" of every installed plugin's tiny-checkpoint builder."""
    manager = manager or plugin_manager()
    builders: dict[str, str] = {}
    manager.hook.vlmd_register_tiny_builders(builders=builders)
    return builders


def converters(manager: pluggy.PluginManager | None = None) -> dict[str, str]:
    """format -> "module:function" of every installed plugin's checkpoint converter."""
    manager = manager or plugin_manager()
    found: dict[str, str] = {}
    manager.hook.vlmd_register_converters(converters=found)
    return found
