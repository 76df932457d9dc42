"""Contract tests: the protos follow the buf / googleapis style rules in STYLE.md.

The checkers are pure functions from descriptors to a list of violations (one readable line
each), so they are tested twice: on the real protos, where they must find nothing, and on small
deliberately bad protos, where they must find exactly what is wrong.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import grpc
import grpc_tools
import pytest
from google.protobuf import descriptor_pb2
from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"
# `relay` is the gateway's internal package, kept apart from `gateway`, the plugins' contract.
SERVICES = ("common", "gateway", "relay", "router", "engine", "model", "storage")

# SourceCodeInfo path components (field numbers in descriptor.proto).
FILE_MESSAGE, FILE_ENUM, FILE_SERVICE = 4, 5, 6
MESSAGE_FIELD, MESSAGE_NESTED, MESSAGE_ENUM, MESSAGE_ONEOF = 2, 3, 4, 8
ENUM_VALUE, SERVICE_METHOD = 2, 2

UPPER_CAMEL = re.compile(r"^[A-Z][A-Za-z0-9]*$")
LOWER_SNAKE = re.compile(r"^[a-z][a-z0-9]*(_[a-z0-9]+)*$")
UPPER_SNAKE = re.compile(r"^[A-Z][A-Z0-9]*(_[A-Z0-9]+)*$")
PACKAGE = re.compile(r"^system\.([a-z][a-z0-9_]*)\.v[1-9][0-9]*$")
STATUS_NAMES = sorted(code.name for code in grpc.StatusCode if code is not grpc.StatusCode.OK)
ERRORS_DOCUMENTED = re.compile(
    r"\bErrors\b|none beyond transport errors|\b(" + "|".join(STATUS_NAMES) + r")\b", re.IGNORECASE
)


# --- building descriptors ---------------------------------------------------------------------


def build_descriptor_set(
    root: Path, out: Path, files: Iterable[str] | None = None
) -> descriptor_pb2.FileDescriptorSet:
    """Compiles the protos under `root` with source info and returns their FileDescriptorSet."""
    names = (
        sorted(files) if files else sorted(str(p.relative_to(root)) for p in root.rglob("*.proto"))
    )
    include = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{root}",
        f"-I{include}",
        "--include_source_info",
        f"--descriptor_set_out={out}",
        *names,
    ]
    assert protoc.main(args) == 0, f"protoc failed on {names}"
    fds = descriptor_pb2.FileDescriptorSet()
    fds.ParseFromString(out.read_bytes())
    return fds


# --- pure checkers ----------------------------------------------------------------------------


def upper_snake(name: str) -> str:
    """`RoutingMode` -> `ROUTING_MODE`, `HTTPStatus` -> `HTTP_STATUS`."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).upper()


def _comments(fd: descriptor_pb2.FileDescriptorProto) -> dict[tuple[int, ...], str]:
    return {tuple(loc.path): loc.leading_comments.strip() for loc in fd.source_code_info.location}


def check_package(fd: descriptor_pb2.FileDescriptorProto) -> list[str]:
    """Package is `system.<name>.v<N>` and matches the file's folder; java_package is set."""
    problems = []
    match = PACKAGE.match(fd.package)
    if not match:
        problems.append(f"{fd.name}: package {fd.package!r} is not system.<name>.v<N>")
    folder = str(Path(fd.name).parent).replace("\\", "/")
    if folder != fd.package.replace(".", "/"):
        problems.append(f"{fd.name}: package {fd.package!r} does not match its folder {folder!r}")
    if not fd.options.java_package:
        problems.append(f"{fd.name}: option java_package is not set")
    return problems


def check_package_set(fds: descriptor_pb2.FileDescriptorSet, services: Iterable[str]) -> list[str]:
    """Exactly one package per service, `system.<service>.v1`, and no others."""
    found = {fd.package for fd in fds.file}
    wanted = {f"system.{name}.v1" for name in services}
    problems = [f"package {p} is missing" for p in sorted(wanted - found)]
    problems += [f"package {p} belongs to no known service" for p in sorted(found - wanted)]
    return problems


def _check_enum(
    fd: descriptor_pb2.FileDescriptorProto,
    enum: descriptor_pb2.EnumDescriptorProto,
    scope: str,
    path: tuple[int, ...],
    comments: dict[tuple[int, ...], str],
) -> list[str]:
    full = f"{scope}.{enum.name}"
    problems = []
    if not UPPER_CAMEL.match(enum.name):
        problems.append(f"{fd.name}: enum {full} is not UpperCamelCase")
    if not comments.get(path):
        problems.append(f"{fd.name}: enum {full} has no leading comment")
    prefix = upper_snake(enum.name) + "_"
    zero = [v.name for v in enum.value if v.number == 0]
    if zero != [prefix + "UNSPECIFIED"]:
        problems.append(f"{fd.name}: enum {full} zero value is {zero}, not {prefix}UNSPECIFIED")
    for j, value in enumerate(enum.value):
        if not value.name.startswith(prefix) or not UPPER_SNAKE.match(value.name):
            problems.append(f"{fd.name}: enum value {full}.{value.name} is not {prefix}UPPER_SNAKE")
        if not comments.get((*path, ENUM_VALUE, j)):
            problems.append(f"{fd.name}: enum value {full}.{value.name} has no leading comment")
    return problems


def _check_message(
    fd: descriptor_pb2.FileDescriptorProto,
    message: descriptor_pb2.DescriptorProto,
    scope: str,
    path: tuple[int, ...],
    comments: dict[tuple[int, ...], str],
) -> list[str]:
    full = f"{scope}.{message.name}"
    problems = []
    if not UPPER_CAMEL.match(message.name):
        problems.append(f"{fd.name}: message {full} is not UpperCamelCase")
    if not comments.get(path):
        problems.append(f"{fd.name}: message {full} has no leading comment")
    for j, field in enumerate(message.field):
        if not LOWER_SNAKE.match(field.name):
            problems.append(f"{fd.name}: field {full}.{field.name} is not lower_snake_case")
        if not comments.get((*path, MESSAGE_FIELD, j)):
            problems.append(f"{fd.name}: field {full}.{field.name} has no leading comment")
    for j, oneof in enumerate(message.oneof_decl):
        # proto3 `optional` makes a synthetic oneof that the author never wrote.
        synthetic = any(
            f.proto3_optional and f.HasField("oneof_index") and f.oneof_index == j
            for f in message.field
        )
        if synthetic:
            continue
        if not LOWER_SNAKE.match(oneof.name):
            problems.append(f"{fd.name}: oneof {full}.{oneof.name} is not lower_snake_case")
        if not comments.get((*path, MESSAGE_ONEOF, j)):
            problems.append(f"{fd.name}: oneof {full}.{oneof.name} has no leading comment")
    for j, nested in enumerate(message.nested_type):
        if nested.options.map_entry:  # generated for `map<,>` fields; not written by hand
            continue
        problems += _check_message(fd, nested, full, (*path, MESSAGE_NESTED, j), comments)
    for j, enum in enumerate(message.enum_type):
        problems += _check_enum(fd, enum, full, (*path, MESSAGE_ENUM, j), comments)
    return problems


def check_file(fd: descriptor_pb2.FileDescriptorProto) -> list[str]:
    """Every per-file rule: package, names, enums, RPC shapes and comments."""
    comments = _comments(fd)
    scope = fd.package
    problems = check_package(fd)
    for i, message in enumerate(fd.message_type):
        problems += _check_message(fd, message, scope, (FILE_MESSAGE, i), comments)
    for i, enum in enumerate(fd.enum_type):
        problems += _check_enum(fd, enum, scope, (FILE_ENUM, i), comments)
    for i, service in enumerate(fd.service):
        full = f"{scope}.{service.name}"
        if not UPPER_CAMEL.match(service.name) or not service.name.endswith("Service"):
            problems.append(f"{fd.name}: service {full} is not UpperCamelCase ending in Service")
        if not comments.get((FILE_SERVICE, i)):
            problems.append(f"{fd.name}: service {full} has no leading comment")
        for j, method in enumerate(service.method):
            rpc = f"{full}.{method.name}"
            if not UPPER_CAMEL.match(method.name):
                problems.append(f"{fd.name}: rpc {rpc} is not UpperCamelCase")
            if method.input_type != f".{scope}.{method.name}Request":
                problems.append(
                    f"{fd.name}: rpc {rpc} takes {method.input_type}, not {method.name}Request"
                )
            if method.output_type != f".{scope}.{method.name}Response":
                problems.append(
                    f"{fd.name}: rpc {rpc} returns {method.output_type}, not {method.name}Response"
                )
            comment = comments.get((FILE_SERVICE, i, SERVICE_METHOD, j), "")
            if not comment:
                problems.append(f"{fd.name}: rpc {rpc} has no leading comment")
            elif not ERRORS_DOCUMENTED.search(comment):
                problems.append(f"{fd.name}: rpc {rpc} comment names no status codes")
    return problems


def check_shared_messages(fds: descriptor_pb2.FileDescriptorSet) -> list[str]:
    """No message is the request or response of more than one RPC."""
    uses: Counter[str] = Counter()
    users: dict[str, list[str]] = {}
    for fd in fds.file:
        for service in fd.service:
            for method in service.method:
                rpc = f"{fd.package}.{service.name}.{method.name}"
                for type_name in {method.input_type, method.output_type}:
                    uses[type_name] += 1
                    users.setdefault(type_name, []).append(rpc)
    return [
        f"message {name.lstrip('.')} is shared by {', '.join(users[name])}"
        for name, count in sorted(uses.items())
        if count > 1
    ]


def check_all(
    fds: descriptor_pb2.FileDescriptorSet, services: Iterable[str] = SERVICES
) -> list[str]:
    problems = check_package_set(fds, services) + check_shared_messages(fds)
    for fd in fds.file:
        problems += check_file(fd)
    return problems


# --- the real protos --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_protos(tmp_path_factory: pytest.TempPathFactory) -> descriptor_pb2.FileDescriptorSet:
    return build_descriptor_set(PROTOS, tmp_path_factory.mktemp("fds") / "system.pb")


def test_real_protos_compile_with_source_info(
    real_protos: descriptor_pb2.FileDescriptorSet,
) -> None:
    names = {fd.name for fd in real_protos.file}
    assert names == {str(p.relative_to(PROTOS)) for p in PROTOS.rglob("*.proto")}
    assert all(fd.source_code_info.location for fd in real_protos.file)
    assert any(fd.service for fd in real_protos.file)


def test_real_protos_have_one_package_per_service(
    real_protos: descriptor_pb2.FileDescriptorSet,
) -> None:
    assert check_package_set(real_protos, SERVICES) == []
    for fd in real_protos.file:
        assert check_package(fd) == []


def test_plugin_contract_holds_only_the_game_server_service(
    real_protos: descriptor_pb2.FileDescriptorSet,
) -> None:
    """system.gateway.v1 is what plugin authors generate: no internal service may live there."""
    services = [
        s.name for fd in real_protos.file if fd.package == "system.gateway.v1" for s in fd.service
    ]
    assert services == ["GameGatewayService"]


def test_real_protos_share_no_request_or_response(
    real_protos: descriptor_pb2.FileDescriptorSet,
) -> None:
    assert check_shared_messages(real_protos) == []


@pytest.mark.parametrize(
    "name", sorted(str(p.relative_to(PROTOS)) for p in PROTOS.rglob("*.proto"))
)
def test_real_proto_follows_style(real_protos: descriptor_pb2.FileDescriptorSet, name: str) -> None:
    (fd,) = [fd for fd in real_protos.file if fd.name == name]
    problems = check_file(fd)
    assert problems == [], "\n".join(problems)


# --- the checkers catch bad protos ------------------------------------------------------------

GOOD = """\
syntax = "proto3";

// A good contract.
package system.good.v1;

option java_package = "dev.system.good.v1";

// Does things.
service ThingService {
  // Gets a thing.
  //
  // Errors:
  //   NOT_FOUND  no such thing.
  rpc GetThing(GetThingRequest) returns (GetThingResponse);
  // Watches things; none beyond transport errors.
  rpc WatchThings(stream WatchThingsRequest) returns (stream WatchThingsResponse);
}

// Colour of a thing.
enum ThingColour {
  // Not set.
  THING_COLOUR_UNSPECIFIED = 0;
  // Red.
  THING_COLOUR_RED = 1;
}

// Request for GetThing.
message GetThingRequest {
  // Which thing.
  string thing_id = 1;
  // Labels.
  map<string, string> labels = 2;
  // Maybe a number.
  optional int32 count = 3;
}

// Response for GetThing.
message GetThingResponse {
  // What it holds.
  oneof body {
    // A colour.
    ThingColour colour = 1;
    // A name.
    string name = 2;
  }
  // A nested part.
  message Part {
    // Its size.
    Size size = 1;
    // Size of a part.
    enum Size {
      // Not set.
      SIZE_UNSPECIFIED = 0;
      // Big.
      SIZE_BIG = 1;
    }
  }
}

// Request for WatchThings.
message WatchThingsRequest {}

// Response for WatchThings.
message WatchThingsResponse {}
"""


def _compile(tmp_path: Path, files: dict[str, str]) -> descriptor_pb2.FileDescriptorSet:
    root = tmp_path / "protos"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return build_descriptor_set(root, tmp_path / "out.pb", files)


def _problems(tmp_path: Path, text: str, name: str = "system/good/v1/good.proto") -> list[str]:
    fds = _compile(tmp_path, {name: text})
    return check_shared_messages(fds) + check_file(fds.file[0])


def test_good_snippet_passes(tmp_path: Path) -> None:
    assert _problems(tmp_path, GOOD) == []


def test_upper_snake() -> None:
    assert upper_snake("RoutingMode") == "ROUTING_MODE"
    assert upper_snake("HTTPStatus") == "HTTP_STATUS"
    assert upper_snake("Size") == "SIZE"


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        (
            "THING_COLOUR_UNSPECIFIED = 0",
            "THING_COLOUR_NONE = 0",
            "zero value is ['THING_COLOUR_NONE']",
        ),
        ("THING_COLOUR_RED = 1", "RED = 1", "enum value system.good.v1.ThingColour.RED is not"),
        ("SIZE_UNSPECIFIED = 0", "PART_SIZE_UNSPECIFIED = 0", "Part.Size zero value"),
        (
            "  // Which thing.\n",
            "",
            "field system.good.v1.GetThingRequest.thing_id has no leading comment",
        ),
        (
            "  // What it holds.\n",
            "",
            "oneof system.good.v1.GetThingResponse.body has no leading comment",
        ),
        (
            "    // Its size.\n",
            "",
            "field system.good.v1.GetThingResponse.Part.size has no leading",
        ),
        (
            "    // Size of a part.\n",
            "",
            "enum system.good.v1.GetThingResponse.Part.Size has no leading",
        ),
        (
            "      // Big.\n",
            "",
            "enum value system.good.v1.GetThingResponse.Part.Size.SIZE_BIG has no",
        ),
        (
            "  // A nested part.\n",
            "",
            "message system.good.v1.GetThingResponse.Part has no leading",
        ),
        ("// Colour of a thing.\n", "", "enum system.good.v1.ThingColour has no leading comment"),
        ("  // Red.\n", "", "enum value system.good.v1.ThingColour.THING_COLOUR_RED has no"),
        ("// Request for GetThing.\n", "", "message system.good.v1.GetThingRequest has no leading"),
        ("// Does things.\n", "", "service system.good.v1.ThingService has no leading comment"),
        (
            "  // Gets a thing.\n  //\n  // Errors:\n  //   NOT_FOUND  no such thing.\n",
            "",
            "rpc system.good.v1.ThingService.GetThing has no leading comment",
        ),
        (
            "  // Errors:\n  //   NOT_FOUND  no such thing.\n",
            "",
            "rpc system.good.v1.ThingService.GetThing comment names no status codes",
        ),
        (
            "string thing_id",
            "string thingId",
            "field system.good.v1.GetThingRequest.thingId is not lower",
        ),
        ("oneof body", "oneof Body", "oneof system.good.v1.GetThingResponse.Body is not lower"),
        (
            "service ThingService",
            "service Things",
            "service system.good.v1.Things is not UpperCamelCase",
        ),
        (
            "enum ThingColour",
            "enum thing_colour",
            "enum system.good.v1.thing_colour is not UpperCamelCase",
        ),
        ('option java_package = "dev.system.good.v1";\n', "", "java_package is not set"),
        (
            "rpc GetThing(GetThingRequest) returns (GetThingResponse)",
            "rpc GetThing(GetThingRequest) returns (WatchThingsResponse)",
            "rpc system.good.v1.ThingService.GetThing returns .system.good.v1.WatchThingsResponse",
        ),
        (
            "rpc WatchThings(stream WatchThingsRequest)",
            "rpc WatchThings(stream GetThingRequest)",
            "message system.good.v1.GetThingRequest is shared by",
        ),
    ],
)
def test_bad_snippet_is_reported(tmp_path: Path, old: str, new: str, expected: str) -> None:
    assert old in GOOD
    text = GOOD.replace(old, new)
    if "thing_colour" in new:
        text = text.replace("ThingColour colour", "thing_colour colour")
    problems = _problems(tmp_path, text)
    assert any(expected in p for p in problems), problems


def test_message_names_must_be_upper_camel(tmp_path: Path) -> None:
    text = GOOD.replace(
        "message WatchThingsResponse {}",
        "message WatchThingsResponse {}\n// Bad.\nmessage bad_name {}",
    )
    assert _problems(tmp_path, text) == [
        "system/good/v1/good.proto: message system.good.v1.bad_name is not UpperCamelCase"
    ]


def test_shared_request_between_services_is_reported(tmp_path: Path) -> None:
    other = (
        'syntax = "proto3";\n// Other.\npackage system.other.v1;\nimport "system/good/v1/good.proto";\n'
        'option java_package = "dev.system.other.v1";\n// Other things.\nservice OtherService {\n'
        "  // Gets. Errors: NOT_FOUND.\n"
        "  rpc GetThing(system.good.v1.GetThingRequest) returns (system.good.v1.GetThingResponse);\n}\n"
    )
    fds = _compile(
        tmp_path, {"system/good/v1/good.proto": GOOD, "system/other/v1/other.proto": other}
    )
    shared = check_shared_messages(fds)
    assert any("GetThingRequest is shared by" in p for p in shared), shared
    assert any(
        "takes .system.good.v1.GetThingRequest, not GetThingRequest" in p
        for p in check_file(fds.file[1])
    )


def test_package_rules_are_reported(tmp_path: Path) -> None:
    moved = _problems(tmp_path, GOOD, name="system/elsewhere/v1/good.proto")
    assert any("does not match its folder 'system/elsewhere/v1'" in p for p in moved), moved
    unversioned = GOOD.replace("package system.good.v1;", "package system.good;")
    problems = _problems(tmp_path / "u", unversioned, name="system/good/good.proto")
    assert any("is not system.<name>.v<N>" in p for p in problems), problems


def test_package_set_is_reported(tmp_path: Path) -> None:
    fds = _compile(tmp_path, {"system/good/v1/good.proto": GOOD})
    assert check_package_set(fds, ["good"]) == []
    problems = check_package_set(fds, ["good", "router"])
    assert problems == ["package system.router.v1 is missing"]
    assert check_package_set(fds, []) == ["package system.good.v1 belongs to no known service"]


# --- generated stubs --------------------------------------------------------------------------


def _gen(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(root / "scripts" / "gen_protos.py"), *args],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_gen_check_passes_on_repo() -> None:
    result = _gen(ROOT, "--check")
    assert result.returncode == 0, result.stdout + result.stderr


def test_gen_check_fails_when_stale(tmp_path: Path) -> None:
    shutil.copytree(PROTOS, tmp_path / "protos")
    shutil.copytree(
        ROOT / "scripts", tmp_path / "scripts", ignore=shutil.ignore_patterns("__pycache__")
    )
    missing = _gen(tmp_path, "--check")
    assert missing.returncode == 1, missing.stdout + missing.stderr
    generated = _gen(tmp_path)
    assert generated.returncode == 0, generated.stdout + generated.stderr
    assert (tmp_path / "gen" / "system" / "router" / "v1" / "router_pb2.py").exists()
    # gen/ gets the same mode as the folders protoc made, not the private temp dir's 0700.
    gen_mode = (tmp_path / "gen").stat().st_mode & 0o777
    assert gen_mode == (tmp_path / "gen" / "system").stat().st_mode & 0o777, oct(gen_mode)
    current = _gen(tmp_path, "--check")
    assert current.returncode == 0, current.stdout + current.stderr

    # RPC comments become docstrings in the *_pb2_grpc.py stubs, so this edit makes gen/ stale.
    router = tmp_path / "protos" / "system" / "router" / "v1" / "router.proto"
    text = router.read_text()
    assert "// Routes one text for one player." in text
    router.write_text(text.replace("// Routes one text for one player.", "// Routes one text."))
    stale = _gen(tmp_path, "--check")
    assert stale.returncode == 1, stale.stdout + stale.stderr
    assert "router_pb2_grpc.py" in stale.stdout
