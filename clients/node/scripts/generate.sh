#!/bin/sh
# Generate the TypeScript message types and grpc-js service clients from the
# repository's protos/ into src/gen/ (build output: git-ignored, never edited).
#
# ts-proto writes its own encoders (by field number), so no field can be lost
# to a name mismatch; fromJSON reads both the JSON (camelCase) and the proto
# (snake_case) spelling of every field; unrecognizedEnum=false makes an
# unknown enum name an error instead of a silent 0 (or UNRECOGNIZED = -1);
# forceLong=bigint keeps 64-bit seeds exact (the server's are 63-bit).
set -eu
here=$(cd "$(dirname "$0")/.." && pwd)
protos="$here/../../protos"
out="$here/src/gen"
if [ ! -f "$protos/google/rpc/status.proto" ]; then
  echo "protos/google/rpc/status.proto is missing (it is committed: a partial checkout?)" >&2
  exit 1
fi
command -v protoc >/dev/null || { echo "protoc is not installed (make system-deps)" >&2; exit 1; }
rm -rf "$out" && mkdir -p "$out"
protoc \
  --plugin=protoc-gen-ts_proto="$here/node_modules/.bin/protoc-gen-ts_proto" \
  --ts_proto_out="$out" \
  --ts_proto_opt=outputServices=grpc-js,env=node,esModuleInterop=true,forceLong=bigint,unrecognizedEnum=false,useDate=true \
  -I"$protos" \
  "$protos"/genai/v1/*.proto
