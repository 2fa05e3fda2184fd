#!/usr/bin/env bash
# Renders the kustomization and validates every resource against the
# Kubernetes API schemas, strictly (an unknown or misplaced field fails).
# Needs kubectl (for `kubectl kustomize`) and kubernetes-validate (PyPI);
# neither talks to a cluster.
set -euo pipefail
cd "$(dirname "$0")"
rendered=$(mktemp)
trap 'rm -f "$rendered"' EXIT
kubectl kustomize . >"$rendered"
echo "rendered $(grep -c '^kind:' "$rendered") resources: $(grep '^kind:' "$rendered" | cut -d' ' -f2 | sort | uniq -c | awk '{printf "%s %s, ", $1, $2}')"
kubernetes-validate --strict --quiet "$rendered"
echo "all valid (kubernetes-validate --strict, Kubernetes $(kubernetes-validate --version))"
