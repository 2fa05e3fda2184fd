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
`tool_result` event.

TLS: `--tls-cert FILE --tls-key FILE` (PEM) serve TLS, and `--tls-client-ca
FILE` also requires Lattice to present a certificate signed by that CA
(mutual TLS); Lattice then names the hook with `https://` (or `dns:///`) and
a `tls` table.
"""

import argparse
import os
import re
import signal
import sys
import threading
from concurrent import futures

sys.path.insert(0, os.environ.get("LATTICE_PY_GEN", os.path.join(os.path.dirname(os.path.abspath(__file__)), "gen")))

import grpc  # noqa: E402
from lattice.agent.v1 import content_pb2  # noqa: E402
from lattice.hooks.v1 import hooks_pb2, hooks_pb2_grpc  # noqa: E402

API_KEY = re.compile(
    r"\b(?:sk_(?:live|test)_[A-Za-z0-9]{16,}|sk-[A-Za-z0-9_-]{20,}|gh[pousr]_[A-Za-z0-9]{30,}"
    r"|AKIA[0-9A-Z]{16}|xox[abpr]-[A-Za-z0-9-]{10,}|(?:key|token)_[A-Za-z0-9]{24,})\b"
)
EMAIL = re.compile(r"[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}")
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


class RedactHook(hooks_pb2_grpc.HookServiceServicer):
    def OnToolResult(self, request, context):
        total = 0
        blocks = []
        for block in request.result.content:
            text, n = redact(block.text)
            total += n
            blocks.append(content_pb2.TextBlock(text=text))
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
    parser.add_argument("--tls-cert", help="serve TLS with this certificate (PEM)")
    parser.add_argument("--tls-key", help="the certificate's private key (PEM)")
    parser.add_argument("--tls-client-ca", help="require client certificates signed by this CA (PEM)")
    args = parser.parse_args()
    if bool(args.tls_cert) != bool(args.tls_key) or (args.tls_client_ca and not args.tls_cert):
        parser.error("--tls-cert and --tls-key go together; --tls-client-ca needs them")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    hooks_pb2_grpc.add_HookServiceServicer_to_server(RedactHook(), server)
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
    print(f"listening on {port}", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    server.stop(grace=2).wait()


if __name__ == "__main__":
    main()
