"""Built-in modules, all owned by the core feature."""

from engine_service.modules.help import HelpModule
from engine_service.modules.history import HistoryModule

__all__ = ["BUILTIN_MODULES", "HelpModule", "HistoryModule"]

BUILTIN_MODULES = (HelpModule, HistoryModule)
"""Classes of the modules every engine registers, in help order."""
