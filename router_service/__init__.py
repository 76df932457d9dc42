"""The router: decides which module a player's text means. It never executes modules."""
