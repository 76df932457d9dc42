"""`python -m services.stack [--say TEXT] [--offline-model]`: the whole stack plus a simulated
game server.

Without --say it opens a prompt where you chat as the player Steve. Lines starting with `:`
are the simulator's own commands (`:help` lists them); everything else is sent as chat.

With --offline-model (`make run MODEL=offline`) the launcher also runs the local
OpenAI-compatible test server in-process, with a generated key, and points the model gateway at
it. Its replies are scripted for a demo: a routing request picks the catalogue module whose id
word appears in the text ("show my history" -> system:history), otherwise `clarify`; any other
completion echoes the last user message. See `services.model_testserver.router_demo_reply`.

The simulated server has FTB Quests installed (its hello offers the `ftbquests` feature and the
quest tools); with --without-ftbquests it has not, and quests appear nowhere.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import re
import secrets
import sys
import threading
from pathlib import Path

from system.common.v1 import common_pb2
from system.gateway.v1 import gateway_pb2

from services.gamesim import GameServerClient, render_response
from services.gamesim.client import FrameRefused, GatewayRefused
from services.gamesim.world import World
from services.model_testserver import FakeOpenAIServer, router_demo_reply
from services.stack.launcher import ROOT, SERVICES, Stack, StackError

PLAYER_ID = "00000000-0000-4000-8000-000000000001"
PLAYER_NAME = "Steve"
OTHER_ID = "00000000-0000-4000-8000-000000000002"
OTHER_NAME = "Alex"
"""A player the simulated server knows, offline now (the sender of Steve's iron mail), so that
`/pay Alex 100`, the usage's own example, pays someone."""
CJK = re.compile(r"[\u3400-\u9fff]")
SIM_HELP = """simulator commands:
  :press N        press button N of the last card (the one on screen: typing a phrase that
                  clearly names one of its buttons, 领取 or next page, presses it too)
  :lang zh|en     switch Steve's client language
  :op [LEVEL]     make Steve an operator (permission level 4, or LEVEL 0-4): /help then lists
                  the administrators' commands (routing diagnostics, knowledge, players)
  :deop           make Steve a player again (level 0)
  :state          ask for the assistant state
  :history        show the stored conversation
  :clear          delete the stored conversation
  :advance ID     Steve earns an advancement (say minecraft:story/mine_diamond); the reward
                  its rule in engine_service/advancements.json names comes as an event task
  :quit           stop everything (Ctrl-C and Ctrl-D do too)
anything else is sent as chat, for example: 帮助, help, /help history, /pay Alex 10 (Alex is a
player this server knows, offline now)"""


OPERATOR_LEVEL = 4
"""Minecraft's operator level, which `:op` gives Steve unless told another."""


@dataclasses.dataclass
class _Seat:
    """What the simulated game server says of Steve: his client language and his permission
    level, sent together whenever either changes (a presence update carries both)."""

    language: str
    permission_level: int = 0


ADVANCE_WAIT_SECONDS = 5.0
"""How long `:advance` waits for the reward task's notice."""


def _language(text: str | None, requested: str) -> str:
    if requested != "auto":
        return requested
    return "zh_cn" if text and CJK.search(text) else "en_us"


async def _say(
    client: GameServerClient, text: str, viewing: common_pb2.Card | None = None
) -> gateway_pb2.PlayerResponse:
    """Sends `text` as Steve's chat; `viewing`: the card on screen, whose buttons a phrase that
    clearly names one presses (`领取` at a quest's card), as a client that shows cards does."""
    response = await client.chat(PLAYER_ID, text, viewing=viewing)
    print(render_response(response), flush=True)
    return response


def _stdin_lines(
    loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[str | None], ready: threading.Event
) -> None:
    """Reads stdin on a daemon thread, so Ctrl-C never waits for Enter. The prompt appears
    only once the previous line's answer is printed (`ready`)."""
    while True:
        ready.wait()
        ready.clear()
        try:
            line = input(f"{PLAYER_NAME}> ")
        except (EOFError, KeyboardInterrupt):
            loop.call_soon_threadsafe(queue.put_nowait, None)
            return
        loop.call_soon_threadsafe(queue.put_nowait, line)


async def _interactive(client: GameServerClient, seat: _Seat) -> None:
    print(
        f"Connected as {PLAYER_NAME}. Type 帮助 or help; :help for simulator commands.", flush=True
    )
    queue: asyncio.Queue[str | None] = asyncio.Queue()
    ready = threading.Event()
    ready.set()
    threading.Thread(
        target=_stdin_lines, args=(asyncio.get_running_loop(), queue, ready), daemon=True
    ).start()
    last: gateway_pb2.PlayerResponse | None = None
    while (line := await queue.get()) is not None:
        try:
            last = await _handle_line(client, line.strip(), last, seat)
        except _Quit:
            return  # no prompt after :quit
        except FrameRefused as exc:
            print(f"(refused: {exc})")
        ready.set()


async def _advance(client: GameServerClient, advancement: str) -> None:
    """Reports an advancement as the game would, then shows how the reward task ended: the
    engine tells the player with a notice once the task's outcome is stored."""
    if not advancement:
        print("(which one? for example :advance minecraft:story/mine_diamond)")
        return
    while not client.notices.empty():  # anything that came meanwhile, first
        print(render_response(client.notices.get_nowait()))
    await client.event(
        PLAYER_ID,
        "minecraft:advancement",
        f"advancement:{advancement}",
        {"advancement": advancement},
    )
    try:
        notice = await asyncio.wait_for(client.notices.get(), ADVANCE_WAIT_SECONDS)
    except TimeoutError:
        if client.frame_errors:
            print(f"(refused: {client.frame_errors.pop().message})")
        else:
            print(
                "(no reward task ended: earned before, no advancement rule gives one, "
                "or the engine is busy; try again)"
            )
        return
    print(render_response(notice))


class _Quit(Exception):
    pass


_CONTROLS = {
    ":state": gateway_pb2.CONTROL_ACTION_STATE,
    ":history": gateway_pb2.CONTROL_ACTION_HISTORY,
    ":clear": gateway_pb2.CONTROL_ACTION_CLEAR_HISTORY,
}


async def _handle_line(
    client: GameServerClient, line: str, last: gateway_pb2.PlayerResponse | None, seat: _Seat
) -> gateway_pb2.PlayerResponse | None:
    """Acts on one typed line; returns the response whose card `:press` refers to next."""
    if not line:
        return last
    if line in (":quit", ":q", ":exit"):
        raise _Quit
    if line == ":help":
        print(SIM_HELP)
    elif line.startswith(":lang"):
        seat.language = "zh_cn" if line.endswith("zh") else "en_us"
        await client.update(PLAYER_ID, seat.language, seat.permission_level)
        print(f"(language is now {seat.language})")
    elif line.split()[0] in (":op", ":deop"):
        level = line.removeprefix(":op").strip() if line.startswith(":op") else "0"
        if level and not (level.isdigit() and 0 <= int(level) <= OPERATOR_LEVEL):
            print(f"(a permission level is 0 to {OPERATOR_LEVEL}, for example :op 3)")
            return last
        seat.permission_level = int(level) if level else OPERATOR_LEVEL
        await client.update(PLAYER_ID, seat.language, seat.permission_level)
        print(
            f"({PLAYER_NAME}'s permission level is now {seat.permission_level}; "
            "/help lists what it allows)"
        )
    elif line in _CONTROLS:
        print(render_response(await client.control(PLAYER_ID, _CONTROLS[line])))
    elif line.startswith(":advance"):
        await _advance(client, line.removeprefix(":advance").strip())
    elif line.startswith(":press"):
        card = _card_of(last)
        index = line.removeprefix(":press").strip()
        if card is None or not index.isdigit() or not 1 <= int(index) <= len(card.buttons):
            print("(no such button on the last card)")
            return last
        last = await client.press(PLAYER_ID, card, card.buttons[int(index) - 1])
        print(render_response(last))
    elif line.startswith(":"):
        print("(unknown simulator command; :help lists them)")
    else:
        last = await _say(client, line, _card_of(last))
    return last


def _card_of(response: gateway_pb2.PlayerResponse | None) -> common_pb2.Card | None:
    """The card of the last answer: the one on screen, which `:press` and typing refer to."""
    if response is None or not response.HasField("reply"):
        return None
    card = response.reply.result.card
    return card if card.ref.card_id else None


async def _play(stack: Stack, say: str | None, language: str, ftbquests: bool = True) -> int:
    # The simulated server has FTB Quests installed unless told otherwise.
    world = World() if ftbquests else World(features=())
    world.join(OTHER_ID, OTHER_NAME)
    world.leave(OTHER_ID)
    client = GameServerClient(stack.target("gateway"), stack.server_id, stack.token, world)
    try:
        await client.connect()
    except GatewayRefused as exc:
        print(f"the gateway refused the simulated game server: {exc}", file=sys.stderr)
        return 1
    seat = _Seat(_language(say, language))
    try:
        await client.join(PLAYER_ID, PLAYER_NAME, seat.language)
        if say is not None:
            response = await _say(client, say)
            return 0 if response.WhichOneof("body") else 1
        await _interactive(client, seat)
        return 0
    finally:
        await client.close()


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="make run", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--say", help="send one chat message, print the reply, stop and exit")
    parser.add_argument("--data", default=str(ROOT / "data"), help="data folder (default: ./data)")
    parser.add_argument("--language", default="auto", help="client language: auto, zh_cn or en_us")
    parser.add_argument(
        "--free-ports", action="store_true", help="use free ports instead of 50051-50055"
    )
    parser.add_argument(
        "--without-ftbquests",
        action="store_true",
        help="simulate a game server without FTB Quests (no quests, no quest commands)",
    )
    parser.add_argument(
        "--offline-model",
        action="store_true",
        help="run a local scripted OpenAI-compatible model and point the model gateway at it",
    )
    args = parser.parse_args()
    fake: FakeOpenAIServer | None = None
    service_env: dict[str, dict[str, str]] = {}
    if args.offline_model:
        key = secrets.token_urlsafe(24)
        fake = FakeOpenAIServer(key, responder=router_demo_reply)
        fake.start()
        service_env["model"] = {
            "SYSTEM_MODEL_BASE_URL": fake.base_url,
            "SYSTEM_MODEL_API_KEY": key,
            "SYSTEM_MODEL_API_KEY_FILE": "",  # a file from the caller's environment would clash
            # The same server answers web searches (SearXNG's JSON) with pages of its own.
            "SYSTEM_MODEL_SEARCH_URL": fake.root_url,
            "SYSTEM_MODEL_FETCH_ALLOW_LOOPBACK": "true",
        }
        print(f"offline scripted model at {fake.base_url}", file=sys.stderr, flush=True)
    try:
        return _run(args, service_env)
    finally:
        if fake is not None:
            fake.stop()


def _run(args: argparse.Namespace, service_env: dict[str, dict[str, str]]) -> int:
    stack = Stack(Path(args.data), fixed_ports=not args.free_ports, service_env=service_env)
    print(
        "starting storage, model gateway, engine, router and gateway ...",
        file=sys.stderr,
        flush=True,
    )
    try:
        seconds = stack.start()
    except StackError as exc:
        print(f"the stack did not start: {exc}", file=sys.stderr)
        return 1
    ports = ", ".join(f"{s.name} {stack.target(s.name)}" for s in SERVICES)
    ports += f" (relay {stack.target('gateway_internal')}; internal ports need a credential)"
    print(
        f"stack ready in {seconds:.2f} s ({ports}); logs in {stack.data_dir / 'logs'}",
        file=sys.stderr,
        flush=True,
    )
    code = 1
    try:
        code = asyncio.run(_play(stack, args.say, args.language, not args.without_ftbquests))
    except KeyboardInterrupt:
        code = 0
    finally:
        print("stopping ...", file=sys.stderr, flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            stack.stop()
    return code


if __name__ == "__main__":
    sys.exit(main())
