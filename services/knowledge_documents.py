"""Knowledge documents from files (Markdown or plain text): what the operator's knowledge tool
(`storage_service.knowledge_cli`) and the administrators' in-game `/system knowledge-add` both
read, so a file becomes the same entry whichever adds it.

A file's first line `# Title` is the entry's title (else the file's name); the rest is its
body. Its language is `zh` when CJK characters make up a fair share of its letters, else
`en`, unless given. No gRPC calls here; `put_request` only builds the message both send.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from system.storage.v1 import knowledge_pb2

from services.runtime.errors import InvalidArgument

__all__ = ["SUFFIXES", "FileEntry", "detect_language", "put_request", "read_entry"]

SUFFIXES = (".md", ".markdown", ".txt")
"""The kinds of file a knowledge entry is read from."""
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


def put_request(entry: FileEntry, player_id: str) -> knowledge_pb2.PutKnowledgeRequest:
    """Storage's PutKnowledge request for `entry` in `player_id`'s table (empty: shared)."""
    return knowledge_pb2.PutKnowledgeRequest(
        entry=knowledge_pb2.KnowledgeEntry(
            player_id=player_id,
            entry_id=entry.entry_id,
            title=entry.title,
            body=entry.body,
            language=entry.language,
            source=entry.source,
        )
    )
