// The benchmark's Go hook on the latticehook package: replaces each tool
// result's text by its upper case (lattice-sdkbench).
package main

import (
	"context"
	"strings"

	"lattice.dev/latticehook"
)

type upper struct{}

func (upper) OnToolResult(ctx context.Context, call *latticehook.ToolResultCall) (*latticehook.ToolResultBlock, error) {
	return call.ReplaceText(strings.ToUpper(call.Text())), nil
}

func main() { latticehook.Main(upper{}, "127.0.0.1:0") }
