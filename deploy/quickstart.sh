#!/usr/bin/env bash
# The quickstart: builds Lattice, starts the example customer-lookup tool
# service, the example redaction hook and Lattice with
# deploy/examples/quickstart.toml, runs one query and prints its event
# stream, then keeps serving until Ctrl-C. Logs go to target/quickstart/.
set -euo pipefail
cd "$(dirname "$0")/.."

echo "building (the first build takes a few minutes)…"
cargo build --quiet -p lattice-server --bin lattice -p lattice-hook-sdk --example redact
bin=target/debug
logs=target/quickstart
mkdir -p "$logs"

pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; }
trap cleanup EXIT
trap 'exit 0' INT TERM

wait_port() { # host port name
  for _ in $(seq 1 100); do
    if (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null; then return 0; fi
    sleep 0.1
  done
  echo "$3 did not start on $1:$2; see $logs/" >&2
  exit 1
}

# No drain period on a laptop: stop at once when the script ends.
"$bin/lattice" example-tools --listen 127.0.0.1:50061 --drain-ms 0 >"$logs/tools.log" 2>&1 & pids+=($!)
LATTICE_HOOK_DRAIN_MS=0 "$bin/examples/redact" --listen 127.0.0.1:50071 >"$logs/redact.log" 2>&1 & pids+=($!)
wait_port 127.0.0.1 50061 "the example tool service"
wait_port 127.0.0.1 50071 "the redact hook"
"$bin/lattice" serve --config deploy/examples/quickstart.toml >"$logs/lattice.log" 2>&1 & pids+=($!)
wait_port 127.0.0.1 50051 "lattice"

echo
echo "\$ lattice query --agent support \"Find Ada\""
"$bin/lattice" query --agent support "Find Ada"

cat <<'MSG'

Lattice is serving on 127.0.0.1:50051 (logs and traces in target/quickstart*). Try:

  target/debug/lattice query --agent support --show-requests "Find Grace"
  grpcurl -plaintext 127.0.0.1:50051 list
  grpcurl -plaintext 127.0.0.1:50051 describe lattice.hooks.v1.HookService
  grpcurl -plaintext -d '{"name": "support"}' 127.0.0.1:50051 lattice.agent.v1.AgentService/GetAgent
  grpcurl -plaintext -d '{"agent": "support", "prompt": "Find Ada"}' 127.0.0.1:50051 lattice.agent.v1.AgentService/Query
  grpcurl -plaintext 127.0.0.1:50051 grpc.health.v1.Health/Check
  curl -s 127.0.0.1:50051/metrics | grep '^lattice_hook_calls_total'

Stop the redact hook (kill the `examples/redact` process) and query again:
the query is aborted with HOOK_FAILED instead of leaking the customer's data.

Ctrl-C stops everything.
MSG
wait
