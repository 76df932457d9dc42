"""Who may use a module. One rule, used by the engine (catalogue, help, execution) and the
router (candidates) alike, so a module a player may not use appears nowhere for them."""

from __future__ import annotations

from system.common.v1 import catalog_pb2, common_pb2

__all__ = ["CORE_FEATURE", "module_available"]

CORE_FEATURE = "system:core"
"""Feature of the built-in modules; always installed."""


def module_available(
    module: catalog_pb2.ModuleDescriptor, player: common_pb2.PlayerContext
) -> bool:
    """True when `player` may use `module`: permission level high enough, for modules of an
    optional feature that feature installed on the player's game server, and the module not
    among `player.unavailable_modules` (its game server lacks a game tool the module needs:
    the gateway's hello check)."""
    if player.permission_level < module.min_permission_level:
        return False
    if module.module_id in player.unavailable_modules:
        return False
    owner = module.owner_feature
    return not owner or owner == CORE_FEATURE or owner in player.features
