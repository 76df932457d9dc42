"""The engine: runs module workflows under budgets. Owns the module registry, no business data."""
