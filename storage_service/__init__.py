"""The storage service: sole owner of the database (conversation history and preferences in
this first cut; event tasks, receipts, module data and knowledge join it later)."""
