"""Write Lattice hook services in Python.

A hook sees, and may replace, what a Lattice agent sends to its model: each
tool result on its way back (`on_tool_result`) and each model request before
it is sent (`on_model_request`). A hook is any object with one or both
methods (plain or `async`), or `hook(on_tool_result=f)`; each takes the call
and returns a replacement or None (keep)::

    import lattice_hook

    class Shout:
        def on_tool_result(self, call):
            return call.text.upper()        # a str replaces the result's text

    lattice_hook.run(Shout())               # --listen, --tls-cert, … ; drains on SIGTERM

`serve(hook, addr)` serves with grpc.health.v1, reflection, Lattice's
message limit and a drain on SIGTERM; `serve_async` does so in a running
event loop. Raising `HookError` refuses the value (Lattice aborts the
query); any other exception answers INTERNAL without its text.
"""

from lattice_hook._calls import (
    ContentBlock,
    HookContext,
    Message,
    ModelRequestCall,
    ModelRequestChange,
    ModelRequestReply,
    ResultSource,
    Role,
    TextBlock,
    ToolError,
    ToolResultBlock,
    ToolResultCall,
    ToolResultReply,
    ToolSpec,
    ToolUseBlock,
    TraceParent,
    drop_messages,
    text_message,
    text_of,
    with_text,
)
from lattice_hook._logs import init_logs, log
from lattice_hook._serve import (
    DEFAULT_DRAIN_SECONDS,
    DEFAULT_MAX_MESSAGE_BYTES,
    DRAIN_ENV,
    MAX_MESSAGE_BYTES_ENV,
    HookError,
    Tls,
    add_arguments,
    hook,
    message_limit,
    run,
    serve,
    serve_args,
    serve_async,
    service_handler,
)

__all__ = [
    "ContentBlock", "HookContext", "Message", "ModelRequestCall", "ModelRequestChange", "ModelRequestReply",
    "ResultSource", "Role", "TextBlock", "ToolError", "ToolResultBlock", "ToolResultCall", "ToolResultReply",
    "ToolSpec", "ToolUseBlock", "TraceParent", "drop_messages", "text_message", "text_of", "with_text",
    "init_logs", "log", "DEFAULT_DRAIN_SECONDS", "DEFAULT_MAX_MESSAGE_BYTES", "DRAIN_ENV", "MAX_MESSAGE_BYTES_ENV",
    "HookError", "Tls", "add_arguments", "hook", "message_limit", "run", "serve", "serve_args", "serve_async",
    "service_handler",
]
