#!/usr/bin/env bash
# The quickstart: builds Lattice, starts the example customer-lookup tool
# service, the example redaction hook and Lattice with
# deploy/examples/quickstart.toml, runs one query and prints its event
# stream, then keeps serving until Ctrl-C. Logs go to target/quickstart/.
# It needs Rust and Python 3; grpcurl, for the commands it suggests, is put
# in .venv by tests/setup.sh when it is not on PATH.
set -euo pipefail
cd "$(dirname "$0")/.."

# grpcurl, for the commands suggested at the end: into the checkout's own
# Python environment (.venv), never the system's.
if command -v grpcurl >/dev/null; then
  grpcurl=grpcurl
else
  bash tests/setup.sh python
  grpcurl=.venv/bin/grpcurl
fi

echo "building Lattice and the example hook (the first build takes a few minutes)…"
cargo build -p lattice-server --bin lattice -p lattice-hook-sdk --example redact
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
redact_pid=$!
wait_port 127.0.0.1 50061 "the example tool service"
wait_port 127.0.0.1 50071 "the redact hook"
"$bin/lattice" serve --config deploy/examples/quickstart.toml >"$logs/lattice.log" 2>&1 & pids+=($!)
wait_port 127.0.0.1 50051 "lattice"

echo
echo "\$ lattice query --agent support \"Find Ada\""
"$bin/lattice" query --agent support "Find Ada"

# Every command below is run by tests/newcomer.sh, which checks it succeeds.
cat <<MSG

Lattice is serving on 127.0.0.1:50051 (logs and traces in target/quickstart*). Try:

  target/debug/lattice query --agent support --show-requests "Find Grace"
  $grpcurl -plaintext 127.0.0.1:50051 list
  $grpcurl -plaintext 127.0.0.1:50051 describe lattice.hooks.v1.HookService
  $grpcurl -plaintext -d '{"name": "support"}' 127.0.0.1:50051 lattice.agent.v1.AgentService/GetAgent
  $grpcurl -plaintext -d '{"agent": "support", "prompt": "Find Ada"}' 127.0.0.1:50051 lattice.agent.v1.AgentService/Query
  $grpcurl -plaintext 127.0.0.1:50051 grpc.health.v1.Health/Check
  curl -s 127.0.0.1:9090/metrics | grep '^lattice_hook_calls_total'

(Metrics are on the admin port, server.admin_listen: 127.0.0.1:9090.)

Stop the redact hook and query again: the query is aborted with HOOK_FAILED
instead of leaking the customer's data.

  kill $redact_pid
  target/debug/lattice query --agent support "Find Ada"

Ctrl-C stops everything.
MSG
wait
