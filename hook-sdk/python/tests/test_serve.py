"""The server, called over gRPC on loopback: replies, refusals, exceptions,
health through a drain, message limits, trace context in log lines, and the
asyncio server alike."""

import asyncio
import io
import json
import logging
import threading
import time
import unittest

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

import lattice_hook as lh
from lattice_hook.pb.lattice.agent.v1 import content_pb2 as c
from lattice_hook.pb.lattice.hooks.v1 import hooks_pb2, hooks_pb2_grpc

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
SECRET = "4111 1111 1111 1111"


def request(text, id_="t1"):
    return hooks_pb2.OnToolResultRequest(
        tool_name="lookup", tool_use_id=id_,
        result=c.ToolResultBlock(tool_use_id=id_, content=[c.TextBlock(text=text)]),
    )


class Upper:
    """Replaces with upper case; keeps "keep"; refuses "refuse"; raises on
    "boom" (with the text in the exception); sleeps on "slow"."""

    def on_tool_result(self, call):
        lh.log("tool result checked", bytes=len(call.text))
        if call.text == "keep":
            return None
        if call.text == "refuse":
            raise lh.HookError(grpc.StatusCode.PERMISSION_DENIED, "not this one")
        if call.text.startswith("boom"):
            raise ValueError(f"cannot parse {call.text!r}")
        if call.text == "slow":
            time.sleep(0.4)
        if call.text == "block":
            return call.replace_text("as a block")
        if call.text == "wrong":
            return 42
        return call.text.upper()


class AsyncUpper:
    async def on_tool_result(self, call):
        lh.log("tool result checked", bytes=len(call.text))
        if call.text.startswith("boom"):
            raise ValueError(f"cannot parse {call.text!r}")
        if call.text == "slow":
            await asyncio.sleep(0.4)
        return call.text.upper()

    async def on_model_request(self, call):
        return lh.ModelRequestChange(system=call.system + "!", messages=lh.drop_messages(call.messages, [1, 2]))


class Captured:
    """The JSON log lines written while a test runs."""

    def __enter__(self):
        self.stream = io.StringIO()
        self.handler = logging.StreamHandler(self.stream)
        self.handler.setFormatter(lh._logs.JsonFormatter())
        logging.getLogger().addHandler(self.handler)
        logging.getLogger().setLevel(logging.INFO)
        return self

    def __exit__(self, *exc):
        logging.getLogger().removeHandler(self.handler)

    def lines(self):
        return [json.loads(line) for line in self.stream.getvalue().splitlines()]


class Served:
    """A hook served in a background thread on a free port."""

    def __init__(self, hook, drain=0.0, **kwargs):
        self.stop = threading.Event()
        ready = threading.Event()
        port = []
        asynchronous = lh._serve.is_async(hook)

        def run():
            if asynchronous:
                async def main():
                    self.loop = asyncio.get_running_loop()
                    self.async_stop = asyncio.Event()
                    await lh.serve_async(hook, "127.0.0.1:0", drain=drain, stop=self.async_stop, announce=False,
                                         ready=lambda p: (port.append(p), ready.set()), **kwargs)

                asyncio.run(main())
            else:
                lh.serve(hook, "127.0.0.1:0", drain=drain, stop=self.stop, announce=False,
                         ready=lambda p: (port.append(p), ready.set()), **kwargs)

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert ready.wait(10), "the server did not start"
        self.port = port[0]
        self.asynchronous = asynchronous
        self.channel = grpc.insecure_channel(
            f"127.0.0.1:{self.port}", options=[("grpc.max_send_message_length", 64 << 20),
                                                ("grpc.max_receive_message_length", 64 << 20)])
        self.hooks = hooks_pb2_grpc.HookServiceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def shutdown(self):
        if self.asynchronous:
            self.loop.call_soon_threadsafe(self.async_stop.set)
        else:
            self.stop.set()

    def status(self, service=""):
        return self.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status

    def close(self):
        if self.thread.is_alive():
            self.shutdown()
        self.thread.join(10)
        self.channel.close()


class Common:
    """What the sync and the asyncio servers both do."""

    hook = Upper

    def setUp(self):
        self.served = Served(self.hook())

    def tearDown(self):
        self.served.close()

    def call(self, text, metadata=()):
        return self.served.hooks.OnToolResult(request(text), timeout=5, metadata=metadata)

    def test_a_str_replaces_the_text_keeping_the_id(self):
        reply = self.call("hello")
        self.assertTrue(reply.HasField("result"))
        self.assertEqual((reply.result.tool_use_id, [b.text for b in reply.result.content]), ("t1", ["HELLO"]))

    def test_an_exception_answers_internal_without_its_text(self):
        with Captured() as logs:
            with self.assertRaises(grpc.RpcError) as raised:
                self.call(f"boom {SECRET}")
        self.assertEqual(raised.exception.code(), grpc.StatusCode.INTERNAL)
        self.assertEqual(raised.exception.details(), "the hook raised an exception")
        written = json.dumps(logs.lines())
        self.assertIn("ValueError", written)
        self.assertNotIn(SECRET, written)
        self.assertEqual(self.call("after").result.content[0].text, "AFTER", "it goes on serving")

    def test_health_serves_then_drains(self):
        self.assertEqual(self.served.status(), health_pb2.HealthCheckResponse.SERVING)
        self.assertEqual(self.served.status(lh._serve.SERVICE), health_pb2.HealthCheckResponse.SERVING)

    def test_a_request_over_grpcs_default_limit_is_served(self):
        big = "x" * (6 << 20)
        self.assertEqual(len(self.call(big).result.content[0].text), 6 << 20)

    def test_log_lines_in_a_call_carry_its_trace(self):
        with Captured() as logs:
            self.call("traced", metadata=(("traceparent", TRACEPARENT),))
            self.call("untraced")
        checked = [line for line in logs.lines() if line["message"] == "tool result checked"]
        self.assertEqual(checked[0]["trace_id"], "4bf92f3577b34da6a3ce929d0e0e4736")
        self.assertEqual(checked[0]["parent_span_id"], "00f067aa0ba902b7")
        self.assertEqual(checked[0]["bytes"], 6)
        self.assertNotIn("trace_id", checked[1], "the trace does not outlive its call")


class SyncServeTest(Common, unittest.TestCase):
    def test_none_keeps_and_a_block_replaces(self):
        self.assertFalse(self.call("keep").HasField("result"))
        self.assertEqual(self.call("block").result.content[0].text, "as a block")

    def test_a_hook_error_is_the_calls_status(self):
        with self.assertRaises(grpc.RpcError) as raised:
            self.call("refuse")
        self.assertEqual((raised.exception.code(), raised.exception.details()),
                         (grpc.StatusCode.PERMISSION_DENIED, "not this one"))

    def test_a_wrong_return_type_answers_internal(self):
        with self.assertRaises(grpc.RpcError) as raised:
            self.call("wrong")
        self.assertEqual(raised.exception.code(), grpc.StatusCode.INTERNAL)

    def test_an_event_the_hook_does_not_handle_is_unimplemented(self):
        with self.assertRaises(grpc.RpcError) as raised:
            self.served.hooks.OnModelRequest(hooks_pb2.OnModelRequestRequest(), timeout=5)
        self.assertEqual(raised.exception.code(), grpc.StatusCode.UNIMPLEMENTED)
        self.assertIn("tool_result event only", raised.exception.details())


class AsyncServeTest(Common, unittest.TestCase):
    hook = AsyncUpper

    def test_a_model_request_change(self):
        U, A = lh.Role.ROLE_USER, lh.Role.ROLE_ASSISTANT
        messages = [lh.text_message(U, "q"), lh.text_message(A, "a"), lh.text_message(U, "q2"),
                    lh.text_message(A, "a2")]
        reply = self.served.hooks.OnModelRequest(
            hooks_pb2.OnModelRequestRequest(system="s", messages=messages), timeout=5)
        self.assertEqual(reply.system, "s!")
        self.assertEqual([m.content[0].text.text for m in reply.messages.messages], ["q", "a2"])


class DrainTest(unittest.TestCase):
    """Asked to stop, health says NOT_SERVING at once, the call in flight
    completes, calls still arriving are served for the drain period, and
    only then does serve() return."""

    def check(self, hook):
        served = Served(hook, drain=1.2)
        try:
            self.assertEqual(served.status(), health_pb2.HealthCheckResponse.SERVING)
            in_flight = served.hooks.OnToolResult.future(request("slow"), timeout=5)
            time.sleep(0.1)
            signalled = time.monotonic()
            served.shutdown()
            time.sleep(0.1)
            self.assertEqual(served.status(), health_pb2.HealthCheckResponse.NOT_SERVING)
            self.assertEqual(in_flight.result().result.content[0].text, "SLOW")
            self.assertEqual(served.hooks.OnToolResult(request("during"), timeout=5).result.content[0].text, "DURING")
            with grpc.insecure_channel(f"127.0.0.1:{served.port}") as fresh:
                reply = hooks_pb2_grpc.HookServiceStub(fresh).OnToolResult(request("fresh"), timeout=5)
                self.assertEqual(reply.result.content[0].text, "FRESH")
            served.thread.join(10)
            self.assertFalse(served.thread.is_alive(), "serve() returns after the drain")
            self.assertGreaterEqual(time.monotonic() - signalled, 1.2)
        finally:
            served.close()

    def test_sync(self):
        self.check(Upper())

    def test_asyncio(self):
        self.check(AsyncUpper())


class LogsTest(unittest.TestCase):
    def test_a_logged_exception_is_kept_and_text_lines_stay_on_their_line(self):
        with Captured() as logs:
            try:
                raise ValueError("bad")
            except ValueError:
                logging.getLogger("hook").exception("failed")
        (line,) = logs.lines()
        self.assertEqual(line["level"], "error")
        self.assertIn("ValueError: bad", line["exception"])
        record = logging.LogRecord("hook", logging.INFO, "f", 1, "two\nlines", None, None)
        record.lattice_fields = {"id": "a\nb", "ok": True}
        self.assertEqual(lh._logs.TextFormatter().format(record).split(" ", 2)[2], "two\\nlines id=a\\nb ok=true")


class HookTest(unittest.TestCase):
    def test_functions_and_mixtures(self):
        self.assertFalse(lh._serve.is_async(lh.hook(on_tool_result=lambda call: None)))

        async def f(call):
            return None

        self.assertTrue(lh._serve.is_async(lh.hook(on_model_request=f)))
        with self.assertRaises(TypeError):
            lh._serve.is_async(lh.hook(on_tool_result=lambda call: None, on_model_request=f))
        with self.assertRaises(TypeError):
            lh.hook()
        with self.assertRaises(TypeError):
            lh._serve.is_async(object())


if __name__ == "__main__":
    unittest.main()
