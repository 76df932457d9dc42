"""Card buttons that run a module: the one shape every module's buttons take."""

from __future__ import annotations

import json
from typing import Any

from system.common.v1 import common_pb2

__all__ = ["invoke"]


def invoke(
    module_id: str,
    label: str,
    data: dict[str, Any],
    *,
    press_only: bool = False,
    label_key: str = "",
) -> common_pb2.CardButton:
    """A button that runs `module_id` with `data` as its input.

    `press_only`: only a structured press of this very button reaches the module; the gateway
    leaves it out of the numbered list, so a typed number (`查看 1`) never presses it. Every
    button that writes is press_only. `label_key`: the kind of action its label names
    (`claim`, `confirm`: router_service/notification-buttons.json), so a player looking at the
    card may press it by typing `领取`.
    """
    args = {"module_id": module_id, "input": json.dumps(data, ensure_ascii=False)}
    if press_only:
        args["press_only"] = "true"
    return common_pb2.CardButton(action_id="invoke", label=label, args=args, label_key=label_key)
