"""The operator's knowledge tool: add, list and remove knowledge entries (Markdown or plain
text; a player's private table or the shared one) through the storage service's
`KnowledgeService`, with the operator credential.

    python -m storage_service.knowledge_cli [--stack data | --target HOST:PORT --token T] \\
        add FILE... [--player ID] [--language zh|en] [--id ENTRY_ID]
    python -m storage_service.knowledge_cli ... list [--player ID]
    python -m storage_service.knowledge_cli ... remove ENTRY_ID [--player ID]
    python -m storage_service.knowledge_cli ... starter      # (re)write the starter set

`--stack DIR` reads the storage address and the operator token that `make run` writes to
`DIR/run/operator.json`; otherwise `--target` (or SYSTEM_STORAGE_TARGET) and `--token` (or
SYSTEM_OPERATOR_TOKEN). Exits 0 on success, 1 when storage refused (the reason printed),
2 on bad usage.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import grpc
from system.storage.v1 import knowledge_pb2, knowledge_pb2_grpc

from services.knowledge_documents import put_request
from services.runtime.channels import open_channel
from services.runtime.errors import InvalidArgument
from storage_service.knowledge_files import read_entry, starter

__all__ = ["main"]

TIMEOUT = 10.0


async def _run(args: argparse.Namespace, target: str, token: str) -> int:
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    async with open_channel(target) as channel:
        stub = knowledge_pb2_grpc.KnowledgeServiceStub(channel)
        scope = f"player {args.player}" if args.player else "the shared table"
        if args.command in ("add", "starter"):
            if args.command == "add":
                if args.id and len(args.files) > 1:
                    raise InvalidArgument("--id names one entry: give one file with it")
                entries = [read_entry(Path(f), args.id, args.language or "") for f in args.files]
            else:
                entries = starter()
            for entry in entries:
                answer = await stub.PutKnowledge(
                    put_request(entry, args.player), timeout=TIMEOUT, metadata=metadata
                )
                verb = "added" if answer.created else "replaced"
                print(f"{verb} {entry.entry_id} ({entry.language}) in {scope}: {entry.title}")
        elif args.command == "list":
            token_ = ""
            count = 0
            while True:
                page = await stub.ListKnowledge(
                    knowledge_pb2.ListKnowledgeRequest(player_id=args.player, page_token=token_),
                    timeout=TIMEOUT,
                    metadata=metadata,
                )
                for e in page.entries:
                    count += 1
                    print(f"{e.entry_id}\t{e.language}\t{e.title}\t{e.source}")
                token_ = page.next_page_token
                if not token_:
                    break
            print(f"{count} entries in {scope}", file=sys.stderr)
        else:  # remove
            await stub.DeleteKnowledge(
                knowledge_pb2.DeleteKnowledgeRequest(player_id=args.player, entry_id=args.entry),
                timeout=TIMEOUT,
                metadata=metadata,
            )
            print(f"removed {args.entry} from {scope}")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m storage_service.knowledge_cli",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--stack", type=Path, help="a `make run` data folder (default: none)")
    parser.add_argument("--target", default=os.environ.get("SYSTEM_STORAGE_TARGET", ""))
    parser.add_argument("--token", default=os.environ.get("SYSTEM_OPERATOR_TOKEN", ""))
    commands = parser.add_subparsers(dest="command", required=True)
    add = commands.add_parser("add", help="add or replace entries from files")
    add.add_argument("files", nargs="+")
    add.add_argument("--language", choices=("zh", "en"), help="default: detected")
    add.add_argument("--id", default="", help="entry id (one file only; default: file name)")
    listing = commands.add_parser("list", help="list one table's entries")
    remove = commands.add_parser("remove", help="remove one entry")
    remove.add_argument("entry")
    write = commands.add_parser("starter", help="write the starter set about the assistant")
    for sub in (add, listing, remove, write):
        sub.add_argument("--player", default="", help="a player's private table (default: shared)")
    return parser


def _address(args: argparse.Namespace) -> tuple[str, str]:
    """The storage target and operator token the arguments name."""
    if args.stack is not None:
        found = args.stack / "run" / "operator.json"
        try:
            data = json.loads(found.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise InvalidArgument(f"{found}: {exc}; is `make run` running there?") from None
        return str(data["storage_target"]), str(data["token"])
    if not args.target:
        raise InvalidArgument("name the storage service: --stack DIR or --target HOST:PORT")
    return args.target, args.token


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        target, token = _address(args)
        return asyncio.run(_run(args, target, token))
    except InvalidArgument as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    except grpc.aio.AioRpcError as exc:
        print(f"storage refused: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
