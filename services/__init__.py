"""Shared server plumbing, the gateway, the model gateway and the simulated game server."""
