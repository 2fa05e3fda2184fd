"""A Lattice redaction hook in Python (grpcio), built from the .proto alone.

It implements lattice.hooks.v1.HookService/OnToolResult: every tool result's
text is scanned for emails, card numbers (Luhn-checked), phone numbers and
API-key-like tokens, which are replaced by the same markers as the Rust
example (`[REDACTED:email]`, `[REDACTED:card]`, `[REDACTED:phone]`,
`[REDACTED:api_key]`). A result with nothing to redact gets an empty reply,
which Lattice reads as "keep".

Set up and run:

    pip install -r requirements.txt
    ./generate.sh                      # writes ./gen from ../../../proto
    python3 redact_hook.py --listen 127.0.0.1:50074

With `--listen 127.0.0.1:0` it picks a free port; the first line it prints
is `listening on PORT`. Register it in Lattice's config for the
`tool_result` event with `deadline_ms = 5000`, and check it with that
deadline: `lattice hook check 127.0.0.1:50074 --events tool_result
--deadline-ms 5000`. Four regular expressions over a tool result near
Lattice's 16 MiB limit take this hook over a second (1.3 s measured on two
cores), more than Lattice's default hook deadline of 1 s; the Rust example
takes about 0.1 s.

What a production hook needs, it has:
- `grpc.health.v1` (Kubernetes' gRPC probe and Lattice's readiness ask it)
  and server reflection (grpcurl lists and describes it);
- a drain: on SIGTERM health says NOT_SERVING at once, calls are still
  served for `--drain-ms` (Lattice moves to the other replicas), then the
  server stops, finishing calls in flight;
- message limits of LATTICE_HOOK_MAX_MESSAGE_BYTES (16 MiB, Lattice's
  default `hook_max_message_bytes`; gRPC's own default is 4 MiB);
- one JSON log line per event on stderr, with sizes and counts, never
  content.

TLS: `--tls-cert FILE --tls-key FILE` (PEM) serve TLS, and `--tls-client-ca
FILE` also requires Lattice to present a certificate signed by that CA
(mutual TLS); Lattice then names the hook with `https://` (or `dns:///`) and
a `tls` table.
"""

import argparse
import json
import os
import re
import signal
import sys
import threading
import time
from concurrent import futures

sys.path.insert(0, os.environ.get("LATTICE_PY_GEN", os.path.join(os.path.dirname(os.path.abspath(__file__)), "gen")))

import grpc  # noqa: E402
from grpc_health.v1 import health, health_pb2, health_pb2_grpc  # noqa: E402
from grpc_reflection.v1alpha import reflection  # noqa: E402
from lattice.agent.v1 import content_pb2  # noqa: E402
from lattice.hooks.v1 import hooks_pb2, hooks_pb2_grpc  # noqa: E402


def log(message, **fields):
    """One JSON line on stderr: sizes and counts, never content."""
    line = {"ts": round(time.time(), 3), "level": "info", "message": message, **fields}
    print(json.dumps(line), file=sys.stderr, flush=True)

API_KEY = re.compile(
    r"\b(?:sk_(?:live|test)_[A-Za-z0-9]{16,}|sk-[A-Za-z0-9_-]{20,}|gh[pousr]_[A-Za-z0-9]{30,}"
    r"|AKIA[0-9A-Z]{16}|xox[abpr]-[A-Za-z0-9-]{10,}|(?:key|token)_[A-Za-z0-9]{24,})\b"
)
# The lookbehind starts a match only where a run of address characters
# starts: without it, a long run with no "@" costs quadratic time (a 1 MiB
# result took minutes; `lattice hook check` finds that).
EMAIL = re.compile(r"(?<![A-Za-z0-9._%+-])[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}")
DIGITS = re.compile(r"\d(?:[ -]?\d){12,18}")
PHONE = re.compile(r"(?:\+\d{1,3}[ .-]?)?(?:\(\d{1,4}\)[ .-]?)?\d{2,4}(?:[ .-]?\d{2,4}){1,4}")


def luhn(digits: str) -> bool:
    total = 0
    for i, c in enumerate(reversed(digits)):
        d = int(c)
        if i % 2 == 1:
            d *= 2
            if d > 9:
                d -= 9
        total += d
    return total % 10 == 0


def redact(text: str) -> tuple[str, int]:
    """Returns the redacted text and how many values were replaced."""
    count = 0

    def sub(marker):
        def f(_m):
            nonlocal count
            count += 1
            return marker

        return f

    def card(m):
        nonlocal count
        digits = re.sub(r"\D", "", m.group(0))
        if 13 <= len(digits) <= 19 and luhn(digits):
            count += 1
            return "[REDACTED:card]"
        return m.group(0)

    def phone(m):
        nonlocal count
        s = m.group(0)
        digits = sum(c.isdigit() for c in s)
        if 7 <= digits <= 15 and any(c in s for c in "+ .-("):
            count += 1
            return "[REDACTED:phone]"
        return s

    text = API_KEY.sub(sub("[REDACTED:api_key]"), text)
    text = EMAIL.sub(sub("[REDACTED:email]"), text)
    text = DIGITS.sub(card, text)
    text = PHONE.sub(phone, text)
    return text, count


def trace_ids(context):
    """The trace this call belongs to, from Lattice's W3C traceparent header
    (sent when Lattice exports OpenTelemetry traces), so that these log lines
    join the query's trace. A server instrumented with
    opentelemetry-instrumentation-grpc continues the trace by itself."""
    for key, value in context.invocation_metadata():
        if key == "traceparent":
            parts = value.split("-")
            if len(parts) == 4 and len(parts[1]) == 32 and len(parts[2]) == 16:
                return {"trace_id": parts[1], "parent_span_id": parts[2]}
    return {}


class RedactHook(hooks_pb2_grpc.HookServiceServicer):
    def OnToolResult(self, request, context):
        total = 0
        blocks = []
        for block in request.result.content:
            text, n = redact(block.text)
            total += n
            blocks.append(content_pb2.TextBlock(text=text))
        log(
            "tool result checked",
            tool=request.tool_name,
            tool_use_id=request.tool_use_id,
            bytes=sum(len(b.text) for b in request.result.content),
            redacted=total,
            **trace_ids(context),
        )
        if total == 0:
            return hooks_pb2.OnToolResultResponse()  # unset: keep
        result = content_pb2.ToolResultBlock(
            tool_use_id=request.result.tool_use_id, content=blocks, is_error=request.result.is_error
        )
        return hooks_pb2.OnToolResultResponse(result=result)

    # OnModelRequest is not implemented (UNIMPLEMENTED): register this hook
    # for tool_result only, or Lattice aborts every query (fail-closed).


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", default="127.0.0.1:50074")
    parser.add_argument("--drain-ms", type=int, default=5000, help="after SIGTERM, keep serving this long")
    parser.add_argument("--tls-cert", help="serve TLS with this certificate (PEM)")
    parser.add_argument("--tls-key", help="the certificate's private key (PEM)")
    parser.add_argument("--tls-client-ca", help="require client certificates signed by this CA (PEM)")
    args = parser.parse_args()
    if bool(args.tls_cert) != bool(args.tls_key) or (args.tls_client_ca and not args.tls_cert):
        parser.error("--tls-cert and --tls-key go together; --tls-client-ca needs them")
    limit = int(os.environ.get("LATTICE_HOOK_MAX_MESSAGE_BYTES", 16 * 1024 * 1024))
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=8),
        options=[("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)],
    )
    hooks_pb2_grpc.add_HookServiceServicer_to_server(RedactHook(), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    services = (
        hooks_pb2.DESCRIPTOR.services_by_name["HookService"].full_name,
        health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
        reflection.SERVICE_NAME,
    )
    reflection.enable_server_reflection(services, server)
    if args.tls_cert:
        def read(path):
            with open(path, "rb") as f:
                return f.read()

        client_ca = read(args.tls_client_ca) if args.tls_client_ca else None
        credentials = grpc.ssl_server_credentials(
            [(read(args.tls_key), read(args.tls_cert))],
            root_certificates=client_ca,
            require_client_auth=client_ca is not None,
        )
        port = server.add_secure_port(args.listen, credentials)
    else:
        port = server.add_insecure_port(args.listen)
    server.start()
    for service in ("", services[0]):
        health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    print(f"listening on {port}", flush=True)
    log("serving", port=port, max_message_bytes=limit, tls=bool(args.tls_cert))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    # Draining: say so first, keep serving while Lattice moves away.
    health_servicer.enter_graceful_shutdown()
    log("draining", drain_ms=args.drain_ms)
    time.sleep(args.drain_ms / 1000)
    server.stop(grace=2).wait()
    log("stopped")


if __name__ == "__main__":
    main()
