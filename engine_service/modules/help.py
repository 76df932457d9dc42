"""`system:help`: lists the modules this player may use, straight from the registry."""

from __future__ import annotations

from typing import Any

from system.common.v1 import catalog_pb2, common_pb2

from engine_service.modules.text import pick
from engine_service.registry import CommandSpec, Module, ModuleContext, ModuleSpec, SemanticSpec
from services.commands import usage
from services.results import AgentFailure, ModuleFailure, card, succeeded

__all__ = ["HelpModule"]

_TITLE = {"zh": "助手帮助", "en": "Assistant help"}
_INTRO = {
    "zh": "可以直接说出需求，也可以使用下面的指令：",
    "en": "Say what you need, or use one of these commands:",
}
_TOPIC_TITLE = {"zh": "指令 /{name}", "en": "Command /{name}"}
_ALIASES = {"zh": "别名：{aliases}", "en": "Aliases: {aliases}"}
_USAGE = {"zh": "用法：{usage}", "en": "Usage: {usage}"}
_UNKNOWN = {
    "zh": "没有名为 {topic} 的指令或模块。",
    "en": "There is no command or module named {topic}.",
}


def _usage(command: CommandSpec, language: str) -> str:
    return usage(command.aliases[0], command.descriptor(), language)


class HelpModule:
    """Lists modules and their commands, or explains one of them."""

    spec = ModuleSpec(
        module_id="system:help",
        description={
            "zh": "列出可用的指令和功能，或说明其中一个。",
            "en": "List the commands and features you can use, or explain one of them.",
        },
        input_schema={
            "type": "object",
            "properties": {"topic": {"type": "string", "maxLength": 64}},
            "additionalProperties": False,
        },
        commands=(
            CommandSpec(
                ("help", "帮助", "?"),
                argument="topic",
                argument_label={"zh": "主题", "en": "topic"},
            ),
        ),
        routing_mode=catalog_pb2.ROUTING_MODE_READ,
        semantic=SemanticSpec(
            examples={
                "zh": (
                    "帮助",
                    "查看帮助",
                    "打开帮助菜单",
                    "有哪些功能",
                    "你能做什么",
                    "怎么使用助手",
                    "列出所有指令",
                    "有什么命令可以用",
                    "使用说明",
                    "显示指令列表",
                    "助手怎么用",
                    "查看可用功能",
                ),
                "en": (
                    "help",
                    "show help",
                    "open the help menu",
                    "what can you do",
                    "list all commands",
                    "which commands can I use",
                    "how do I use the assistant",
                    "show available features",
                    "usage guide",
                    "show the command list",
                ),
            },
            choice_label="system.help.choice",
            shortcut=True,
        ),
    )

    async def run(self, data: dict[str, Any], ctx: ModuleContext) -> common_pb2.AgentResult:
        language = ctx.player.language
        # Event-only modules cannot be asked for; they have nothing to show in help.
        modules = [m for m in ctx.registry.available(ctx.player) if m.spec.interactive]
        topic = str(data.get("topic", "")).strip().lstrip("/")
        if topic:
            return self._explain(topic, modules, language)
        lines: list[str | tuple[str, str]] = [pick(_INTRO, language)]
        buttons = []
        for module in modules:
            description = pick(module.spec.description, language)
            if not module.spec.commands:
                if module.spec.routing_mode == catalog_pb2.ROUTING_MODE_STRUCTURED_ONLY:
                    continue  # only its buttons reach it (a purchase's confirm): nothing to type
                lines.append(f"{module.spec.module_id} — {description}")
                continue
            written = _usage(module.spec.commands[0], language)
            lines.append((f"{written} — {description}", f"/{module.spec.commands[0].aliases[0]}"))
            if (
                module.spec.module_id != self.spec.module_id
                and not module.spec.commands[0].argument_required
            ):
                buttons.append(
                    common_pb2.CardButton(
                        action_id="invoke",
                        label=f"/{module.spec.commands[0].aliases[0]}",
                        args={"module_id": module.spec.module_id},
                    )
                )
        return succeeded(card("system:help", pick(_TITLE, language), lines, buttons))

    def _explain(self, topic: str, modules: list[Module], language: str) -> common_pb2.AgentResult:
        key = topic.casefold()
        for module in modules:
            aliases = [a for c in module.spec.commands for a in c.aliases]
            if module.spec.module_id == topic or key in (a.casefold() for a in aliases):
                lines = [pick(module.spec.description, language)]
                lines += [
                    pick(_USAGE, language, usage=_usage(c, language)) for c in module.spec.commands
                ]
                if aliases:
                    lines.append(pick(_ALIASES, language, aliases=", ".join(aliases)))
                name = aliases[0] if aliases else module.spec.module_id
                return succeeded(
                    card("system:help", pick(_TOPIC_TITLE, language, name=name), lines)
                )
        raise ModuleFailure(AgentFailure.NOT_FOUND, pick(_UNKNOWN, language, topic=topic))
