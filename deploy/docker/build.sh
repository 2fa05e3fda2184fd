#!/usr/bin/env bash
# Builds the images lattice:dev and lattice-redact:dev from static release
# builds (no base image is pulled: both are FROM scratch).
set -euo pipefail
cd "$(dirname "$0")/../.."
target=x86_64-unknown-linux-gnu
RUSTFLAGS='-C target-feature=+crt-static' cargo build --release --locked --target "$target" \
  -p lattice-server --bin lattice -p lattice-hook-sdk --example redact
ctx=$(mktemp -d)
trap 'rm -rf "$ctx"' EXIT
cp "target/$target/release/lattice" "$ctx/lattice"
cp /etc/ssl/certs/ca-certificates.crt "$ctx/ca-certificates.crt"
cp "target/$target/release/examples/redact" "$ctx/hook"
docker build -t lattice:dev -f deploy/docker/Dockerfile "$ctx"
docker build -t lattice-redact:dev -f deploy/docker/Dockerfile.hook "$ctx"
echo "built lattice:dev and lattice-redact:dev"
