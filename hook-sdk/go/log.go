package latticehook

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"sort"
	"strings"
	"sync"
	"time"
)

var logger = struct {
	sync.Mutex
	out  io.Writer
	json bool
}{out: os.Stderr}

// SetLogFormat sets how Log writes lines on stderr: "text" (the default)
// or "json" (one object per line).
func SetLogFormat(format string) error {
	switch format {
	case "text", "json":
	default:
		return fmt.Errorf("%q is not a log format: text or json", format)
	}
	logger.Lock()
	logger.json = format == "json"
	logger.Unlock()
	return nil
}

// SetLogOutput sends Log's lines to w instead of stderr.
func SetLogOutput(w io.Writer) {
	logger.Lock()
	logger.out = w
	logger.Unlock()
}

// Log writes one line: message, then key/value pairs (sizes, counts, ids:
// never content). A "level" pair sets the level (default "info"). Inside a
// call, the line carries the call's trace_id and parent_span_id when
// Lattice sent a trace context.
func Log(ctx context.Context, message string, keyvals ...interface{}) {
	line := map[string]interface{}{"level": "info"}
	for i := 0; i+1 < len(keyvals); i += 2 {
		line[fmt.Sprint(keyvals[i])] = keyvals[i+1]
	}
	if t := TraceFrom(ctx); t != nil {
		line["trace_id"], line["parent_span_id"] = t.TraceID, t.ParentSpanID
	}
	now := time.Now()
	logger.Lock()
	defer logger.Unlock()
	if logger.json {
		line["ts"] = float64(now.UnixMilli()) / 1000
		line["message"] = message
		encoded, _ := json.Marshal(line)
		fmt.Fprintln(logger.out, string(encoded))
		return
	}
	keys := make([]string, 0, len(line))
	for k := range line {
		if k != "level" {
			keys = append(keys, k)
		}
	}
	sort.Strings(keys)
	var b strings.Builder
	fmt.Fprintf(&b, "%s %s %s", now.UTC().Format("2006-01-02T15:04:05.000Z"), strings.ToUpper(fmt.Sprint(line["level"])), escape(message))
	for _, k := range keys {
		fmt.Fprintf(&b, " %s=%s", escape(k), escape(fmt.Sprint(line[k])))
	}
	fmt.Fprintln(logger.out, b.String())
}

// escape keeps a value on its line: control characters are written as
// escapes.
func escape(s string) string {
	if strings.IndexFunc(s, func(r rune) bool { return r < 32 || r == 127 }) < 0 {
		return s
	}
	q := fmt.Sprintf("%q", s)
	return q[1 : len(q)-1]
}
