#!/usr/bin/env bash
# Installs what Lattice's tests need and a fresh machine lacks, and does
# nothing (in about a second) when all of it is there. `tests/run.sh` calls
# it first, `.ci/run` through it, so a laptop and CI install the same things
# the same way.
#
#   bash tests/setup.sh          everything below
#   bash tests/setup.sh python   only the virtual environment (the quickstart)
#
# What it cannot install, you need beforehand: Rust (cargo, 1.90 or newer),
# Python 3 with its venv module, and, for the container tests, a running
# Docker engine.
#
# - Python packages (grpcurl, grpcio, the metrics parser, the Kubernetes
#   schema validator) and the hook package hook-sdk/python go into a virtual
#   environment, .venv/ at the top of the checkout, never into the system's
#   Python; it is refreshed when tests/requirements.txt or the package's
#   files change. Put .venv/bin first on PATH to use them by hand
#   (tests/run.sh does).
# - Debian packages (needs root, or sudo): PostgreSQL's server for the
#   session-store tests, PgBouncer, Go with grpc-go and the protoc plugins
#   for the Go example hook (built from Debian's packages alone, no module
#   download), kubectl for rendering deploy/k8s.
# - cargo-nextest, from crates.io, if cargo has no `nextest`.
set -euo pipefail
cd "$(dirname "$0")/.."
what="${1:-all}"
case "$what" in all | python) ;; *)
  echo "usage: bash tests/setup.sh [all|python]" >&2
  exit 2
  ;;
esac

say() { echo "setup: $*"; }

# --- Python: a virtual environment of the checkout's own -----------------
venv=.venv
requirements=tests/requirements.txt
stamp="$venv/.lattice-requirements"
package=hook-sdk/python
wanted="$({
  cat "$requirements"
  find "$package" \( -name build -o -name '*.egg-info' -o -name __pycache__ \) -prune -o -type f -print |
    LC_ALL=C sort | xargs sha256sum
  sha256sum proto/lattice/agent/v1/content.proto proto/lattice/hooks/v1/hooks.proto
} | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$wanted" ]; then
  if [ ! -x "$venv/bin/python3" ]; then
    say "creating the Python virtual environment $venv"
    python3 -m venv "$venv" || {
      echo "setup: python3 -m venv failed: install Python's venv module (Debian: apt-get install python3-venv)" >&2
      exit 1
    }
  fi
  say "installing Python packages into $venv (tests/requirements.txt)"
  "$venv/bin/python3" -m pip install --quiet --disable-pip-version-check -r "$requirements"
  say "installing the hook package $package into $venv"
  rm -rf "$package/build" # pip builds in the tree: nothing stale goes in
  "$venv/bin/python3" -m pip install --quiet --disable-pip-version-check --no-deps --force-reinstall "./$package"
  echo "$wanted" >"$stamp"
fi

[ "$what" = python ] && exit 0

# --- Debian packages ------------------------------------------------------
# PostgreSQL's server binaries are looked for where Debian puts them, as the
# tests do; the rest by command.
packages=()
ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || packages+=(postgresql)
command -v pgbouncer >/dev/null || [ -x /usr/sbin/pgbouncer ] || packages+=(pgbouncer)
# Go and what the Go example hook is built from. Without the 1.5 protobuf
# API package grpc-go 1.33 panics on its first call.
go_packages=(golang-go golang-google-grpc-dev golang-github-golang-protobuf-1-5-dev golang-google-protobuf-dev
  protobuf-compiler protoc-gen-go protoc-gen-go-grpc)
dpkg -s "${go_packages[@]}" >/dev/null 2>&1 || packages+=("${go_packages[@]}")
command -v kubectl >/dev/null || packages+=(kubectl)
if [ ${#packages[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    as_root=()
  elif command -v sudo >/dev/null; then
    as_root=(sudo)
  else
    echo "setup: the tests need Debian packages this machine lacks, and installing them needs root:" >&2
    echo "  apt-get update && apt-get install -y --no-install-recommends ${packages[*]}" >&2
    exit 1
  fi
  say "installing Debian packages: ${packages[*]} (about a minute)"
  "${as_root[@]}" apt-get update -qq
  "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    "${packages[@]}" >/dev/null
fi

# --- cargo-nextest --------------------------------------------------------
if ! cargo nextest --version >/dev/null 2>&1; then
  say "installing cargo-nextest from crates.io (a few minutes)"
  cargo install --locked cargo-nextest
fi
