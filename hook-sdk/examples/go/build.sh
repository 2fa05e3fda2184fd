#!/usr/bin/env bash
# Builds the Go example hook into $1 (default ./redact-hook), from the .proto
# files and Debian's Go packages alone (no module download):
#   apt-get install golang-go golang-google-grpc-dev \
#     golang-github-golang-protobuf-1-5-dev golang-google-protobuf-dev \
#     protobuf-compiler protoc-gen-go protoc-gen-go-grpc
# The generated code goes into a throw-away GOPATH under the import path the
# protos name (go_package), next to Debian's /usr/share/gocode. With a Go
# module setup of your own, generate with the same protoc flags and
# `--go_opt=module=lattice.dev/proto` instead.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${1:-$here/redact-hook}"
proto="$here/../../../proto"
gopath="$(mktemp -d)"
trap 'rm -rf "$gopath"' EXIT
mkdir -p "$gopath/src"
protoc -I "$proto" --go_out="$gopath/src" --go-grpc_out="$gopath/src" \
  lattice/agent/v1/content.proto lattice/hooks/v1/hooks.proto
mkdir -p "$gopath/src/lattice.dev/examples/redact-hook"
cp "$here/main.go" "$gopath/src/lattice.dev/examples/redact-hook/"
cd "$gopath/src/lattice.dev/examples/redact-hook"
GOPATH="$gopath:/usr/share/gocode" GO111MODULE=off GOPROXY=off GOFLAGS= \
  go build -o "$out" .
echo "built $out"
