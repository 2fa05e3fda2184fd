#!/usr/bin/env bash
# Builds Go hooks on latticehook from Lattice's .proto files and Debian's Go
# packages alone (no module download):
#
#   bash hook-sdk/go/build.sh DIR OUT   builds the main package in DIR into OUT
#   bash hook-sdk/go/build.sh --test    checks the package: gofmt, vet, its tests
#
# Debian packages: golang-go golang-google-grpc-dev
#   golang-github-golang-protobuf-1-5-dev golang-google-protobuf-dev
#   protobuf-compiler protoc-gen-go protoc-gen-go-grpc
#
# The contract's code is generated into a throw-away GOPATH under the import
# path the .proto files name (lattice.dev/proto/...), beside this package
# (lattice.dev/latticehook) and Debian's /usr/share/gocode. With Go modules
# of your own, generate with the same protoc flags and require
# lattice.dev/latticehook with a replace directive to this directory.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
proto="$here/../../proto"
if [ "${1:-}" = --test ]; then mode=test; elif [ $# = 2 ]; then mode=build; else
  echo "usage: build.sh DIR OUT | build.sh --test" >&2
  exit 2
fi
gopath="$(mktemp -d)"
trap 'rm -rf "$gopath"' EXIT
mkdir -p "$gopath/src/lattice.dev/latticehook"
protoc -I "$proto" --go_out="$gopath/src" --go-grpc_out="$gopath/src" \
  lattice/agent/v1/content.proto lattice/hooks/v1/hooks.proto
cp "$here"/*.go "$gopath/src/lattice.dev/latticehook/"
export GOPATH="$gopath:/usr/share/gocode" GO111MODULE=off GOPROXY=off GOFLAGS=
if [ "$mode" = test ]; then
  unformatted="$(gofmt -l "$here"/*.go)"
  [ -z "$unformatted" ] || { echo "not gofmt-formatted: $unformatted" >&2; exit 1; }
  cd "$gopath/src/lattice.dev/latticehook"
  go vet .
  go test -count=1 .
else
  src="$(cd "$1" && pwd)"
  out="$(cd "$(dirname "$2")" && pwd)/$(basename "$2")"
  pkg="$gopath/src/lattice.dev/hooks/$(basename "$src")"
  mkdir -p "$pkg"
  cp "$src"/*.go "$pkg/"
  cd "$pkg"
  go build -o "$out" .
  echo "built $out"
fi
