"""Generates the Python stubs in gen/ from protos/, or checks that gen/ is current.

    python scripts/gen_protos.py           # (re)generate gen/
    python scripts/gen_protos.py --check   # exit 1, listing files, when gen/ is stale

The stubs are build output (gen/ is not committed); `make` regenerates them whenever a proto
changes, and the check catches a gen/ left behind by an edit that skipped the build.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"
GEN = ROOT / "gen"
STAMP = ".generated"  # written by make, not by protoc


def proto_files() -> list[Path]:
    return sorted(PROTOS.rglob("*.proto"))


def generate(out: Path) -> None:
    """Runs protoc from grpcio-tools over every proto into `out`."""
    import grpc_tools
    from grpc_tools import protoc

    include = Path(grpc_tools.__file__).parent / "_proto"
    # mypy-protobuf's plugin writes typed stubs (*_pb2_grpc.pyi) for the gRPC modules, which
    # grpcio-tools leaves untyped; it is installed beside this interpreter (the dev extra).
    plugin = Path(sys.executable).parent / "protoc-gen-mypy_grpc"
    if not plugin.exists():
        found = shutil.which("protoc-gen-mypy_grpc")
        if found is None:
            raise SystemExit(
                "protoc-gen-mypy_grpc not found; install the dev extra (mypy-protobuf)"
            )
        plugin = Path(found)
    out.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{PROTOS}",
        f"-I{include}",
        f"--plugin=protoc-gen-mypy_grpc={plugin}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        f"--mypy_grpc_out=quiet:{out}",
        *[str(p.relative_to(PROTOS)) for p in proto_files()],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed; see the messages above")


def stale_files(current: Path, fresh: Path) -> list[str]:
    """Files that differ between two generated trees, missing or extra included."""
    mine = (
        {p.relative_to(current) for p in current.rglob("*") if p.is_file() and p.name != STAMP}
        if current.exists()
        else set()
    )
    theirs = {p.relative_to(fresh) for p in fresh.rglob("*") if p.is_file()}
    differ = [str(p) for p in sorted(mine ^ theirs)]
    differ += [
        str(p)
        for p in sorted(mine & theirs)
        if not filecmp.cmp(current / p, fresh / p, shallow=False)
    ]
    return differ


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="only check that gen/ is current")
    args = parser.parse_args()
    if args.check:
        with tempfile.TemporaryDirectory() as tmp:
            generate(Path(tmp))
            differ = stale_files(GEN, Path(tmp))
        if differ:
            print("gen/ is stale; run `make protos`. Differing files:", *differ, sep="\n  ")
            return 1
        print(f"gen/ is current ({len(proto_files())} protos)")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        if stale_files(GEN, Path(tmp)):
            shutil.rmtree(GEN, ignore_errors=True)
            shutil.copytree(tmp, GEN)
            # copytree copies the temporary directory's 0700 mode onto gen/; give it the usual
            # umask-based mode so other users (the image's non-root user) can import the stubs.
            umask = os.umask(0)
            os.umask(umask)
            GEN.chmod(0o777 & ~umask)
    print(f"generated stubs for {len(proto_files())} protos in {GEN.relative_to(ROOT)}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
