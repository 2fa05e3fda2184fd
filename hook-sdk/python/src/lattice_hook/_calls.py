"""What a hook receives (a tool result, a model request, the call's trace
context) and returns, with helpers for the common edits."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Optional, Sequence, Union

from google.protobuf import json_format

from lattice_hook.pb.lattice.agent.v1 import content_pb2
from lattice_hook.pb.lattice.hooks.v1 import hooks_pb2

Message = content_pb2.Message
ContentBlock = content_pb2.ContentBlock
TextBlock = content_pb2.TextBlock
ToolUseBlock = content_pb2.ToolUseBlock
ToolResultBlock = content_pb2.ToolResultBlock
ToolSpec = content_pb2.ToolSpec
Role = content_pb2.Role
HookContext = hooks_pb2.HookContext
ToolError = hooks_pb2.ToolError
ResultSource = hooks_pb2.ResultSource


@dataclasses.dataclass(frozen=True)
class TraceParent:
    """The W3C trace context of a call: Lattice sends the `traceparent` of
    its `hook` span with every call when it exports OpenTelemetry traces."""

    trace_id: str
    """32 lowercase hex digits."""
    parent_span_id: str
    """The id of Lattice's `hook` span: 16 lowercase hex digits."""
    sampled: bool

    @staticmethod
    def parse(value: str) -> Optional["TraceParent"]:
        """Parses a `traceparent` value (version 00); None if malformed or
        all-zero."""
        parts = value.strip().split("-")
        if len(parts) != 4:
            return None
        version, trace_id, span_id, flags = parts
        if version != "00" or not (_hex(trace_id, 32) and _hex(span_id, 16) and _hex(flags, 2)):
            return None
        if trace_id == "0" * 32 or span_id == "0" * 16:
            return None
        return TraceParent(trace_id, span_id, int(flags, 16) & 1 == 1)

    @property
    def header(self) -> str:
        """The `traceparent` header value."""
        return f"00-{self.trace_id}-{self.parent_span_id}-{'01' if self.sampled else '00'}"


def _hex(s: str, n: int) -> bool:
    return len(s) == n and all(c in "0123456789abcdef" for c in s)


def trace_of(metadata: Iterable[tuple[str, Any]] | None) -> Optional[TraceParent]:
    """The call's trace context, from its `traceparent` metadata."""
    for key, value in metadata or ():
        if key == "traceparent" and isinstance(value, str):
            return TraceParent.parse(value)
    return None


class _Call:
    __slots__ = ("request", "_context", "_trace", "_trace_read")

    request: Any

    def __init__(self, request: Any, context: Any = None) -> None:
        """`context` is the call's grpc context, or its metadata (pairs of
        key and value), or None."""
        self.request = request
        self._context = context
        self._trace: Optional[TraceParent] = None
        self._trace_read = False

    @property
    def context(self) -> HookContext:
        """Where the call comes from: agent, session, query, turn and the
        chain's version."""
        context: HookContext = self.request.context
        return context

    @property
    def trace(self) -> Optional[TraceParent]:
        """The trace this call belongs to, when Lattice exports traces."""
        if not self._trace_read:
            # Read when first asked for: most calls never are.
            context = self._context
            metadata = context.invocation_metadata() if hasattr(context, "invocation_metadata") else context
            self._trace = trace_of(metadata)
            self._trace_read = True
        return self._trace


class ToolResultCall(_Call):
    """A tool result on its way to the model (`OnToolResult`). The wire
    request is `request`; the common parts are properties."""

    __slots__ = ()

    request: hooks_pb2.OnToolResultRequest

    @property
    def tool_name(self) -> str:
        """The tool the model called."""
        return self.request.tool_name

    @property
    def tool_use_id(self) -> str:
        """The id of the model's tool_use block; a replacement keeps it."""
        return self.request.tool_use_id

    @property
    def input(self) -> dict[str, Any]:
        """The input the model sent to the tool, as JSON values."""
        return json_format.MessageToDict(self.request.input)

    @property
    def result(self) -> ToolResultBlock:
        """The result as it stands after the previous hooks."""
        return self.request.result

    @property
    def error(self) -> Optional[ToolError]:
        """Why the call did not execute successfully, if so."""
        return self.request.error if self.request.HasField("error") else None

    @property
    def source(self) -> Optional[ResultSource]:
        """What produced the result."""
        return self.request.source if self.request.HasField("source") else None

    @property
    def text(self) -> str:
        """The result's text (its text blocks, concatenated)."""
        return text_of(self.request.result)

    def replace_text(self, text: str) -> ToolResultBlock:
        """A replacement of the result: one text block `text`, the same
        `tool_use_id` and `is_error`."""
        return with_text(self.request.result, text)


class ModelRequestCall(_Call):
    """A model request about to be sent (`OnModelRequest`)."""

    __slots__ = ()

    request: hooks_pb2.OnModelRequestRequest

    @property
    def system(self) -> str:
        """The system prompt, as it stands after the previous hooks."""
        return self.request.system

    @property
    def messages(self) -> Sequence[Message]:
        """The messages, as they stand after the previous hooks."""
        return self.request.messages

    @property
    def tools(self) -> Sequence[ToolSpec]:
        """The tools offered to the model (read-only)."""
        return self.request.tools

    @property
    def omitted_messages(self) -> int:
        """How many of the oldest messages were left out to fit the hook
        message limit (0 when none)."""
        return self.request.omitted_messages


@dataclasses.dataclass
class ModelRequestChange:
    """A hook's change to a model request, for this one request. None keeps
    that part; a value replaces it (an empty message list is a real, and
    invalid, replacement)."""

    system: Optional[str] = None
    messages: Optional[Sequence[Message]] = None


ToolResultReply = Union[ToolResultBlock, str, None]
"""What `on_tool_result` returns: None keeps the result, a
`ToolResultBlock` replaces it, a `str` replaces its text (`replace_text`)."""

ModelRequestReply = Optional[ModelRequestChange]
"""What `on_model_request` returns: None keeps the request."""


def text_of(result: ToolResultBlock) -> str:
    """The concatenated text of a tool result."""
    return "".join(block.text for block in result.content)


def with_text(result: ToolResultBlock, text: str) -> ToolResultBlock:
    """A copy of `result` whose content is the one text block `text`."""
    return ToolResultBlock(
        tool_use_id=result.tool_use_id, content=[TextBlock(text=text)], is_error=result.is_error
    )


def text_message(role: Role, text: str) -> Message:
    """A message of `role` (`Role.ROLE_USER`, …) with one text block."""
    return Message(role=role, content=[ContentBlock(text=TextBlock(text=text))])


def drop_messages(messages: Sequence[Message], drop: Union[Iterable[int], Callable[[int, Message], bool]]) -> list[Message]:
    """The messages without those dropped (by index, or where
    `drop(index, message)` is true), still a conversation Lattice accepts:
    a tool_use and its tool_result go together (dropping either drops the
    other), messages left empty go, neighbours of the same role are merged,
    and it starts with a user message. The input is not changed."""
    if callable(drop):
        gone = {i for i, m in enumerate(messages) if drop(i, m)}
    else:
        gone = set(drop)
    kept = [_copy(m) for i, m in enumerate(messages) if i not in gone]
    while True:
        uses = {b.tool_use.id for m in kept for b in m.content if b.HasField("tool_use")}
        results = {b.tool_result.tool_use_id for m in kept for b in m.content if b.HasField("tool_result")}
        changed = False
        for m in kept:
            blocks = [
                b for b in m.content
                if not (b.HasField("tool_use") and b.tool_use.id not in results)
                and not (b.HasField("tool_result") and b.tool_result.tool_use_id not in uses)
            ]
            if len(blocks) != len(m.content):
                del m.content[:]
                m.content.extend(blocks)
                changed = True
        merged: list[Message] = []
        for m in kept:
            if not m.content:
                changed = True
            elif merged and merged[-1].role == m.role:
                merged[-1].content.extend(m.content)
                changed = True
            else:
                merged.append(m)
        while merged and merged[0].role != Role.ROLE_USER:
            merged.pop(0)
            changed = True
        kept = merged
        if not changed:
            return kept


def _copy(m: Message) -> Message:
    copy = Message()
    copy.CopyFrom(m)
    return copy
