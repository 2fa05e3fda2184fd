// A Lattice redaction hook in Go, on the latticehook package.
//
// Every tool result's text is scanned for emails, card numbers
// (Luhn-checked), phone numbers and API-key-like tokens, replaced by the
// same markers as the Rust and Python examples; the replacement is one text
// block. A result with nothing to redact is kept. Model requests are not
// handled (UNIMPLEMENTED): register it for the tool_result event only.
//
//	bash hook-sdk/go/build.sh hook-sdk/examples/go ./redact-hook
//	./redact-hook --listen 127.0.0.1:50075
//
// The package brings the rest: health, reflection, a drain on SIGTERM
// (--drain-ms), Lattice's 16 MiB message limit, TLS (--tls-cert, --tls-key,
// --tls-client-ca), log lines carrying the query's trace_id (--log-format
// json); with port 0 the first line printed is "listening on PORT". Go's
// regexp takes about 2 s over a result near 16 MiB: register it with
// deadline_ms = 5000 and check it so, `lattice hook check 127.0.0.1:50075
// --events tool_result --deadline-ms 5000`.
package main

import (
	"context"
	"regexp"
	"strings"

	"lattice.dev/latticehook"
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

type redactHook struct{}

func (redactHook) OnToolResult(ctx context.Context, call *latticehook.ToolResultCall) (*latticehook.ToolResultBlock, error) {
	text, count := redact(call.Text())
	latticehook.Log(ctx, "tool result checked", "tool", call.GetToolName(), "tool_use_id", call.GetToolUseId(), "redacted", count)
	if count == 0 {
		return nil, nil // keep
	}
	return call.ReplaceText(text), nil
}

func main() { latticehook.Main(redactHook{}, "127.0.0.1:50075") }
