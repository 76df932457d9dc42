"""A simulated game server: connects to the gateway like a real plugin would, joins players,
sends their requests, answers game-tool calls from a small in-memory world and renders cards
as text. `make run` uses it to let a person chat as a player; tests use it as the client."""

from services.gamesim.client import GameServerClient, GatewayRefused
from services.gamesim.render import render_response

__all__ = ["GameServerClient", "GatewayRefused", "render_response"]
