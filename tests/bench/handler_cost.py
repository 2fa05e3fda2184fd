"""What the lattice_hook package adds to one call in Python, without gRPC's
transport: the package's handler (call object, trace context for log
lines, reply) around upper_sdk.Upper against upper_bare's servicer method,
each deserializing the same 1 KiB request and serializing its reply, in
one process, alternating (lattice-sdkbench prints it)."""

import os
import sys
import timeit

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import upper_bare  # noqa: E402
import upper_sdk  # noqa: E402
from lattice_hook import _serve  # noqa: E402
from lattice_hook.pb.lattice.agent.v1 import content_pb2  # noqa: E402
from lattice_hook.pb.lattice.hooks.v1 import hooks_pb2  # noqa: E402


class Context:
    def invocation_metadata(self):
        return ()


def main():
    size = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
    block = content_pb2.ToolResultBlock(tool_use_id="t1", content=[content_pb2.TextBlock(text="x" * size)])
    data = hooks_pb2.OnToolResultRequest(tool_use_id="t1", result=block).SerializeToString()
    context = Context()
    handler = _serve._method_handlers(upper_sdk.Upper(), False)["OnToolResult"]
    servicer = upper_bare.Upper()

    def sdk():
        reply = handler.unary_unary(handler.request_deserializer(data), context)
        handler.response_serializer(reply)

    def bare():
        reply = servicer.OnToolResult(hooks_pb2.OnToolResultRequest.FromString(data), context)
        reply.SerializeToString()

    best = {"sdk": float("inf"), "bare": float("inf")}
    for _ in range(5):
        for name, f in (("sdk", sdk), ("bare", bare)):
            n = 50_000
            best[name] = min(best[name], timeit.timeit(f, number=n) / n)
    print(f"{best['sdk'] * 1e6:.2f} {best['bare'] * 1e6:.2f}")


if __name__ == "__main__":
    main()
