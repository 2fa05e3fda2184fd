#!/usr/bin/env bash
# The newcomer's path, as a test. Clones this repository (what is committed:
# HEAD) into a temporary directory and there runs the README's commands as
# a new user would, taken from README.md itself (the shell blocks of its
# "Try it" and "Run the tests" sections), not copied here:
#
# 1. the quickstart: its query's customer record must arrive redacted
#    (`[REDACTED:email]`, `[REDACTED:phone]`, `[REDACTED:card]`) and the
#    raw data must appear nowhere in its output;
# 2. every command the quickstart then suggests, as printed: each must exit
#    0 and print something ("Find Grace" must find Grace); then stopping the
#    hook as it suggests, the query must abort with HOOK_FAILED, leaking
#    nothing;
# 3. the README's test command (skipped with --quickstart-only).
#
# It prints each command's wall time and the disk the clone took. CI runs
# it (.ci/run); the clone is removed when everything passed and kept after
# a failure.
#
#   bash tests/newcomer.sh [--quickstart-only]
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
run_tests=1
case "${1:-}" in
  "") ;;
  --quickstart-only) run_tests=0 ;;
  *)
    echo "usage: bash tests/newcomer.sh [--quickstart-only]" >&2
    exit 2
    ;;
esac

work="${TMPDIR:-/tmp}/lattice-newcomer"
clone="$work/lattice"
rm -rf "$work"
mkdir -p "$work"
if [ -n "$(git -C "$repo" status --porcelain --untracked-files=no)" ]; then
  echo "newcomer: note: uncommitted changes are not part of the clone (it takes HEAD)"
fi
git clone --quiet "$repo" "$clone"
cd "$clone"

passed=0
failed=0
timings=()
ok() {
  echo "newcomer: PASS $*"
  passed=$((passed + 1))
}
fail() {
  echo "newcomer: FAIL $*" >&2
  failed=$((failed + 1))
}

# The shell commands of the first ```sh block under a README heading.
readme_block() {
  awk -v heading="$1" '
    $0 == heading { in_section = 1; next }
    in_section && /^## / { exit }
    in_section && /^```sh/ { in_block = 1; next }
    in_block && /^```/ { exit }
    in_block && NF && $1 !~ /^#/ { print }
  ' README.md
}
quickstart="$(readme_block "## Try it")"
test_command="$(readme_block "## Run the tests")"
[ -n "$quickstart" ] || { echo "newcomer: README.md has no shell block under '## Try it'" >&2; exit 1; }
[ -n "$test_command" ] || { echo "newcomer: README.md has no shell block under '## Run the tests'" >&2; exit 1; }

# --- 1. the quickstart ---------------------------------------------------
log="$work/quickstart.log"
echo "newcomer: \$ $quickstart"
started=$(date +%s)
# Its own process group, so that everything it started stops with it.
setsid bash -c "$quickstart" >"$log" 2>&1 &
quickstart_pid=$!
stop_quickstart() {
  kill -INT -- "-$quickstart_pid" 2>/dev/null || true
  for _ in $(seq 1 50); do kill -0 "$quickstart_pid" 2>/dev/null || return 0; sleep 0.1; done
  kill -KILL -- "-$quickstart_pid" 2>/dev/null || true
}
trap stop_quickstart EXIT
# A cold build takes minutes; its progress goes to the log.
until grep -q "Ctrl-C stops everything" "$log"; do
  if ! kill -0 "$quickstart_pid" 2>/dev/null; then
    cat "$log" >&2
    echo "newcomer: the quickstart ended before it was serving" >&2
    exit 1
  fi
  [ $(($(date +%s) - started)) -lt 1800 ] || { cat "$log" >&2; echo "newcomer: the quickstart took over 30 minutes" >&2; exit 1; }
  sleep 1
done
timings+=("$(($(date +%s) - started)) s  $quickstart (until it serves)")
sed -n '/^\$ lattice query/,$p' "$log"

for marker in "[REDACTED:email]" "[REDACTED:phone]" "[REDACTED:card]"; do
  if grep -qF "$marker" "$log"; then ok "the quickstart's query shows $marker"; else fail "the quickstart's query lacks $marker"; fi
done
# Ada's record as the example tool service holds it.
for raw in "ada.lovelace@example.com" "+44 20 7946 0958"; do
  if grep -qF "$raw" "$log"; then fail "the quickstart's output holds $raw"; else ok "the quickstart's output holds no $raw"; fi
done

# --- 2. what it suggests --------------------------------------------------
# The indented lines after "Try:", up to the next blank line.
mapfile -t suggested < <(awk '/Try:$/ { on = 1; next } on && /^$/ && seen { exit } on && /^  / { seen = 1; sub(/^  /, ""); print }' "$log")
[ ${#suggested[@]} -gt 0 ] || { fail "the quickstart suggests no commands"; }
for command in "${suggested[@]}"; do
  out="$work/suggested.out"
  begin=$(date +%s%N)
  if bash -o pipefail -c "$command" >"$out" 2>&1 && [ -s "$out" ]; then
    ok "$command ($(( ($(date +%s%N) - begin) / 1000000 )) ms)"
  else
    fail "$command"
    sed 's/^/    /' "$out" >&2
    continue
  fi
  case "$command" in
    *"Find Grace"*)
      if grep -q "Grace Hopper" "$out" && ! grep -q "Ada Lovelace" "$out"; then ok "Find Grace finds Grace"; else
        fail "Find Grace did not find Grace"
        sed 's/^/    /' "$out" >&2
      fi
      ;;
  esac
done

# "Stop the redact hook and query again": the two lines after it.
mapfile -t stop < <(awk '/^Stop the redact hook/ { on = 1; next } on && /^  / { sub(/^  /, ""); print } on && /^Ctrl-C/ { exit }' "$log")
if [ ${#stop[@]} -eq 2 ]; then
  bash -c "${stop[0]}"
  sleep 0.5
  out="$work/after-stop.out"
  if bash -c "${stop[1]}" >"$out" 2>&1; then
    fail "with the hook stopped, the query succeeded"
  elif grep -q "HOOK_FAILED" "$out" && ! grep -qF "ada.lovelace@example.com" "$out"; then
    ok "with the hook stopped, the query aborts with HOOK_FAILED and leaks nothing"
  else
    fail "with the hook stopped, the query failed otherwise"
    sed 's/^/    /' "$out" >&2
  fi
else
  fail "the quickstart does not say how to stop the hook (expected two commands, got ${#stop[@]})"
fi
stop_quickstart
trap - EXIT

# --- 3. the README's test command -----------------------------------------
if [ "$run_tests" = 1 ] && [ "$failed" = 0 ]; then
  echo "newcomer: \$ $test_command"
  started=$(date +%s)
  if bash -c "$test_command"; then
    ok "the README's test command"
  else
    fail "the README's test command"
  fi
  timings+=("$(($(date +%s) - started)) s  $test_command")
fi

echo "newcomer: wall time of each command:"
printf '  %s\n' "${timings[@]}"
echo "newcomer: the clone takes $(du -sh "$clone" | cut -f1) ($(du -sh "$clone/target" 2>/dev/null | cut -f1) in target/, $(du -sh "$clone/.venv" 2>/dev/null | cut -f1) in .venv/); $(df -h --output=avail "$work" | tail -1 | tr -d ' ') free"
if [ "$failed" = 0 ]; then
  rm -rf "$work"
else
  echo "newcomer: the clone and its logs are kept in $work" >&2
fi
echo "newcomer: $passed passed, $failed failed"
[ "$failed" = 0 ]
