"""The starter set about the assistant itself that a new installation's shared knowledge table
starts with, so `/question` answers out of the box. Files become entries as
`services.knowledge_documents` reads them (re-exported here); starter files are named
`<topic>.<language>.md` and their entry ids are `system:<topic>.<language>`.

Domain code: no gRPC here.
"""

from __future__ import annotations

import logging
from pathlib import Path

from services.knowledge_documents import SUFFIXES, FileEntry, detect_language, read_entry
from storage_service.knowledge import KnowledgeStore

__all__ = [
    "STARTER_DIR",
    "STARTER_SOURCE",
    "SUFFIXES",
    "FileEntry",
    "detect_language",
    "read_entry",
    "seed_starter",
    "starter",
]

log = logging.getLogger("system.storage.knowledge")

STARTER_DIR = Path(__file__).with_name("starter_knowledge")
STARTER_SOURCE = "system:starter"
"""The source the starter entries show."""


def starter() -> list[FileEntry]:
    """The starter set: every `<topic>.<language>.md` under STARTER_DIR."""
    entries = []
    for path in sorted(STARTER_DIR.glob("*.md")):
        language = path.stem.rpartition(".")[2]
        entries.append(
            read_entry(path, f"system:{path.stem}", language=language, source=STARTER_SOURCE)
        )
    return entries


def seed_starter(store: KnowledgeStore) -> int:
    """Puts the starter set into the shared table when that table holds nothing at all (a new
    installation); returns how many entries were written. An operator's own entries, or a
    starter entry edited or kept, are never touched."""
    existing, _ = store.list_entries("", 1)
    if existing:
        return 0
    entries = starter()
    for entry in entries:
        store.put("", entry.entry_id, entry.title, entry.body, entry.language, entry.source)
    log.info("the shared knowledge table was empty: wrote the %d starter entries", len(entries))
    return len(entries)
