package latticehook

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"flag"
	"fmt"
	"net"
	"os"
	"os/signal"
	"runtime"
	"strconv"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/reflection"
	"google.golang.org/grpc/status"
	hooksv1 "lattice.dev/proto/lattice/hooks/v1"
)

// ToolResultHook sees each tool result on its way to the model. It returns
// nil to keep the result, or a replacement that keeps its tool_use_id
// (call.ReplaceText builds one). An error refuses the result: Lattice
// aborts the query and the result is never sent on.
type ToolResultHook interface {
	OnToolResult(ctx context.Context, call *ToolResultCall) (*ToolResultBlock, error)
}

// ModelRequestHook sees each model request before it is sent, and may
// change it for that one request.
type ModelRequestHook interface {
	OnModelRequest(ctx context.Context, call *ModelRequestCall) (*ModelRequestChange, error)
}

// Funcs is a hook made of functions; an event whose function is nil is
// not handled (UNIMPLEMENTED).
type Funcs struct {
	ToolResult   func(ctx context.Context, call *ToolResultCall) (*ToolResultBlock, error)
	ModelRequest func(ctx context.Context, call *ModelRequestCall) (*ModelRequestChange, error)
}

// ServiceName is the hook service's full gRPC name.
const ServiceName = "lattice.hooks.v1.HookService"

// MaxMessageBytesEnv sets the largest request or reply, in bytes; set it
// to Lattice's server.hook_max_message_bytes when you change that.
const MaxMessageBytesEnv = "LATTICE_HOOK_MAX_MESSAGE_BYTES"

// DefaultMaxMessageBytes is Lattice's default hook message limit (gRPC's
// own default is 4 MiB).
const DefaultMaxMessageBytes = 16 << 20

// DrainEnv sets the drain period, in milliseconds.
const DrainEnv = "LATTICE_HOOK_DRAIN_MS"

// DefaultDrain is long enough for Kubernetes to take the pod out of its
// Service's endpoints and for Lattice to re-resolve a dns:/// name (every
// 5 s).
const DefaultDrain = 6 * time.Second

// StopGrace is how long calls still in flight after the drain may take.
const StopGrace = 30 * time.Second

type options struct {
	tls      *tls.Config
	drain    time.Duration
	limit    int
	announce bool
	ready    func(port int)
	listener net.Listener
}

// Option configures Serve.
type Option func(*options)

// WithTLS serves TLS with this configuration (see TLSFiles).
func WithTLS(c *tls.Config) Option { return func(o *options) { o.tls = c } }

// WithDrain keeps serving this long after ctx is done (default
// LATTICE_HOOK_DRAIN_MS, else DefaultDrain).
func WithDrain(d time.Duration) Option { return func(o *options) { o.drain = d } }

// WithMaxMessageBytes sets the largest request or reply (default
// LATTICE_HOOK_MAX_MESSAGE_BYTES, else DefaultMaxMessageBytes).
func WithMaxMessageBytes(n int) Option { return func(o *options) { o.limit = n } }

// WithReady calls ready with the port once the server serves.
func WithReady(ready func(port int)) Option { return func(o *options) { o.ready = ready } }

// WithListener serves on l instead of listening on addr.
func WithListener(l net.Listener) Option { return func(o *options) { o.listener = l } }

// Quiet leaves out the "listening on PORT" line on stdout.
func Quiet() Option { return func(o *options) { o.announce = false } }

// TLSFiles reads a certificate (chain) and its key, PEM, and, when
// clientCA is not "", requires clients to present a certificate signed by
// that CA (mutual TLS).
func TLSFiles(cert, key, clientCA string) (*tls.Config, error) {
	pair, err := tls.LoadX509KeyPair(cert, key)
	if err != nil {
		return nil, err
	}
	c := &tls.Config{Certificates: []tls.Certificate{pair}, MinVersion: tls.VersionTLS12}
	if clientCA != "" {
		pem, err := os.ReadFile(clientCA)
		if err != nil {
			return nil, err
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("%s: no PEM certificate", clientCA)
		}
		c.ClientCAs, c.ClientAuth = pool, tls.RequireAndVerifyClientCert
	}
	return c, nil
}

func envInt(name string, fallback int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil && v >= 0 {
		return v
	}
	return fallback
}

// Serve serves hook (a ToolResultHook, a ModelRequestHook, both, or Funcs)
// on addr until ctx is done, then drains and returns nil.
//
// It serves grpc.health.v1 (SERVING for "" and the hook service) and
// server reflection. When ctx is done, health says NOT_SERVING at once,
// calls are still served for the drain period while Lattice moves to other
// replicas, then the server stops, finishing the calls in flight. The
// first line on stdout is "listening on PORT" (unless Quiet). A panic in
// the hook, or an error that is not a gRPC status, answers INTERNAL
// without its text; a status error (status.Error) is the call's status.
func Serve(ctx context.Context, hook interface{}, addr string, opts ...Option) error {
	o := options{
		drain:    time.Duration(envInt(DrainEnv, int(DefaultDrain/time.Millisecond))) * time.Millisecond,
		limit:    envInt(MaxMessageBytesEnv, DefaultMaxMessageBytes),
		announce: true,
	}
	for _, opt := range opts {
		opt(&o)
	}
	service, err := newService(hook)
	if err != nil {
		return err
	}
	lis := o.listener
	if lis == nil {
		if lis, err = net.Listen("tcp", addr); err != nil {
			return err
		}
	}
	serverOpts := []grpc.ServerOption{
		grpc.MaxRecvMsgSize(o.limit), grpc.MaxSendMsgSize(o.limit), grpc.UnaryInterceptor(intercept),
	}
	if o.tls != nil {
		serverOpts = append(serverOpts, grpc.Creds(credentials.NewTLS(o.tls)))
	}
	server := grpc.NewServer(serverOpts...)
	hooksv1.RegisterHookServiceServer(server, service)
	healthServer := health.NewServer()
	healthServer.SetServingStatus("", healthpb.HealthCheckResponse_SERVING)
	healthServer.SetServingStatus(ServiceName, healthpb.HealthCheckResponse_SERVING)
	healthpb.RegisterHealthServer(server, healthServer)
	reflection.Register(server)

	port := lis.Addr().(*net.TCPAddr).Port
	served := make(chan error, 1)
	go func() { served <- server.Serve(lis) }()
	if o.announce {
		fmt.Printf("listening on %d\n", port)
	}
	Log(ctx, "serving", "port", port, "max_message_bytes", o.limit, "tls", o.tls != nil)
	if o.ready != nil {
		o.ready(port)
	}
	select {
	case err := <-served:
		return err
	case <-ctx.Done():
	}
	// Draining: say so first, keep serving while Lattice moves away.
	healthServer.Shutdown()
	Log(context.Background(), "draining", "drain_ms", o.drain.Milliseconds())
	select {
	case err := <-served:
		return err
	case <-time.After(o.drain):
	}
	stopped := make(chan struct{})
	go func() { server.GracefulStop(); close(stopped) }()
	select {
	case <-stopped:
	case <-time.After(StopGrace):
		server.Stop()
	}
	Log(context.Background(), "stopped")
	return nil
}

// Main is a hook's whole main: it parses the standard flags (-listen,
// -drain-ms, -tls-cert, -tls-key, -tls-client-ca, -log-format; see
// Flags), serves hook until SIGTERM or Ctrl-C, drains, and exits.
func Main(hook interface{}, defaultListen string) {
	flags := AddFlags(flag.CommandLine, defaultListen)
	flag.Parse()
	if err := flags.Serve(hook); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}

// Flags are the standard flags of a hook (see AddFlags).
type Flags struct {
	Listen, TLSCert, TLSKey, TLSClientCA, LogFormat string
	DrainMs                                         int
}

// AddFlags adds the standard flags to fs, for a hook with flags of its
// own; call Flags.Serve after fs.Parse.
func AddFlags(fs *flag.FlagSet, defaultListen string) *Flags {
	f := &Flags{}
	fs.StringVar(&f.Listen, "listen", defaultListen, "listen address, host:port; port 0 picks one")
	fs.IntVar(&f.DrainMs, "drain-ms", envInt(DrainEnv, int(DefaultDrain/time.Millisecond)),
		"after SIGTERM, keep serving this long (milliseconds)")
	fs.StringVar(&f.TLSCert, "tls-cert", "", "serve TLS with this certificate (chain), PEM")
	fs.StringVar(&f.TLSKey, "tls-key", "", "the certificate's private key, PEM")
	fs.StringVar(&f.TLSClientCA, "tls-client-ca", "", "require client certificates signed by this CA (PEM): mutual TLS")
	fs.StringVar(&f.LogFormat, "log-format", "text", "log lines on stderr: text or json")
	return f
}

// Serve serves hook as the flags say, until SIGTERM or Ctrl-C.
func (f *Flags) Serve(hook interface{}) error {
	if (f.TLSCert == "") != (f.TLSKey == "") || (f.TLSClientCA != "" && f.TLSCert == "") {
		return errors.New("-tls-cert and -tls-key go together; -tls-client-ca needs them")
	}
	if err := SetLogFormat(f.LogFormat); err != nil {
		return err
	}
	opts := []Option{WithDrain(time.Duration(f.DrainMs) * time.Millisecond)}
	if f.TLSCert != "" {
		c, err := TLSFiles(f.TLSCert, f.TLSKey, f.TLSClientCA)
		if err != nil {
			return err
		}
		opts = append(opts, WithTLS(c))
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	return Serve(ctx, hook, f.Listen, opts...)
}

// --- The service ---------------------------------------------------------

type service struct {
	hooksv1.UnimplementedHookServiceServer
	toolResult   func(context.Context, *ToolResultCall) (*ToolResultBlock, error)
	modelRequest func(context.Context, *ModelRequestCall) (*ModelRequestChange, error)
}

func newService(hook interface{}) (*service, error) {
	s := &service{}
	switch h := hook.(type) {
	case Funcs:
		s.toolResult, s.modelRequest = h.ToolResult, h.ModelRequest
	case *Funcs:
		s.toolResult, s.modelRequest = h.ToolResult, h.ModelRequest
	default:
		if t, ok := hook.(ToolResultHook); ok {
			s.toolResult = t.OnToolResult
		}
		if m, ok := hook.(ModelRequestHook); ok {
			s.modelRequest = m.OnModelRequest
		}
	}
	if s.toolResult == nil && s.modelRequest == nil {
		return nil, fmt.Errorf("%T implements neither OnToolResult nor OnModelRequest", hook)
	}
	return s, nil
}

func (s *service) OnToolResult(ctx context.Context, req *hooksv1.OnToolResultRequest) (*hooksv1.OnToolResultResponse, error) {
	if s.toolResult == nil {
		return nil, status.Error(codes.Unimplemented, "this hook does not handle tool results: register it for the model_request event only")
	}
	out, err := s.toolResult(ctx, &ToolResultCall{OnToolResultRequest: req, Trace: TraceFrom(ctx)})
	if err != nil {
		return nil, callError(ctx, "OnToolResult", err)
	}
	return &hooksv1.OnToolResultResponse{Result: out}, nil
}

func (s *service) OnModelRequest(ctx context.Context, req *hooksv1.OnModelRequestRequest) (*hooksv1.OnModelRequestResponse, error) {
	if s.modelRequest == nil {
		return nil, status.Error(codes.Unimplemented, "this hook does not handle model requests: register it for the tool_result event only")
	}
	change, err := s.modelRequest(ctx, &ModelRequestCall{OnModelRequestRequest: req, Trace: TraceFrom(ctx)})
	if err != nil {
		return nil, callError(ctx, "OnModelRequest", err)
	}
	reply := &hooksv1.OnModelRequestResponse{}
	if change != nil {
		reply.System = change.System
		if change.Messages != nil {
			reply.Messages = &hooksv1.MessageList{Messages: change.Messages}
		}
	}
	return reply, nil
}

// callError is a hook's error as the call's status: a gRPC status as it
// is, the context's end as its code, anything else INTERNAL without its
// text (an error's text may quote the value a redaction hook guards).
func callError(ctx context.Context, rpc string, err error) error {
	if s, ok := status.FromError(err); ok {
		return s.Err()
	}
	switch {
	case errors.Is(err, context.DeadlineExceeded):
		return status.Error(codes.DeadlineExceeded, "the call's deadline passed")
	case errors.Is(err, context.Canceled):
		return status.Error(codes.Canceled, "the call was cancelled")
	}
	Log(ctx, "the hook returned an error", "level", "error", "rpc", rpc, "error_type", fmt.Sprintf("%T", err))
	return status.Error(codes.Internal, "the hook returned an error")
}

// intercept puts the call's trace context into its context (TraceFrom),
// and answers a panic with INTERNAL, "the hook panicked", logging where
// it happened, never the panic's value.
func intercept(ctx context.Context, req interface{}, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (resp interface{}, err error) {
	ctx = withTrace(ctx)
	defer func() {
		if r := recover(); r != nil {
			where := ""
			if _, file, line, ok := runtime.Caller(2); ok {
				where = fmt.Sprintf("%s:%d", file, line)
			}
			Log(ctx, "the hook panicked", "level", "error", "rpc", info.FullMethod, "panic_type", fmt.Sprintf("%T", r), "where", where)
			resp, err = nil, status.Error(codes.Internal, "the hook panicked")
		}
	}()
	return handler(ctx, req)
}
