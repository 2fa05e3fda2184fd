"""Serving a hook: the gRPC server with health, reflection, message limits,
TLS, a drain on SIGTERM, and the standard command line."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import inspect
import logging
import os
import signal
import threading
import time
from concurrent import futures
from typing import Any, Callable, Optional, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from lattice_hook._calls import ModelRequestCall, ModelRequestChange, ToolResultBlock, ToolResultCall, with_text
from lattice_hook._logs import current_call, init_logs, log
from lattice_hook.pb.lattice.hooks.v1 import hooks_pb2

SERVICE = "lattice.hooks.v1.HookService"

MAX_MESSAGE_BYTES_ENV = "LATTICE_HOOK_MAX_MESSAGE_BYTES"
"""The variable that sets the largest request or reply, in bytes; set it to
Lattice's `server.hook_max_message_bytes` when you change that."""
DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024
"""Lattice's default hook message limit (gRPC's own default is 4 MiB)."""
DRAIN_ENV = "LATTICE_HOOK_DRAIN_MS"
"""The variable that sets the drain period, in milliseconds."""
DEFAULT_DRAIN_SECONDS = 6.0
"""Long enough for Kubernetes to take the pod out of its Service's endpoints
and for Lattice to re-resolve a `dns:///` name (every 5 s)."""
STOP_GRACE_SECONDS = 30.0
"""After the drain, how long calls still in flight may take to finish."""


class HookError(Exception):
    """Raised by a hook to refuse a value: Lattice aborts the query with
    this status, and the value is never sent on. `message` reaches
    Lattice's logs and its client: never put content in it."""

    def __init__(self, code: grpc.StatusCode = grpc.StatusCode.FAILED_PRECONDITION, message: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclasses.dataclass(frozen=True)
class Tls:
    """TLS for a hook service: its certificate (chain) and key, PEM, and
    optionally the CA whose certificates clients must present (mutual TLS).
    Lattice connects with TLS to `https://` and TLS-configured `dns:///`
    endpoints."""

    cert_pem: bytes
    key_pem: bytes
    client_ca_pem: Optional[bytes] = None

    @staticmethod
    def from_files(cert: str, key: str, client_ca: Optional[str] = None) -> "Tls":
        """Reads the PEM files."""

        def read(path: str) -> bytes:
            with open(path, "rb") as f:
                return f.read()

        return Tls(read(cert), read(key), read(client_ca) if client_ca else None)

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.key_pem, self.cert_pem)],
            root_certificates=self.client_ca_pem,
            require_client_auth=self.client_ca_pem is not None,
        )


def message_limit() -> int:
    """The largest request or reply: LATTICE_HOOK_MAX_MESSAGE_BYTES, else
    16 MiB."""
    try:
        return int(os.environ[MAX_MESSAGE_BYTES_ENV])
    except (KeyError, ValueError):
        return DEFAULT_MAX_MESSAGE_BYTES


def drain_seconds() -> float:
    """The drain period: LATTICE_HOOK_DRAIN_MS, else 6 s."""
    try:
        return int(os.environ[DRAIN_ENV]) / 1000
    except (KeyError, ValueError):
        return DEFAULT_DRAIN_SECONDS


class FunctionHook:
    """A hook made of functions (see `hook`)."""

    def __init__(self, on_tool_result: Optional[Callable[..., Any]] = None, on_model_request: Optional[Callable[..., Any]] = None) -> None:
        if on_tool_result is not None:
            self.on_tool_result = on_tool_result
        if on_model_request is not None:
            self.on_model_request = on_model_request


def hook(on_tool_result: Optional[Callable[..., Any]] = None, on_model_request: Optional[Callable[..., Any]] = None) -> FunctionHook:
    """A hook from one or two functions (plain or `async`), each taking the
    call and returning a replacement or None."""
    if on_tool_result is None and on_model_request is None:
        raise TypeError("a hook needs on_tool_result, on_model_request or both")
    return FunctionHook(on_tool_result, on_model_request)


def is_async(hook: Any) -> bool:
    """Whether `hook`'s methods are coroutines (served by the asyncio
    server); mixing plain and `async` methods is refused."""
    kinds = {
        inspect.iscoroutinefunction(getattr(hook, name))
        for name in ("on_tool_result", "on_model_request")
        if callable(getattr(hook, name, None))
    }
    if not kinds:
        raise TypeError(f"{type(hook).__name__} has neither on_tool_result nor on_model_request")
    if len(kinds) == 2:
        raise TypeError("a hook's methods are either all plain or all async")
    return kinds == {True}


# --- One call ---------------------------------------------------------------

UNHANDLED = {
    "OnToolResult": "this hook does not handle tool results: register it for the model_request event only",
    "OnModelRequest": "this hook does not handle model requests: register it for the tool_result event only",
}


def _tool_result_reply(out: Any) -> Any:
    if out is None:
        return hooks_pb2.OnToolResultResponse()
    if isinstance(out, ToolResultBlock):
        return hooks_pb2.OnToolResultResponse(result=out)
    raise TypeError(f"on_tool_result returned {type(out).__name__}, not a ToolResultBlock, str or None")


def _model_request_reply(out: Any) -> Any:
    if out is None:
        return hooks_pb2.OnModelRequestResponse()
    if not isinstance(out, ModelRequestChange):
        raise TypeError(f"on_model_request returned {type(out).__name__}, not a ModelRequestChange or None")
    reply = hooks_pb2.OnModelRequestResponse()
    if out.system is not None:
        reply.system = out.system
    if out.messages is not None:
        reply.messages.SetInParent()
        reply.messages.messages.extend(out.messages)
    return reply


def _failed(rpc: str, error: BaseException) -> None:
    """Logs a hook's exception by its type and where it was raised, never
    its text: a redaction hook's exception message may quote the value."""
    tb = error.__traceback__
    where = ""
    while tb is not None:
        where = f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno} in {tb.tb_frame.f_code.co_name}"
        tb = tb.tb_next
    log("the hook raised an exception", logging.ERROR, rpc=rpc, exception=type(error).__name__, where=where)


INTERNAL_MESSAGE = "the hook raised an exception"


def _sync_handler(
    rpc: str, fn: Optional[Callable[..., Any]], make_call: type, reply: Callable[[Any], Any]
) -> Callable[..., Any]:
    if fn is None:
        def unhandled(request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, UNHANDLED[rpc])

        return unhandled
    text_reply = rpc == "OnToolResult"

    def handle(request: Any, context: grpc.ServicerContext) -> Any:
        call = make_call(request, context)
        token = current_call.set(call)
        try:
            out = fn(call)
            if text_reply and isinstance(out, str):
                out = with_text(request.result, out)
            return reply(out)
        except HookError as e:
            context.abort(e.code, e.message)
        except Exception as e:  # noqa: BLE001 - every bug answers INTERNAL
            _failed(rpc, e)
            context.abort(grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE)
        finally:
            current_call.reset(token)

    return handle


def _async_handler(
    rpc: str, fn: Optional[Callable[..., Any]], make_call: type, reply: Callable[[Any], Any]
) -> Callable[..., Any]:
    if fn is None:
        async def unhandled(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, UNHANDLED[rpc])

        return unhandled
    text_reply = rpc == "OnToolResult"

    async def handle(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        call = make_call(request, context)
        current_call.set(call)  # each call is a task of its own
        try:
            out = await fn(call)
            if text_reply and isinstance(out, str):
                out = with_text(request.result, out)
            return reply(out)
        except HookError as e:
            await context.abort(e.code, e.message)
        except Exception as e:  # noqa: BLE001 - every bug answers INTERNAL
            _failed(rpc, e)
            await context.abort(grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE)

    return handle


def _method_handlers(hook: Any, asynchronous: bool) -> dict[str, grpc.RpcMethodHandler[Any, Any]]:
    make = _async_handler if asynchronous else _sync_handler
    return {
        "OnToolResult": grpc.unary_unary_rpc_method_handler(
            make("OnToolResult", getattr(hook, "on_tool_result", None), ToolResultCall, _tool_result_reply),
            request_deserializer=hooks_pb2.OnToolResultRequest.FromString,
            response_serializer=hooks_pb2.OnToolResultResponse.SerializeToString,
        ),
        "OnModelRequest": grpc.unary_unary_rpc_method_handler(
            make("OnModelRequest", getattr(hook, "on_model_request", None), ModelRequestCall, _model_request_reply),
            request_deserializer=hooks_pb2.OnModelRequestRequest.FromString,
            response_serializer=hooks_pb2.OnModelRequestResponse.SerializeToString,
        ),
    }


def service_handler(hook: Any, asynchronous: bool = False) -> grpc.GenericRpcHandler:
    """The gRPC handler of `lattice.hooks.v1.HookService` for `hook`, to add
    to a server of your own (`server.add_generic_rpc_handlers((h,))`)."""
    return grpc.method_handlers_generic_handler(SERVICE, _method_handlers(hook, asynchronous))


def _add_service(server: Any, hook: Any, asynchronous: bool) -> None:
    """Adds the hook service as generated code does: also as registered
    methods, which grpc dispatches without searching its handlers."""
    handlers = _method_handlers(hook, asynchronous)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)


# --- The server ---------------------------------------------------------------


def _options(limit: int) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_receive_message_length", limit),
        ("grpc.max_send_message_length", limit),
        # Two servers on one port would share its calls: refuse instead.
        ("grpc.so_reuseport", 0),
    ]


SERVICES = (SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)


def _bind(server: Any, addr: str, tls: Optional[Tls]) -> int:
    try:
        port = server.add_secure_port(addr, tls.credentials()) if tls else server.add_insecure_port(addr)
    except RuntimeError as e:
        raise OSError(f"cannot listen on {addr}: {e}") from None
    if port == 0:
        raise OSError(f"cannot listen on {addr}")
    return int(port)


def _started(port: int, limit: int, tls: Optional[Tls], announce: bool, ready: Optional[Callable[[int], None]]) -> None:
    if announce:
        print(f"listening on {port}", flush=True)
    log("serving", port=port, max_message_bytes=limit, tls=tls is not None)
    if ready is not None:
        ready(port)


def serve(
    hook: Any,
    addr: str,
    *,
    tls: Optional[Tls] = None,
    drain: Optional[float] = None,
    max_message_bytes: Optional[int] = None,
    max_workers: int = 16,
    stop: Optional[threading.Event] = None,
    announce: bool = True,
    ready: Optional[Callable[[int], None]] = None,
) -> None:
    """Serves `hook` on `addr` ("host:port"; port 0 picks a free one) until
    SIGTERM or Ctrl-C (or `stop` is set), then drains and returns.

    With grpc.health.v1 (SERVING for "" and the hook service) and server
    reflection. On stop, health says NOT_SERVING at once, calls are still
    served for `drain` seconds (default LATTICE_HOOK_DRAIN_MS or 6 s) while
    Lattice moves to other replicas, then the server stops, finishing the
    calls in flight. Requests and replies up to `max_message_bytes`
    (default LATTICE_HOOK_MAX_MESSAGE_BYTES or 16 MiB, Lattice's default).
    With `announce`, the first line on stdout is `listening on PORT`;
    `ready(port)` is called once the server serves.

    A hook whose methods are `async` is served by grpc's asyncio server
    (in a new event loop; see `serve_async`), others by a pool of
    `max_workers` threads."""
    if is_async(hook):
        if stop is not None:
            raise TypeError("an async hook is stopped through serve_async(stop=asyncio.Event)")
        asyncio.run(
            serve_async(hook, addr, tls=tls, drain=drain, max_message_bytes=max_message_bytes, announce=announce,
                        ready=ready)
        )
        return
    limit = max_message_bytes or message_limit()
    drain = drain_seconds() if drain is None else drain
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=_options(limit))
    _add_service(server, hook, asynchronous=False)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(SERVICES, server)
    port = _bind(server, addr, tls)
    stop = stop or threading.Event()
    restore = _on_signals(stop.set)
    try:
        server.start()
        for service in ("", SERVICE):
            health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
        _started(port, limit, tls, announce, ready)
        stop.wait()
        health_servicer.enter_graceful_shutdown()
        log("draining", drain_ms=int(drain * 1000))
        time.sleep(drain)
        server.stop(grace=STOP_GRACE_SECONDS).wait()
        log("stopped")
    finally:
        restore()
        server.stop(grace=None)


async def serve_async(
    hook: Any,
    addr: str,
    *,
    tls: Optional[Tls] = None,
    drain: Optional[float] = None,
    max_message_bytes: Optional[int] = None,
    stop: Optional[asyncio.Event] = None,
    announce: bool = True,
    ready: Optional[Callable[[int], None]] = None,
) -> None:
    """`serve` for a hook whose methods are `async`, on grpc's asyncio
    server in the running event loop. It stops on SIGTERM or Ctrl-C when
    the loop runs in the main thread, or when `stop` is set."""
    if not is_async(hook):
        raise TypeError("serve_async serves a hook whose methods are async; serve() takes plain ones")
    limit = max_message_bytes or message_limit()
    drain = drain_seconds() if drain is None else drain
    server = grpc.aio.server(options=_options(limit))
    _add_service(server, hook, asynchronous=True)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(SERVICES, server)
    port = _bind(server, addr, tls)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    installed = []
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
    try:
        await server.start()
        for service in ("", SERVICE):
            await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
        _started(port, limit, tls, announce, ready)
        await stop.wait()
        await health_servicer.enter_graceful_shutdown()
        log("draining", drain_ms=int(drain * 1000))
        await asyncio.sleep(drain)
        await server.stop(grace=STOP_GRACE_SECONDS)
        log("stopped")
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
        await server.stop(grace=None)


def _on_signals(action: Callable[[], None]) -> Callable[[], None]:
    """Calls `action` on SIGTERM and SIGINT (main thread only); returns
    what puts the previous handlers back."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = {sig: signal.signal(sig, lambda *_: action()) for sig in (signal.SIGTERM, signal.SIGINT)}

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    return restore


# --- The standard command line ----------------------------------------------


def add_arguments(parser: argparse.ArgumentParser, listen: str = "127.0.0.1:50074") -> argparse.ArgumentParser:
    """Adds the flags every hook takes: --listen, --drain-ms, --tls-cert,
    --tls-key, --tls-client-ca and --log-format."""
    parser.add_argument("--listen", default=listen, help=f"listen address, host:port; port 0 picks one (default {listen})")
    parser.add_argument("--drain-ms", type=int, default=int(drain_seconds() * 1000),
                        help="after SIGTERM, keep serving this long (default LATTICE_HOOK_DRAIN_MS or 6000)")
    parser.add_argument("--tls-cert", help="serve TLS with this certificate (chain), PEM")
    parser.add_argument("--tls-key", help="the certificate's private key, PEM")
    parser.add_argument("--tls-client-ca", help="require client certificates signed by this CA (PEM): mutual TLS")
    parser.add_argument("--log-format", choices=("text", "json"), default="text", help="log lines on stderr")
    return parser


def serve_args(hook: Any, args: argparse.Namespace, parser: Optional[argparse.ArgumentParser] = None) -> None:
    """Serves `hook` as the flags of `add_arguments` say."""
    if bool(args.tls_cert) != bool(args.tls_key) or (args.tls_client_ca and not args.tls_cert):
        message = "--tls-cert and --tls-key go together; --tls-client-ca needs them"
        if parser is not None:
            parser.error(message)
        raise ValueError(message)
    init_logs(args.log_format)
    tls = Tls.from_files(args.tls_cert, args.tls_key, args.tls_client_ca) if args.tls_cert else None
    serve(hook, args.listen, tls=tls, drain=args.drain_ms / 1000)


def run(hook: Any, *, listen: str = "127.0.0.1:50074", description: Optional[str] = None,
        argv: Optional[Sequence[str]] = None) -> None:
    """A hook's whole `main`: parses the standard flags (see
    `add_arguments`) and serves `hook` until SIGTERM, then drains."""
    parser = add_arguments(argparse.ArgumentParser(description=description), listen)
    serve_args(hook, parser.parse_args(argv), parser)
