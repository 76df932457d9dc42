#!/usr/bin/env bash
# Builds the Java game-server client from protos/ with Debian's packages only (no Maven):
#   protoc + the grpc-java plugin generate the stubs of system.gateway.v1 and system.common.v1,
#   javac compiles them with the library and the example against the jars in /usr/share/java.
#
#   clients/java/build.sh            # -> clients/java/build/{gen,classes,classpath}
#
# Needs: protobuf-compiler libprotobuf-dev protobuf-compiler-grpc-java-plugin libgrpc-java
#        libprotobuf-java libnetty-java libperfmark-java libgeronimo-annotation-1.3-spec-java
#        default-jdk-headless
# Run the example afterwards with: java -cp "$(cat clients/java/build/classpath)" \
#        dev.system.example.ExamplePlugin --help
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
OUT="${JAVA_CLIENT_BUILD:-$HERE/build}"
JARS="${JAVA_JARS:-/usr/share/java}"
PROTO_INCLUDE="${PROTO_INCLUDE:-/usr/include}"
PLUGIN="$(command -v protoc-gen-grpc-java || command -v grpc_java_plugin || true)"

missing=()
for tool in protoc javac java; do
  command -v "$tool" >/dev/null || missing+=("$tool")
done
[ -n "$PLUGIN" ] || missing+=("grpc_java_plugin (protobuf-compiler-grpc-java-plugin)")
[ -f "$PROTO_INCLUDE/google/protobuf/struct.proto" ] || missing+=("$PROTO_INCLUDE/google/protobuf/struct.proto (libprotobuf-dev)")

# What grpc-netty needs at run time, as Debian names the jars.
NAMES=(
  grpc-api grpc-context grpc-core grpc-netty grpc-protobuf grpc-protobuf-lite grpc-stub
  protobuf guava perfmark-api geronimo-annotation-1.3-spec
  netty-buffer netty-codec netty-codec-http netty-codec-http2 netty-codec-socks netty-common
  netty-handler netty-handler-proxy netty-resolver netty-transport
  netty-transport-native-unix-common
)
CP=()
for name in "${NAMES[@]}"; do
  if [ -f "$JARS/$name.jar" ]; then CP+=("$JARS/$name.jar"); else missing+=("$JARS/$name.jar"); fi
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "build.sh: missing: ${missing[*]}" >&2
  echo "install: apt-get install -y --no-install-recommends protobuf-compiler libprotobuf-dev" \
    "protobuf-compiler-grpc-java-plugin libgrpc-java libprotobuf-java libnetty-java" \
    "libperfmark-java libgeronimo-annotation-1.3-spec-java default-jdk-headless" >&2
  exit 3
fi
CLASSPATH_JARS="$(IFS=:; echo "${CP[*]}")"

rm -rf "$OUT/gen" "$OUT/classes"
mkdir -p "$OUT/gen" "$OUT/classes"
cd "$ROOT"
protoc -I protos -I "$PROTO_INCLUDE" \
  --plugin=protoc-gen-grpc-java="$PLUGIN" \
  --java_out="$OUT/gen" --grpc-java_out="$OUT/gen" \
  protos/system/gateway/v1/gateway.proto protos/system/common/v1/*.proto

find "$OUT/gen" "$HERE/src/main/java" -name '*.java' > "$OUT/sources.txt"
javac --release 17 -encoding UTF-8 -nowarn -Xlint:-options -d "$OUT/classes" \
  -cp "$CLASSPATH_JARS" @"$OUT/sources.txt"
echo "$OUT/classes:$CLASSPATH_JARS" > "$OUT/classpath"
echo "built $(grep -c . "$OUT/sources.txt") Java sources into $OUT/classes"
