package latticehook

import (
	"context"
	"strconv"
	"strings"

	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"
	agentv1 "lattice.dev/proto/lattice/agent/v1"
	hooksv1 "lattice.dev/proto/lattice/hooks/v1"
)

// The contract's types a hook reads and returns.
type (
	Message               = agentv1.Message
	ContentBlock          = agentv1.ContentBlock
	TextBlock             = agentv1.TextBlock
	ToolUseBlock          = agentv1.ToolUseBlock
	ToolResultBlock       = agentv1.ToolResultBlock
	ToolSpec              = agentv1.ToolSpec
	Role                  = agentv1.Role
	HookContext           = hooksv1.HookContext
	OnToolResultRequest   = hooksv1.OnToolResultRequest
	OnModelRequestRequest = hooksv1.OnModelRequestRequest
)

// The roles of a message.
const (
	RoleUser      = agentv1.Role_ROLE_USER
	RoleAssistant = agentv1.Role_ROLE_ASSISTANT
)

// ToolResultCall is a tool result on its way to the model (OnToolResult).
// The wire request is embedded: call.GetToolName(), call.GetResult(),
// call.GetContext(), …
type ToolResultCall struct {
	*OnToolResultRequest
	// Trace is the call's trace context when Lattice exports traces.
	Trace *TraceParent
}

// Text is the result's text (its text blocks, concatenated).
func (c *ToolResultCall) Text() string { return TextOf(c.GetResult()) }

// ReplaceText is a replacement of the result: one text block, the same
// tool_use_id and is_error.
func (c *ToolResultCall) ReplaceText(text string) *ToolResultBlock {
	return WithText(c.GetResult(), text)
}

// ModelRequestCall is a model request about to be sent (OnModelRequest).
// The wire request is embedded: call.GetSystem(), call.GetMessages(), …
type ModelRequestCall struct {
	*OnModelRequestRequest
	// Trace is the call's trace context when Lattice exports traces.
	Trace *TraceParent
}

// ModelRequestChange is a hook's change to one model request. A nil
// field keeps that part; a nil *ModelRequestChange keeps everything.
type ModelRequestChange struct {
	// System replaces the system prompt when not nil (even with "").
	System *string
	// Messages replaces the messages when not nil.
	Messages []*Message
}

// TextOf is the concatenated text of a tool result.
func TextOf(result *ToolResultBlock) string {
	var b strings.Builder
	for _, t := range result.GetContent() {
		b.WriteString(t.GetText())
	}
	return b.String()
}

// WithText is a copy of result whose content is the one text block text.
func WithText(result *ToolResultBlock, text string) *ToolResultBlock {
	return &ToolResultBlock{
		ToolUseId: result.GetToolUseId(),
		Content:   []*TextBlock{{Text: text}},
		IsError:   result.GetIsError(),
	}
}

// TextMessage is a message of role with one text block.
func TextMessage(role Role, text string) *Message {
	return &Message{Role: role, Content: []*ContentBlock{{Block: &agentv1.ContentBlock_Text{Text: &TextBlock{Text: text}}}}}
}

// DropMessages returns the messages without those for which drop is true,
// still a conversation Lattice accepts: a tool_use and its tool_result go
// together (dropping either drops the other), messages left empty go,
// neighbours of the same role are merged, and it starts with a user
// message. The input is not changed.
func DropMessages(messages []*Message, drop func(i int, m *Message) bool) []*Message {
	kept := make([]*Message, 0, len(messages))
	for i, m := range messages {
		if !drop(i, m) {
			kept = append(kept, proto.Clone(m).(*Message))
		}
	}
	for {
		uses, results := map[string]bool{}, map[string]bool{}
		for _, m := range kept {
			for _, b := range m.GetContent() {
				if u := b.GetToolUse(); u != nil {
					uses[u.GetId()] = true
				}
				if r := b.GetToolResult(); r != nil {
					results[r.GetToolUseId()] = true
				}
			}
		}
		changed := false
		for _, m := range kept {
			blocks := m.Content[:0:0]
			for _, b := range m.GetContent() {
				if u := b.GetToolUse(); u != nil && !results[u.GetId()] {
					continue
				}
				if r := b.GetToolResult(); r != nil && !uses[r.GetToolUseId()] {
					continue
				}
				blocks = append(blocks, b)
			}
			if len(blocks) != len(m.Content) {
				m.Content = blocks
				changed = true
			}
		}
		merged := make([]*Message, 0, len(kept))
		for _, m := range kept {
			switch {
			case len(m.Content) == 0:
				changed = true
			case len(merged) > 0 && merged[len(merged)-1].GetRole() == m.GetRole():
				last := merged[len(merged)-1]
				last.Content = append(last.Content, m.Content...)
				changed = true
			default:
				merged = append(merged, m)
			}
		}
		for len(merged) > 0 && merged[0].GetRole() != RoleUser {
			merged = merged[1:]
			changed = true
		}
		kept = merged
		if !changed {
			return kept
		}
	}
}

// TraceParent is the W3C trace context of a call: Lattice sends the
// traceparent of its hook span with every call when it exports
// OpenTelemetry traces.
type TraceParent struct {
	// TraceID is 32 lowercase hex digits.
	TraceID string
	// ParentSpanID is the id of Lattice's hook span: 16 lowercase hex digits.
	ParentSpanID string
	// Sampled says whether Lattice samples the trace.
	Sampled bool
}

// ParseTraceParent parses a traceparent value (version 00); nil if
// malformed or all-zero.
func ParseTraceParent(value string) *TraceParent {
	parts := strings.Split(strings.TrimSpace(value), "-")
	if len(parts) != 4 || parts[0] != "00" || !isHex(parts[1], 32) || !isHex(parts[2], 16) || !isHex(parts[3], 2) {
		return nil
	}
	if parts[1] == strings.Repeat("0", 32) || parts[2] == strings.Repeat("0", 16) {
		return nil
	}
	flags, _ := strconv.ParseUint(parts[3], 16, 8)
	return &TraceParent{TraceID: parts[1], ParentSpanID: parts[2], Sampled: flags&1 == 1}
}

// Header is the traceparent header value.
func (t *TraceParent) Header() string {
	flags := "00"
	if t.Sampled {
		flags = "01"
	}
	return "00-" + t.TraceID + "-" + t.ParentSpanID + "-" + flags
}

func isHex(s string, n int) bool {
	if len(s) != n {
		return false
	}
	for _, c := range s {
		if !(c >= '0' && c <= '9' || c >= 'a' && c <= 'f') {
			return false
		}
	}
	return true
}

type traceKey struct{}

// TraceFrom is the trace context of the call ctx belongs to, or nil.
func TraceFrom(ctx context.Context) *TraceParent {
	t, _ := ctx.Value(traceKey{}).(*TraceParent)
	return t
}

// withTrace is ctx with the trace context of its incoming traceparent.
func withTrace(ctx context.Context) context.Context {
	md, _ := metadata.FromIncomingContext(ctx)
	if values := md.Get("traceparent"); len(values) > 0 {
		if t := ParseTraceParent(values[0]); t != nil {
			return context.WithValue(ctx, traceKey{}, t)
		}
	}
	return ctx
}
