// Package latticehook writes Lattice hook services in Go.
//
// A hook sees, and may replace, what a Lattice agent sends to its model:
// each tool result on its way back (ToolResultHook) and each model request
// before it is sent (ModelRequestHook). A hook implements one or both, or
// is a Funcs; Serve runs it with grpc.health.v1, reflection, Lattice's
// message limit, trace context and a drain:
//
//	type shout struct{}
//
//	func (shout) OnToolResult(ctx context.Context, call *latticehook.ToolResultCall) (*latticehook.ToolResultBlock, error) {
//		return call.ReplaceText(strings.ToUpper(call.Text())), nil
//	}
//
//	func main() { latticehook.Main(shout{}, "127.0.0.1:50075") }
//
// Returning a gRPC status error refuses the value: Lattice aborts the
// query and the value is never sent on. Any other error, or a panic,
// answers INTERNAL without its text.
package latticehook
