"""Builds the Java game-server client (clients/java/build.sh, from protos/ with Debian's jars)
and runs its example plugin against a stack started here: SQLite, free ports, a known token.

    python scripts/java_client_check.py            # what `make java-client` runs
    python scripts/java_client_check.py --keep     # keep the stack's folder (logs) afterwards

Every check the example prints must pass, and the ones this stack can do must all be there:
the example exits non-zero on a failed check, and this script fails on a missing one too.
When the gateway has the public-port TLS settings (`public_tls_cert_file`), the example runs a
second time over TLS with a throwaway CA made here, and once more trusting another CA, which
must fail with a clear TLS error. When the engine has the failure key
`system.error.tool_output_invalid`, the malformed tool answer must be refused with it.
When docs/game-tools.json exists, the Java tools must match it (tools only modules of an
optional feature require, which the example does not install, such as FTB Quests', excepted).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make the repository importable
    sys.path.insert(0, str(ROOT))

__all__ = [
    "BUILD_DIR",
    "CheckFailed",
    "JavaMissing",
    "TlsFiles",
    "build",
    "catalogue_mismatches",
    "expected_checks",
    "gateway_tls_env",
    "make_tls_files",
    "output_validation_landed",
    "run_example",
]

JAVA_DIR = ROOT / "clients" / "java"
BUILD_DIR = JAVA_DIR / "build"
CATALOGUE = ROOT / "docs" / "game-tools.json"
SERVER_ID = "java-example"
TOKEN = "java-example-token-0123456789"  # a known token for a throwaway stack
OUTPUT_INVALID = "system.error.tool_output_invalid"

_BASE_CHECKS = (
    "backoff-grows",
    "welcome",
    "no-tool-problems",
    "chat-help",
    "chat-bangzhu",
    "console-admin-command",
    "admin-command-refused-for-player",
    "chat-inventory",
    "chat-profile",
    "chat-item",
    "chat-signin",
    "chat-mail",
    "tool-call-on-game-thread",
    "button-press",
    "event-item-give",
    "event-notice",
    "inventory-after-give",
    "item-give-call-id",
    "frame-error-not-found",
    "busy-game-thread-times-out",
    "reconnect",
    "rejoined-after-reconnect",
    "console-rejoined-after-reconnect",
    "replaced-not-reconnecting",
    "tools-only-on-game-thread",
)


class JavaMissing(RuntimeError):
    """javac, protoc, the grpc-java plugin or a jar is not installed (build.sh exit 3)."""


class CheckFailed(AssertionError):
    """The Java example did not do what the contract says."""


def build() -> str:
    """Runs clients/java/build.sh and returns the example's classpath.

    Raises:
        JavaMissing: a tool or jar is missing.
        CheckFailed: the build failed.
    """
    if shutil.which("bash") is None:
        raise JavaMissing("bash is not installed")
    done = subprocess.run(
        ["bash", str(JAVA_DIR / "build.sh")], capture_output=True, text=True, timeout=600
    )
    if done.returncode == 3:
        raise JavaMissing(done.stderr.strip())
    if done.returncode != 0:
        raise CheckFailed(f"clients/java/build.sh failed:\n{done.stdout}\n{done.stderr}")
    print(done.stdout.strip())
    return (BUILD_DIR / "classpath").read_text().strip()


def output_validation_landed() -> bool:
    """True when the engine's failure catalogue has `system.error.tool_output_invalid`."""
    from services.results import AgentFailure

    return any(member.value == OUTPUT_INVALID for member in AgentFailure)


def gateway_tls_env() -> tuple[str, str] | None:
    """The env names of the gateway's public TLS certificate and key settings, or None while
    the gateway has no such settings."""
    from services.gateway.config import ENV_PREFIX, GatewayConfig

    names = {f.name for f in dataclasses.fields(GatewayConfig)}
    if {"public_tls_cert_file", "public_tls_key_file"} <= names:
        return f"{ENV_PREFIX}PUBLIC_TLS_CERT_FILE", f"{ENV_PREFIX}PUBLIC_TLS_KEY_FILE"
    return None


@dataclasses.dataclass(frozen=True)
class TlsFiles:
    """A throwaway CA and a server certificate it issued for localhost and 127.0.0.1."""

    ca: Path
    cert: Path
    key: Path


def make_tls_files(folder: Path, name: str = "ca") -> TlsFiles:
    """Makes a CA and a server certificate (services.runtime.pki, the `cryptography` package)."""
    from services.runtime.pki import Authority

    authority = Authority(folder / name, name=f"throwaway {name}")
    issued = authority.issue("localhost")
    return TlsFiles(authority.ca_file, issued.cert_file, issued.key_file)


def expected_checks(require_validation: bool) -> list[str]:
    """The CHECK names the example must print as ok."""
    checks = list(_BASE_CHECKS)
    if require_validation:
        checks.append("malformed-tool-output-refused")
    return checks


def java_command(classpath: str, *args: str) -> list[str]:
    java = shutil.which("java") or "java"
    return [java, "-cp", classpath, "dev.system.example.ExamplePlugin", *args]


def run_example(
    classpath: str,
    target: str,
    *args: str,
    timeout: float = 300.0,
    server_id: str = SERVER_ID,
    token: str = TOKEN,
) -> subprocess.CompletedProcess[str]:
    """Runs the example plugin; the token travels in the environment, not on the command line."""
    env = {**os.environ, "SYSTEM_GAME_SERVER_TOKEN": token}
    return subprocess.run(
        java_command(classpath, "--address", target, "--server-id", server_id, *args),
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def check_session(done: subprocess.CompletedProcess[str], require_validation: bool) -> list[str]:
    """Problems with an example session's result (empty when it did everything expected)."""
    problems = []
    passed = set(re.findall(r"^CHECK ok (\S+)$", done.stdout, re.M))
    failed = re.findall(r"^CHECK FAIL .*$", done.stdout, re.M)
    problems += failed
    missing = [c for c in expected_checks(require_validation) if c not in passed]
    if missing:
        problems.append(f"checks missing from the output: {', '.join(missing)}")
    if done.returncode != 0:
        problems.append(f"the example exited with {done.returncode}")
    if not re.search(r"^RESULT ok ", done.stdout, re.M):
        problems.append("no `RESULT ok` line")
    return problems


def example_tools(classpath: str) -> list[dict[str, Any]]:
    """The tools the Java example declares in its hello."""
    done = subprocess.run(
        java_command(classpath, "--print-tools"), capture_output=True, text=True, timeout=60
    )
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("TOOLS ")), None)
    if done.returncode != 0 or line is None:
        raise CheckFailed(f"--print-tools failed: {done.stdout}\n{done.stderr}")
    return json.loads(line.removeprefix("TOOLS "))


_ANNOTATIONS = frozenset({"description", "title", "examples", "$comment"})
_NAMED = frozenset({"properties", "patternProperties", "$defs", "definitions"})


def _validation_keywords(schema: Any, named: bool = False) -> Any:
    """A schema without its annotations (they do not change what validates). `named`: the
    dict maps property names to schemas (`properties`), so its keys are kept."""
    if isinstance(schema, list):
        return [_validation_keywords(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if named:
            out[key] = _validation_keywords(value)
        elif key in _ANNOTATIONS:
            continue
        elif key in ("enum", "const", "default"):
            out[key] = value  # values, not schemas
        else:
            out[key] = _validation_keywords(value, key in _NAMED)
    return out


def _catalogue_entries(catalogue: Any) -> list[dict[str, Any]]:
    if isinstance(catalogue, dict):
        catalogue = catalogue.get("tools", catalogue)
    if isinstance(catalogue, dict):
        return [{"name": name, **entry} for name, entry in catalogue.items()]
    return list(catalogue)


def _field(entry: dict[str, Any], *names: str) -> Any:
    for name in names:
        if name in entry:
            return entry[name]
    return None


def _for_other_features(entry: dict[str, Any], features: tuple[str, ...]) -> bool:
    """True when every module requiring the tool belongs to an optional feature not in
    `features`: a game server without that feature (the example has no FTB Quests) need not
    offer the tool, as the gateway's hello check says too."""
    needs = [n for n in entry.get("needed_by") or () if isinstance(n, dict) and n.get("required")]
    installed = ("", "system:core", *features)
    return bool(needs) and all(n.get("owner_feature", "") not in installed for n in needs)


def catalogue_mismatches(
    tools: list[dict[str, Any]], catalogue: Any, features: tuple[str, ...] = ()
) -> list[str]:
    """Where the Java tools differ from the game-tool catalogue: missing tools, schemas or
    flags that differ (schemas compared as JSON values, not text), call ids not honoured
    where the catalogue says they are. `features` are those the Java world's hello lists
    (none for the example)."""
    problems = []
    declared = {t["name"]: t for t in tools}
    for entry in _catalogue_entries(catalogue):
        name = _field(entry, "name", "tool", "tool_id")
        tool = declared.get(name)
        if tool is None:
            if _for_other_features(entry, features):
                continue
            problems.append(f"{name}: documented in the catalogue, not offered by the Java world")
            continue
        for ours, theirs in (
            ("input_schema", ("input_schema", "inputSchema")),
            ("output_schema", ("output_schema", "outputSchema")),
        ):
            documented = _field(entry, *theirs)
            if isinstance(documented, str):
                documented = json.loads(documented)
            declared_schema = _validation_keywords(json.loads(tool[ours] or "null"))
            if documented is not None and declared_schema != _validation_keywords(documented):
                problems.append(
                    f"{name}: {ours} differs from the catalogue:\n  java:      {tool[ours]}\n"
                    f"  catalogue: {json.dumps(documented, sort_keys=True)}"
                )
        for flag, names in (
            ("read_only", ("read_only", "readOnly")),
            ("idempotent", ("idempotent",)),
            ("event_allowed", ("event_allowed", "eventAllowed")),
        ):
            documented = _field(entry, *names)
            if documented is None and isinstance(entry.get("flags"), dict):
                documented = _field(entry["flags"], *names)
            if documented is not None and bool(documented) != tool[flag]:
                problems.append(f"{name}: {flag} is {tool[flag]}, the catalogue says {documented}")
        # As the gateway's hello check: where the catalogue says a tool honours call ids the
        # world must too (the engine retries interrupted calls of it); saying so elsewhere is
        # a harmless promise.
        if _field(entry, "honours_call_id", "honoursCallId") and not tool.get("honours_call_id"):
            problems.append(f"{name}: honours_call_id is False, the catalogue says True")
    return problems


def _print_output(title: str, done: subprocess.CompletedProcess[str]) -> None:
    print(f"--- {title} (exit {done.returncode})")
    print(done.stdout.rstrip())
    if done.stderr.strip():
        print("--- stderr")
        print(done.stderr.rstrip()[-4000:])


def _stack(folder: Path, gateway_env: dict[str, str], ca: Path | None):  # type: ignore[no-untyped-def]
    """A stack whose gateway gets `gateway_env`; with `ca`, the gateway's public port speaks
    TLS, so its health is checked there over TLS trusting `ca`."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from services.stack import Stack

    class TlsGatewayStack(Stack):
        def health(self, name: str, timeout: float = 1.0) -> str:
            if ca is None or name != "gateway":
                return super().health(name, timeout)
            credentials = grpc.ssl_channel_credentials(ca.read_bytes())
            with grpc.secure_channel(self.target("gateway"), credentials) as channel:
                try:
                    response = health_pb2_grpc.HealthStub(channel).Check(
                        health_pb2.HealthCheckRequest(
                            service=self.processes[name].spec.health_name
                        ),
                        timeout=timeout,
                    )
                except grpc.RpcError:
                    return "UNREACHABLE"
            return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    return TlsGatewayStack(
        folder, server_id=SERVER_ID, token=TOKEN, service_env={"gateway": gateway_env}
    )


def _session(
    classpath: str,
    folder: Path,
    title: str,
    runs: list[tuple[str, tuple[str, ...], bool]],
    gateway_env: dict[str, str] | None = None,
    ca: Path | None = None,
) -> list[str]:
    """Starts a stack, runs the example against it once per run (name, arguments, whether it
    must fail with a clear TLS error), stops the stack; returns the problems found."""
    stack = _stack(folder, gateway_env or {}, ca)
    started = stack.start(timeout=90)
    print(f"=== {title}: stack up in {started:.1f} s, gateway at {stack.target('gateway')}")
    require = output_validation_landed()
    problems = []
    try:
        for name, args, expect_tls_failure in runs:
            done = run_example(classpath, stack.target("gateway"), *args)
            _print_output(name, done)
            if expect_tls_failure:
                if not _clear_tls_failure(done):
                    problems.append(f"{name}: no clear TLS failure")
                continue
            problems += [f"{name}: {p}" for p in check_session(done, require)]
            if not require:
                print(
                    f"note: services/results.py has no {OUTPUT_INVALID} yet; the malformed "
                    "answer is printed above, not required to be refused"
                )
    finally:
        codes = stack.stop()
        if any(code not in (0, None) for code in codes.values()):
            print(f"note: stack exit codes {codes}")
    return problems


def _clear_tls_failure(done: subprocess.CompletedProcess[str]) -> bool:
    text = done.stdout + done.stderr
    return done.returncode != 0 and "CHECK FAIL welcome" in done.stdout and "TLS handshake" in text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", action="store_true", help="keep the stacks' folders (logs)")
    parser.add_argument(
        "--no-build", action="store_true", help="use the last build of clients/java/build.sh"
    )
    options = parser.parse_args(argv)
    built = BUILD_DIR / "classpath"
    if options.no_build and built.exists():
        classpath = built.read_text().strip()
    else:
        try:
            classpath = build()
        except JavaMissing as exc:
            print(f"java-client: cannot build: {exc}", file=sys.stderr)
            return 3
    problems: list[str] = []
    if CATALOGUE.exists():
        mismatches = catalogue_mismatches(
            example_tools(classpath), json.loads(CATALOGUE.read_text())
        )
        print(f"catalogue {CATALOGUE.relative_to(ROOT)}: {len(mismatches)} mismatches")
        problems += [f"catalogue: {m}" for m in mismatches]
    else:
        print(f"note: {CATALOGUE.relative_to(ROOT)} does not exist yet; tools not compared")
    folder = Path(tempfile.mkdtemp(prefix="java-client-"))
    started = time.monotonic()
    try:
        problems += _session(
            classpath, folder / "plaintext", "plaintext", [("plaintext", (), False)]
        )
        tls_env = gateway_tls_env()
        if tls_env is None:
            print("note: the gateway has no public_tls_cert_file setting yet; TLS not run")
        else:
            tls = make_tls_files(folder / "pki", "ca")
            other = make_tls_files(folder / "pki", "other-ca")
            env = {tls_env[0]: str(tls.cert), tls_env[1]: str(tls.key)}
            runs = [
                ("tls", ("--tls-ca", str(tls.ca)), False),
                ("tls-wrong-ca", ("--tls-ca", str(other.ca)), True),
            ]
            problems += _session(classpath, folder / "tls", "tls", runs, env, tls.ca)
    finally:
        if options.keep:
            print(f"stack folders kept in {folder}")
        else:
            shutil.rmtree(folder, ignore_errors=True)
    took = time.monotonic() - started
    if problems:
        print(f"java-client: FAILED after {took:.0f} s:")
        for problem in problems:
            print(f"  - {problem}")
        return 1
    print(f"java-client: ok ({took:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
