"""Built-in modules, all owned by the core feature."""

from engine_service.modules.help import HelpModule
from engine_service.modules.history import HistoryModule
from engine_service.modules.inventory import InventoryModule
from engine_service.modules.rewards import AdvancementRewardModule

__all__ = [
    "BUILTIN_MODULES",
    "SMALL_TALK",
    "AdvancementRewardModule",
    "HelpModule",
    "HistoryModule",
    "InventoryModule",
]

BUILTIN_MODULES = (HelpModule, HistoryModule, InventoryModule, AdvancementRewardModule)
"""Classes of the modules every engine registers, in help order."""

SMALL_TALK = {
    "zh": ("你好", "谢谢", "哈哈", "今天天气怎么样", "你是谁", "晚安", "好无聊啊"),
    "en": ("hello", "thanks", "lol", "how are you", "who are you", "good night", "i'm bored"),
}
"""Examples of the reject profile `system:small_talk`: chatter that resembles no module and
must widen margins rather than route anywhere."""
