#!/usr/bin/env bash
# Generates the Python code for the Lattice hook contract into ./gen (or $1).
# The .proto files are the contract; nothing generated is committed.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${1:-$here/gen}"
proto="$here/../../../proto"
mkdir -p "$out"
python3 -m grpc_tools.protoc -I "$proto" --python_out="$out" --grpc_python_out="$out" \
  lattice/agent/v1/content.proto lattice/hooks/v1/hooks.proto
echo "generated into $out"
