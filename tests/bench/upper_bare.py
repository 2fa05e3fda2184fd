"""The benchmark's reference: the same hook as upper_sdk.py on bare grpcio
(the generated servicer, the same thread pool and message limits), with no
health, drain or trace context (lattice-sdkbench)."""

import argparse
import signal
import threading
from concurrent import futures

import grpc
from lattice_hook.pb.lattice.agent.v1 import content_pb2
from lattice_hook.pb.lattice.hooks.v1 import hooks_pb2, hooks_pb2_grpc


class Upper(hooks_pb2_grpc.HookServiceServicer):
    def OnToolResult(self, request, context):
        result = request.result
        text = "".join(block.text for block in result.content).upper()
        block = content_pb2.ToolResultBlock(
            tool_use_id=result.tool_use_id, content=[content_pb2.TextBlock(text=text)], is_error=result.is_error
        )
        return hooks_pb2.OnToolResultResponse(result=block)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--listen", default="127.0.0.1:0")
    args = parser.parse_args()
    limit = 16 * 1024 * 1024
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=16),
        options=[("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)],
    )
    hooks_pb2_grpc.add_HookServiceServicer_to_server(Upper(), server)
    port = server.add_insecure_port(args.listen)
    server.start()
    print(f"listening on {port}", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    server.stop(grace=1).wait()


if __name__ == "__main__":
    main()
