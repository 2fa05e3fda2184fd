// A hook on the latticehook package that panics on every tool result with
// the result's text in the panic, or returns an error quoting it
// (tests/tests/hook_sdks.rs): Lattice must abort the query as INTERNAL
// without the text anywhere.
package main

import (
	"context"
	"fmt"
	"strings"

	"lattice.dev/latticehook"
)

type fails struct{}

func (fails) OnToolResult(ctx context.Context, call *latticehook.ToolResultCall) (*latticehook.ToolResultBlock, error) {
	if strings.HasPrefix(call.Text(), "error") {
		return nil, fmt.Errorf("cannot parse %q", call.Text())
	}
	panic("cannot parse " + call.Text())
}

func main() { latticehook.Main(fails{}, "127.0.0.1:0") }
