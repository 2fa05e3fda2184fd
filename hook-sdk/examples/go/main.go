// A Lattice redaction hook in Go (grpc-go), built from the .proto alone.
//
// It implements lattice.hooks.v1.HookService/OnToolResult: every tool
// result's text is scanned for emails, card numbers (Luhn-checked), phone
// numbers and API-key-like tokens, replaced by the same markers as the Rust
// and Python examples. A result with nothing to redact gets an empty reply,
// which Lattice reads as "keep". OnModelRequest is not implemented: register
// the hook for tool_result only.
//
// Like a production hook it serves grpc.health.v1 and reflection, drains on
// SIGTERM (health NOT_SERVING at once, calls served for -drain-ms, then a
// graceful stop), takes LATTICE_HOOK_MAX_MESSAGE_BYTES (16 MiB, Lattice's
// default) and logs one JSON line per event, never content. The first line
// on stdout is "listening on PORT". Build with ./build.sh; register it with
// deadline_ms = 5000 and check it with that deadline:
// `lattice hook check 127.0.0.1:50075 --events tool_result --deadline-ms 5000`.
// Go's regexp takes about 2 s over a tool result near Lattice's 16 MiB
// limit (measured on two cores), more than the default hook deadline of 1 s.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"net"
	"os"
	"os/signal"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/reflection"

	contentpb "lattice.dev/proto/lattice/agent/v1"
	hookspb "lattice.dev/proto/lattice/hooks/v1"
)

var (
	apiKey = regexp.MustCompile(`\b(?:sk_(?:live|test)_[A-Za-z0-9]{16,}|sk-[A-Za-z0-9_-]{20,}|gh[pousr]_[A-Za-z0-9]{30,}|AKIA[0-9A-Z]{16}|xox[abpr]-[A-Za-z0-9-]{10,}|(?:key|token)_[A-Za-z0-9]{24,})\b`)
	email  = regexp.MustCompile(`[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}`)
	digits = regexp.MustCompile(`\d(?:[ -]?\d){12,18}`)
	phone  = regexp.MustCompile(`(?:\+\d{1,3}[ .-]?)?(?:\(\d{1,4}\)[ .-]?)?\d{2,4}(?:[ .-]?\d{2,4}){1,4}`)
)

func luhn(number string) bool {
	total := 0
	for i := 0; i < len(number); i++ {
		d := int(number[len(number)-1-i] - '0')
		if i%2 == 1 {
			if d *= 2; d > 9 {
				d -= 9
			}
		}
		total += d
	}
	return total%10 == 0
}

// redact returns the text with sensitive values replaced, and how many.
func redact(text string) (string, int) {
	count := 0
	replace := func(marker string) func(string) string {
		return func(string) string { count++; return marker }
	}
	text = apiKey.ReplaceAllStringFunc(text, replace("[REDACTED:api_key]"))
	text = email.ReplaceAllStringFunc(text, replace("[REDACTED:email]"))
	text = digits.ReplaceAllStringFunc(text, func(m string) string {
		n := strings.NewReplacer(" ", "", "-", "").Replace(m)
		if len(n) >= 13 && len(n) <= 19 && luhn(n) {
			count++
			return "[REDACTED:card]"
		}
		return m
	})
	text = phone.ReplaceAllStringFunc(text, func(m string) string {
		n := 0
		for _, c := range m {
			if c >= '0' && c <= '9' {
				n++
			}
		}
		if n >= 7 && n <= 15 && strings.ContainsAny(m, "+ .-(") {
			count++
			return "[REDACTED:phone]"
		}
		return m
	})
	return text, count
}

// logLine writes one JSON line on stderr: sizes and counts, never content.
func logLine(message string, fields map[string]interface{}) {
	fields["ts"] = float64(time.Now().UnixNano()/1e6) / 1000
	fields["level"] = "info"
	fields["message"] = message
	line, _ := json.Marshal(fields)
	fmt.Fprintln(os.Stderr, string(line))
}

type redactHook struct {
	hookspb.UnimplementedHookServiceServer
}

func (redactHook) OnToolResult(ctx context.Context, req *hookspb.OnToolResultRequest) (*hookspb.OnToolResultResponse, error) {
	result := req.GetResult()
	total, size := 0, 0
	blocks := make([]*contentpb.TextBlock, 0, len(result.GetContent()))
	for _, b := range result.GetContent() {
		size += len(b.GetText())
		text, n := redact(b.GetText())
		total += n
		blocks = append(blocks, &contentpb.TextBlock{Text: text})
	}
	if err := ctx.Err(); err != nil {
		return nil, err // the deadline passed: Lattice has given up on this call
	}
	logLine("tool result checked", map[string]interface{}{
		"tool": req.GetToolName(), "tool_use_id": req.GetToolUseId(), "bytes": size, "redacted": total,
	})
	if total == 0 {
		return &hookspb.OnToolResultResponse{}, nil // unset: keep
	}
	return &hookspb.OnToolResultResponse{Result: &contentpb.ToolResultBlock{
		ToolUseId: result.GetToolUseId(), Content: blocks, IsError: result.GetIsError(),
	}}, nil
}

func main() {
	listen := flag.String("listen", "127.0.0.1:50075", "listen address")
	drainMs := flag.Int("drain-ms", 5000, "after SIGTERM, keep serving this long (milliseconds)")
	flag.Parse()
	limit := 16 << 20
	if v, err := strconv.Atoi(os.Getenv("LATTICE_HOOK_MAX_MESSAGE_BYTES")); err == nil && v > 0 {
		limit = v
	}
	lis, err := net.Listen("tcp", *listen)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	server := grpc.NewServer(grpc.MaxRecvMsgSize(limit), grpc.MaxSendMsgSize(limit))
	hookspb.RegisterHookServiceServer(server, redactHook{})
	healthServer := health.NewServer()
	healthServer.SetServingStatus("", healthpb.HealthCheckResponse_SERVING)
	healthServer.SetServingStatus("lattice.hooks.v1.HookService", healthpb.HealthCheckResponse_SERVING)
	healthpb.RegisterHealthServer(server, healthServer)
	reflection.Register(server)

	port := lis.Addr().(*net.TCPAddr).Port
	fmt.Printf("listening on %d\n", port)
	logLine("serving", map[string]interface{}{"port": port, "max_message_bytes": limit})
	signals := make(chan os.Signal, 1)
	signal.Notify(signals, syscall.SIGTERM, syscall.SIGINT)
	go func() {
		<-signals
		// Draining: say so first, keep serving while Lattice moves away.
		healthServer.Shutdown()
		logLine("draining", map[string]interface{}{"drain_ms": *drainMs})
		time.Sleep(time.Duration(*drainMs) * time.Millisecond)
		server.GracefulStop()
	}()
	if err := server.Serve(lis); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	logLine("stopped", map[string]interface{}{})
}
