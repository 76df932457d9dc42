"""Knowledge entries from files (Markdown or plain text), and the starter set about the
assistant itself that a new installation's shared table starts with, so `/question` answers
out of the box.

A file's first line `# Title` is the entry's title (else the file's name); the rest is its
body. Its language is `zh` when CJK characters make up a fair share of its letters, else
`en`, unless given. Starter files are named `<topic>.<language>.md`; their entry ids are
`system:<topic>.<language>`.

Domain code: no gRPC here.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path

from services.runtime.errors import InvalidArgument
from storage_service.knowledge import KnowledgeStore

__all__ = ["STARTER_DIR", "STARTER_SOURCE", "FileEntry", "read_entry", "seed_starter", "starter"]

log = logging.getLogger("system.storage.knowledge")

STARTER_DIR = Path(__file__).with_name("starter_knowledge")
STARTER_SOURCE = "system:starter"
"""The source the starter entries show."""
SUFFIXES = (".md", ".markdown", ".txt")
_CJK = re.compile(r"[\u3400-\u9fff\uf900-\ufaff]")
_LETTER = re.compile(r"[^\W\d_]")


@dataclasses.dataclass(frozen=True)
class FileEntry:
    """A knowledge entry read from a file, before it is stored."""

    entry_id: str
    title: str
    body: str
    language: str
    source: str


def detect_language(text: str) -> str:
    """`zh` when at least a fifth of the letters are CJK characters, else `en`."""
    letters = _LETTER.findall(text)
    cjk = _CJK.findall(text)
    return "zh" if letters and len(cjk) * 5 >= len(letters) else "en"


def read_entry(path: Path, entry_id: str = "", language: str = "", source: str = "") -> FileEntry:
    """The entry a Markdown or plain-text file holds. Raises InvalidArgument for a file of
    another kind, one that is not UTF-8 or has no body."""
    if path.suffix.lower() not in SUFFIXES:
        raise InvalidArgument(
            f"{path}: knowledge files are Markdown or plain text ({', '.join(SUFFIXES)})"
        )
    try:
        text = path.read_text(encoding="utf-8").strip()
    except UnicodeDecodeError:
        raise InvalidArgument(f"{path}: not UTF-8 text") from None
    lines = text.splitlines()
    title = path.stem
    if lines and lines[0].startswith("# "):
        title, lines = lines[0][2:].strip(), lines[1:]
    body = "\n".join(lines).strip()
    if not body:
        raise InvalidArgument(f"{path}: the file has no body below its title")
    return FileEntry(
        entry_id=entry_id or path.stem,
        title=title,
        body=body,
        language=language or detect_language(body),
        source=source or path.name,
    )


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
