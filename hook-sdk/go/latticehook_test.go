package latticehook

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	agentv1 "lattice.dev/proto/lattice/agent/v1"
	hooksv1 "lattice.dev/proto/lattice/hooks/v1"
)

const secret = "4111 1111 1111 1111"

func request(text string) *hooksv1.OnToolResultRequest {
	return &hooksv1.OnToolResultRequest{ToolName: "lookup", ToolUseId: "t1",
		Result: &ToolResultBlock{ToolUseId: "t1", Content: []*TextBlock{{Text: text}}}}
}

// upper replaces with upper case; keeps "keep"; refuses "refuse"; fails
// with the text on "fail"; panics with the text on "boom"; sleeps on "slow".
type upper struct{}

func (upper) OnToolResult(ctx context.Context, call *ToolResultCall) (*ToolResultBlock, error) {
	Log(ctx, "tool result checked", "bytes", len(call.Text()))
	switch text := call.Text(); {
	case text == "keep":
		return nil, nil
	case text == "refuse":
		return nil, status.Error(codes.PermissionDenied, "not this one")
	case strings.HasPrefix(text, "fail"):
		return nil, fmt.Errorf("cannot parse %q", text)
	case strings.HasPrefix(text, "boom"):
		panic("cannot parse " + text)
	case text == "slow":
		time.Sleep(400 * time.Millisecond)
	}
	return call.ReplaceText(strings.ToUpper(call.Text())), nil
}

type served struct {
	port   int
	cancel context.CancelFunc
	done   chan error
	conn   *grpc.ClientConn
	hooks  hooksv1.HookServiceClient
	health healthpb.HealthClient
}

func serve(t *testing.T, hook interface{}, drain time.Duration) *served {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	s := &served{port: lis.Addr().(*net.TCPAddr).Port, cancel: cancel, done: make(chan error, 1)}
	ready := make(chan struct{})
	go func() {
		s.done <- Serve(ctx, hook, "", WithListener(lis), WithDrain(drain), Quiet(), WithReady(func(int) { close(ready) }))
	}()
	<-ready
	s.conn, err = grpc.Dial(lis.Addr().String(), grpc.WithInsecure(),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(64<<20), grpc.MaxCallSendMsgSize(64<<20)))
	if err != nil {
		t.Fatal(err)
	}
	s.hooks, s.health = hooksv1.NewHookServiceClient(s.conn), healthpb.NewHealthClient(s.conn)
	t.Cleanup(func() { cancel(); s.conn.Close() })
	return s
}

func (s *served) call(t *testing.T, ctx context.Context, text string) (*hooksv1.OnToolResultResponse, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	return s.hooks.OnToolResult(ctx, request(text))
}

func (s *served) status(t *testing.T) healthpb.HealthCheckResponse_ServingStatus {
	t.Helper()
	r, err := s.health.Check(context.Background(), &healthpb.HealthCheckRequest{})
	if err != nil {
		t.Fatal(err)
	}
	return r.Status
}

type captured struct {
	sync.Mutex
	bytes.Buffer
}

func (c *captured) Write(p []byte) (int, error) { c.Lock(); defer c.Unlock(); return c.Buffer.Write(p) }
func (c *captured) String() string              { c.Lock(); defer c.Unlock(); return c.Buffer.String() }

func captureLogs(t *testing.T) *captured {
	c := &captured{}
	SetLogOutput(c)
	if err := SetLogFormat("json"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { SetLogOutput(nilWriter{}); _ = SetLogFormat("text") })
	return c
}

type nilWriter struct{}

func (nilWriter) Write(p []byte) (int, error) { return len(p), nil }

func TestRepliesRefusalsAndFailures(t *testing.T) {
	logs := captureLogs(t)
	s := serve(t, upper{}, 0)
	ctx := context.Background()
	reply, err := s.call(t, ctx, "hello")
	if err != nil || reply.GetResult().GetToolUseId() != "t1" || TextOf(reply.GetResult()) != "HELLO" {
		t.Fatalf("replace: %v %v", reply, err)
	}
	if reply, err := s.call(t, ctx, "keep"); err != nil || reply.Result != nil {
		t.Fatalf("keep: %v %v", reply, err)
	}
	if _, err := s.call(t, ctx, "refuse"); status.Code(err) != codes.PermissionDenied || status.Convert(err).Message() != "not this one" {
		t.Fatalf("refuse: %v", err)
	}
	for _, text := range []string{"fail " + secret, "boom " + secret} {
		_, err := s.call(t, ctx, text)
		if status.Code(err) != codes.Internal || strings.Contains(err.Error(), secret) {
			t.Fatalf("%s: %v", text[:4], err)
		}
	}
	if strings.Contains(logs.String(), secret) || !strings.Contains(logs.String(), "the hook panicked") {
		t.Fatalf("logs: %s", logs)
	}
	if !strings.Contains(logs.String(), "latticehook_test.go") {
		t.Fatalf("the panic's place is not logged: %s", logs)
	}
	if _, err := s.call(t, ctx, "after"); err != nil {
		t.Fatalf("it goes on serving: %v", err)
	}
	_, err = s.hooks.OnModelRequest(ctx, &hooksv1.OnModelRequestRequest{})
	if status.Code(err) != codes.Unimplemented || !strings.Contains(err.Error(), "tool_result event only") {
		t.Fatalf("unhandled event: %v", err)
	}
}

func TestLargeRequestsAndTraceContext(t *testing.T) {
	logs := captureLogs(t)
	s := serve(t, upper{}, 0)
	big := strings.Repeat("x", 6<<20)
	if reply, err := s.call(t, context.Background(), big); err != nil || len(TextOf(reply.GetResult())) != 6<<20 {
		t.Fatalf("a 6 MiB request: %v", err)
	}
	ctx := metadata.AppendToOutgoingContext(context.Background(), "traceparent",
		"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
	if _, err := s.call(t, ctx, "traced"); err != nil {
		t.Fatal(err)
	}
	if _, err := s.call(t, ctx, "boom"); status.Code(err) != codes.Internal {
		t.Fatalf("boom: %v", err)
	}
	var traced, panicked string
	for _, line := range strings.Split(logs.String(), "\n") {
		if strings.Contains(line, `"bytes":6`) {
			traced = line
		}
		if strings.Contains(line, "the hook panicked") {
			panicked = line
		}
	}
	for _, line := range []string{traced, panicked} {
		if !strings.Contains(line, `"trace_id":"4bf92f3577b34da6a3ce929d0e0e4736"`) || !strings.Contains(line, `"parent_span_id":"00f067aa0ba902b7"`) {
			t.Fatalf("a call's log line has no trace: %q", line)
		}
	}
}

// Asked to stop, health says NOT_SERVING at once, the call in flight
// completes, calls still arriving are served (on the open connection and
// on a new one) for the drain period, and only then does Serve return.
func TestDrain(t *testing.T) {
	drain := 1200 * time.Millisecond
	s := serve(t, upper{}, drain)
	if s.status(t) != healthpb.HealthCheckResponse_SERVING {
		t.Fatal("not SERVING")
	}
	inFlight := make(chan error, 1)
	go func() { _, err := s.call(t, context.Background(), "slow"); inFlight <- err }()
	time.Sleep(100 * time.Millisecond)
	signalled := time.Now()
	s.cancel()
	time.Sleep(100 * time.Millisecond)
	if s.status(t) != healthpb.HealthCheckResponse_NOT_SERVING {
		t.Fatal("still SERVING after the stop")
	}
	if err := <-inFlight; err != nil {
		t.Fatalf("the call in flight: %v", err)
	}
	if _, err := s.call(t, context.Background(), "during"); err != nil {
		t.Fatalf("during the drain: %v", err)
	}
	fresh, err := grpc.Dial(fmt.Sprintf("127.0.0.1:%d", s.port), grpc.WithInsecure())
	if err != nil {
		t.Fatal(err)
	}
	defer fresh.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := hooksv1.NewHookServiceClient(fresh).OnToolResult(ctx, request("fresh")); err != nil {
		t.Fatalf("a new connection during the drain: %v", err)
	}
	select {
	case err := <-s.done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Serve did not return")
	}
	if since := time.Since(signalled); since < drain {
		t.Fatalf("stopped after %v, before the drain", since)
	}
}

func TestFuncsAndHooksThatHandleNothing(t *testing.T) {
	s := serve(t, Funcs{ModelRequest: func(ctx context.Context, call *ModelRequestCall) (*ModelRequestChange, error) {
		system := call.GetSystem() + "!"
		return &ModelRequestChange{System: &system}, nil
	}}, 0)
	reply, err := s.hooks.OnModelRequest(context.Background(), &hooksv1.OnModelRequestRequest{System: "s"})
	if err != nil || reply.System == nil || *reply.System != "s!" || reply.Messages != nil {
		t.Fatalf("%v %v", reply, err)
	}
	if _, err := s.call(t, context.Background(), "x"); status.Code(err) != codes.Unimplemented {
		t.Fatalf("%v", err)
	}
	if err := Serve(context.Background(), struct{}{}, "127.0.0.1:0"); err == nil {
		t.Fatal("a hook with no method is served")
	}
}

func TestTraceParentIsParsedStrictly(t *testing.T) {
	tp := ParseTraceParent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
	if tp == nil || tp.TraceID != "4bf92f3577b34da6a3ce929d0e0e4736" || tp.ParentSpanID != "00f067aa0ba902b7" || !tp.Sampled {
		t.Fatalf("%+v", tp)
	}
	if tp.Header() != "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01" {
		t.Fatal(tp.Header())
	}
	for _, bad := range []string{
		"",
		"01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
		"00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
		"00-00000000000000000000000000000000-00f067aa0ba902b7-01",
		"00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
		"00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
		"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
	} {
		if ParseTraceParent(bad) != nil {
			t.Fatalf("%q parsed", bad)
		}
	}
	if ParseTraceParent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00").Sampled {
		t.Fatal("flags 00 sampled")
	}
}

func use(id string) *ContentBlock {
	return &ContentBlock{Block: &agentv1.ContentBlock_ToolUse{ToolUse: &ToolUseBlock{Id: id, Name: "t"}}}
}

func result(id string) *ContentBlock {
	return &ContentBlock{Block: &agentv1.ContentBlock_ToolResult{ToolResult: &ToolResultBlock{ToolUseId: id}}}
}

func text(s string) *ContentBlock {
	return &ContentBlock{Block: &agentv1.ContentBlock_Text{Text: &TextBlock{Text: s}}}
}

func shape(messages []*Message) string {
	var parts []string
	for _, m := range messages {
		var blocks []string
		for _, b := range m.GetContent() {
			switch {
			case b.GetToolUse() != nil:
				blocks = append(blocks, "use:"+b.GetToolUse().GetId())
			case b.GetToolResult() != nil:
				blocks = append(blocks, "result:"+b.GetToolResult().GetToolUseId())
			default:
				blocks = append(blocks, b.GetText().GetText())
			}
		}
		role := "U"
		if m.GetRole() == RoleAssistant {
			role = "A"
		}
		parts = append(parts, role+"["+strings.Join(blocks, ",")+"]")
	}
	return strings.Join(parts, " ")
}

func TestDropMessagesKeepsAConversation(t *testing.T) {
	msg := func(role Role, blocks ...*ContentBlock) *Message { return &Message{Role: role, Content: blocks} }
	conversation := []*Message{
		msg(RoleUser, text("q")),
		msg(RoleAssistant, use("x")),
		msg(RoleUser, result("x")),
		msg(RoleAssistant, text("thinking"), use("y")),
		msg(RoleUser, result("y"), text("more")),
		msg(RoleAssistant, text("answer")),
	}
	at := func(i int) func(int, *Message) bool { return func(j int, _ *Message) bool { return i == j } }
	for i, want := range map[int]string{
		2: "U[q] A[thinking,use:y] U[result:y,more] A[answer]",
		3: "U[q] A[use:x] U[result:x,more] A[answer]",
		0: "U[more] A[answer]",
	} {
		if got := shape(DropMessages(conversation, at(i))); got != want {
			t.Errorf("dropping %d: %s, want %s", i, got, want)
		}
	}
	if got := shape(conversation); got != "U[q] A[use:x] U[result:x] A[thinking,use:y] U[result:y,more] A[answer]" {
		t.Errorf("the input changed: %s", got)
	}
	for i := range conversation {
		for j := range conversation {
			out := DropMessages(conversation, func(k int, _ *Message) bool { return k == i || k == j })
			for k, m := range out {
				if (k%2 == 0) != (m.GetRole() == RoleUser) {
					t.Fatalf("dropping %d,%d: roles do not alternate: %s", i, j, shape(out))
				}
				for _, b := range m.GetContent() {
					if u := b.GetToolUse(); u != nil && !strings.Contains(shape(out[k+1:k+2]), "result:"+u.GetId()) {
						t.Fatalf("dropping %d,%d: %s is not answered next: %s", i, j, u.GetId(), shape(out))
					}
				}
			}
		}
	}
}
