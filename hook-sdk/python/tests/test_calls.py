"""The call objects and the editing helpers."""

import unittest

import lattice_hook as lh
from lattice_hook.pb.lattice.agent.v1 import content_pb2 as c
from lattice_hook.pb.lattice.hooks.v1 import hooks_pb2


def use(id_):
    return c.ContentBlock(tool_use=c.ToolUseBlock(id=id_, name="t"))


def result(id_):
    return c.ContentBlock(tool_result=c.ToolResultBlock(tool_use_id=id_, content=[c.TextBlock(text="r")]))


def msg(role, *blocks):
    return c.Message(role=role, content=list(blocks))


def text(t):
    return c.ContentBlock(text=c.TextBlock(text=t))


U, A = lh.Role.ROLE_USER, lh.Role.ROLE_ASSISTANT


def shape(messages):
    """Each message as its role and its blocks' kinds and ids."""
    out = []
    for m in messages:
        blocks = []
        for b in m.content:
            kind = b.WhichOneof("block")
            blocks.append(
                {"text": lambda: b.text.text, "tool_use": lambda: "use:" + b.tool_use.id,
                 "tool_result": lambda: "result:" + b.tool_result.tool_use_id}[kind]()
            )
        out.append(("U" if m.role == U else "A", blocks))
    return out


class TraceParentTest(unittest.TestCase):
    def test_parsed_strictly(self):
        t = lh.TraceParent.parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
        self.assertEqual((t.trace_id, t.parent_span_id, t.sampled),
                         ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7", True))
        self.assertEqual(t.header, "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
        for bad in [
            "",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
        ]:
            self.assertIsNone(lh.TraceParent.parse(bad), bad)
        self.assertFalse(lh.TraceParent.parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00").sampled)


class ToolResultCallTest(unittest.TestCase):
    def test_text_and_a_replacement_keeping_the_id(self):
        request = hooks_pb2.OnToolResultRequest(
            tool_name="lookup", tool_use_id="t1",
            result=c.ToolResultBlock(tool_use_id="t1", content=[c.TextBlock(text="a"), c.TextBlock(text="b")],
                                     is_error=True),
        )
        request.input.update({"city": "Paris", "n": 2.5, "nested": {"deep": True}})
        call = lh.ToolResultCall(request, (("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),))
        self.assertEqual(call.text, "ab")
        self.assertEqual(call.input, {"city": "Paris", "n": 2.5, "nested": {"deep": True}})
        self.assertIsNone(call.error)
        self.assertEqual(call.trace.trace_id, "4bf92f3577b34da6a3ce929d0e0e4736")
        out = call.replace_text("x")
        self.assertEqual((out.tool_use_id, [b.text for b in out.content], out.is_error), ("t1", ["x"], True))
        self.assertIsNone(lh.ToolResultCall(request, ()).trace)


class DropMessagesTest(unittest.TestCase):
    conversation = [
        msg(U, text("q")),
        msg(A, use("x")),
        msg(U, result("x")),
        msg(A, text("thinking"), use("y")),
        msg(U, result("y"), text("more")),
        msg(A, text("answer")),
    ]

    def test_dropping_a_result_drops_its_use_and_what_empties(self):
        out = lh.drop_messages(self.conversation, [2])
        self.assertEqual(shape(out), [("U", ["q"]), ("A", ["thinking", "use:y"]), ("U", ["result:y", "more"]),
                                      ("A", ["answer"])])

    def test_dropping_a_use_drops_its_result_and_merges_neighbours(self):
        out = lh.drop_messages(self.conversation, lambda i, m: i == 3)
        self.assertEqual(shape(out), [("U", ["q"]), ("A", ["use:x"]), ("U", ["result:x", "more"]), ("A", ["answer"])])

    def test_it_starts_with_a_user_message_and_leaves_the_input_alone(self):
        out = lh.drop_messages(self.conversation, [0])
        # Without "q", the assistant's tool_use leads and goes, and with it
        # its result; then the next assistant message leads, and so on.
        self.assertEqual(shape(out), [("U", ["more"]), ("A", ["answer"])])
        self.assertEqual(len(self.conversation), 6)
        self.assertEqual(shape(self.conversation)[2], ("U", ["result:x"]))

    def test_every_use_is_answered_in_the_next_message(self):
        for i in range(len(self.conversation)):
            for j in range(len(self.conversation)):
                out = lh.drop_messages(self.conversation, {i, j})
                for k, m in enumerate(out):
                    self.assertEqual(m.role, U if k % 2 == 0 else A, (i, j))
                    uses = {b.tool_use.id for b in m.content if b.HasField("tool_use")}
                    if uses:
                        answered = {b.tool_result.tool_use_id for b in out[k + 1].content
                                    if b.HasField("tool_result")}
                        self.assertEqual(uses, answered, (i, j))


if __name__ == "__main__":
    unittest.main()
