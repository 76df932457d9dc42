"""Built-in modules and the server tools they need.

The core modules (help, history, inventory, profile, item, inbox and mail claim, the
advancement reward) need nothing but the registry. The question, search and reasoning modules
need server tools whose handlers hold clients (`BuiltinServices`); `register_builtins`
registers tools and modules together, with `system:reasoning` last so it sees every other
module's read-only tools. The quest modules (quests.py) need nothing either; they belong to
the `ftbquests` feature, and their game tools (quest_tools.py) are registered here too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from engine_service.admin_tools import AdminTools
from engine_service.binding_tools import BindingNotifier, BindingTools, StorageBindings
from engine_service.knowledge_admin_tools import KnowledgeAdmin, KnowledgeAdminTools
from engine_service.knowledge_tools import KnowledgeSearch, KnowledgeTools
from engine_service.modules.admin import (
    BindingModule,
    FeatureModule,
    ReloadModule,
    RoutingModule,
    SpendModule,
    UsageModule,
)
from engine_service.modules.chat import ChatModule
from engine_service.modules.help import HelpModule
from engine_service.modules.history import HistoryModule
from engine_service.modules.inventory import InventoryModule
from engine_service.modules.item import ItemModule
from engine_service.modules.knowledge_admin import KnowledgeModule
from engine_service.modules.mail import InboxModule, MailClaimModule
from engine_service.modules.pay import PayConfirmModule, PayModule
from engine_service.modules.profile import ProfileModule
from engine_service.modules.question import QuestionModule
from engine_service.modules.quests import QuestClaimModule, QuestDetailModule, QuestsModule
from engine_service.modules.reasoning import ReasoningModule
from engine_service.modules.rewards import AdvancementRewardModule
from engine_service.modules.search import SearchModule
from engine_service.modules.settings import PreferenceTools, SettingsModule
from engine_service.modules.shop import ShopBuyModule, ShopConfirmModule, ShopModule
from engine_service.modules.signin import SigninModule
from engine_service.offers import OFFER_SECONDS, DocumentStore, OfferTools
from engine_service.quest_tools import QUEST_GAME_TOOLS
from engine_service.registry import Module, ModuleRegistry
from engine_service.signin_rewards import SigninRewards
from engine_service.usage_tools import UsageReader, UsageTools
from engine_service.web_tools import ExternalPreference, WebGate, WebTools

__all__ = [
    "BUILTIN_MODULES",
    "COMMERCE_MODULES",
    "QUEST_MODULES",
    "SMALL_TALK",
    "AdvancementRewardModule",
    "BuiltinServices",
    "HelpModule",
    "HistoryModule",
    "InboxModule",
    "InventoryModule",
    "ItemModule",
    "MailClaimModule",
    "PayConfirmModule",
    "PayModule",
    "ProfileModule",
    "QuestClaimModule",
    "QuestDetailModule",
    "QuestionModule",
    "QuestsModule",
    "ReasoningModule",
    "SettingsModule",
    "ChatModule",
    "SearchModule",
    "ShopBuyModule",
    "ShopConfirmModule",
    "ShopModule",
    "SigninModule",
    "register_builtins",
]

BUILTIN_MODULES = (
    HelpModule,
    HistoryModule,
    InventoryModule,
    ProfileModule,
    ItemModule,
    InboxModule,
    MailClaimModule,
    AdvancementRewardModule,
)
"""Classes of the core modules, which need no services, in help order."""

COMMERCE_MODULES = (ShopModule, ShopBuyModule, ShopConfirmModule, PayModule, PayConfirmModule)
"""Classes of the shop and payment modules, after the core ones in help order; they need the
offer and order tools (engine_service/offers.py)."""

QUEST_MODULES = (QuestsModule, QuestDetailModule, QuestClaimModule)
"""Classes of the quest modules (the `ftbquests` feature), after the core ones in help order."""

SMALL_TALK = {
    "zh": ("你好", "谢谢", "哈哈", "今天天气怎么样", "你是谁", "晚安", "好无聊啊"),
    "en": ("hello", "thanks", "lol", "how are you", "who are you", "good night", "i'm bored"),
}
"""Examples of the reject profile `system:small_talk`: chatter that resembles no module and
must widen margins rather than route anywhere."""


@dataclasses.dataclass(frozen=True)
class BuiltinServices:
    """What the built-in server tools reach. None means not configured: knowledge queries then
    fail as STORAGE_UNAVAILABLE and the web gate never opens (external services cannot be
    confirmed)."""

    knowledge: KnowledgeSearch | None = None
    """The knowledge search (storage's KnowledgeService)."""
    preferences: ExternalPreference | None = None
    """The players' external-services preference (storage's GetPreferences)."""
    signin_rewards: SigninRewards | None = None
    """The daily sign-in's reward catalogue; None: the shipped one."""
    documents: DocumentStore | None = None
    """Player documents and atomic batches (storage): the shop's quotes and orders."""
    offer_seconds: int = OFFER_SECONDS
    """How long an offer (a shop quote) may be confirmed."""
    admin: AdminTools | None = None
    """The admin commands' tools (the router's diagnostics and reload); None: no router."""
    usage: UsageReader | None = None
    """Players' usage per day (storage's PlayerDataService.GetUsage), for `/system usage`."""
    bindings: StorageBindings | None = None
    """Grants, revokes and resets (storage's PlayerDataService), for `/system revoke`..."""
    notifier: BindingNotifier | None = None
    """The relay that tells a player's gateway replica their binding changed."""
    knowledge_admin: KnowledgeAdmin | None = None
    """Knowledge entries written and listed (storage's KnowledgeService), for
    `/system knowledge-add`, `knowledge` and `knowledge-remove`."""
    knowledge_dir: str = ""
    """The folder `/system knowledge-add` reads documents from (`knowledge_dir`)."""


def register_builtins(
    registry: ModuleRegistry,
    services: BuiltinServices | None = None,
    extra: Iterable[Module] = (),
) -> None:
    """Registers the built-in server tools and modules, then `extra` (entry-point modules),
    then `system:reasoning` and `system:chat`, which offer the read-only tools of all of them."""
    services = services or BuiltinServices()
    gate = WebGate(services.preferences)
    KnowledgeTools(services.knowledge).register(registry.tools)
    WebTools(gate).register(registry.tools)
    for spec in QUEST_GAME_TOOLS:  # the ftbquests tools and the shared gift list
        registry.tools.game(spec)
    OfferTools(services.documents, services.offer_seconds).register(registry.tools)
    (services.admin or AdminTools(None)).register(registry.tools)
    for module_class in (*BUILTIN_MODULES, *COMMERCE_MODULES):
        registry.register(module_class())
    registry.register(SigninModule(services.signin_rewards))
    # These three run on the engine's whole ExecutionContext (the model, the live player),
    # more than the ModuleContext protocol declares to modules; the engine always gives one.
    registry.register(QuestionModule(gate))  # type: ignore[arg-type]
    registry.register(SearchModule(gate))  # type: ignore[arg-type]
    for quest_class in QUEST_MODULES:
        registry.register(quest_class())
    registry.register(RoutingModule())
    registry.register(ReloadModule())
    UsageTools(services.usage).register(registry.tools)
    registry.register(UsageModule())
    registry.register(SpendModule())
    BindingTools(services.bindings, services.notifier).register(registry.tools)
    for action in ("grant", "revoke", "reset"):
        registry.register(BindingModule(action))
    for granted in (True, False):
        registry.register(FeatureModule(granted))
    KnowledgeAdminTools(services.knowledge_admin, services.knowledge_dir).register(registry.tools)
    for knowledge_action in ("add", "list", "remove"):
        registry.register(KnowledgeModule(knowledge_action))
    PreferenceTools(services.preferences).register(registry.tools)
    registry.register(SettingsModule())
    for module in extra:
        registry.register(module)
    registry.register(ReasoningModule.over(registry))  # type: ignore[arg-type]
    registry.register(ChatModule.over(registry))  # type: ignore[arg-type]
