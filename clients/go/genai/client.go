// Package genai is a Go client of the genai-grpc control plane
// (genai.v1.GenerateService, SessionService and ModelService):
//
//	client, err := genai.Dial("localhost:50051")
//	if err != nil { ... }
//	defer client.Close()
//	stream, err := client.Stream(ctx, &genai.Request{Prompt: "Once upon a time", MaxNewTokens: genai.Ptr[uint32](32)})
//	if err != nil { ... }
//	defer stream.Close()
//	for stream.Next() {
//		fmt.Print(stream.Delta().Text)
//	}
//	if err := stream.Err(); err != nil { ... }
//	fmt.Println(stream.Final().FinishReason)
//
// Failed calls return an *Error carrying the status code and the field
// violations the server named; the generated stubs are in
// github.com/genai-grpc/genai-grpc/clients/go/gen/genai/v1 for anything this
// package does not wrap.
package genai

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
	"time"

	pb "github.com/genai-grpc/genai-grpc/clients/go/gen/genai/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/metadata"
)

// Defaults of the channel, as the Python client's.
const (
	DefaultMaxMessageBytes = 32 * 1024 * 1024
	DefaultKeepalive       = 60 * time.Second
	keepaliveTimeout       = 20 * time.Second
)

// SessionIDHeader is the metadata key that carries the session id on every
// call made for a session (a turn, or a SessionService call naming one), so
// that a proxy in front of several replicas can route a session's calls to
// the replica that holds it without parsing the request.
const SessionIDHeader = "x-session-id"

type config struct {
	tls           *tls.Config
	caFile        string
	certFile      string
	keyFile       string
	token         string
	insecureToken bool
	maxMessage    int
	keepalive     time.Duration
	dialOptions   []grpc.DialOption
}

// Option configures Dial.
type Option func(*config)

// WithTLS dials over TLS, verifying the server with the system's roots
// (unless WithCAFile or WithTLSConfig says otherwise).
func WithTLS() Option {
	return func(c *config) {
		if c.tls == nil {
			c.tls = &tls.Config{MinVersion: tls.VersionTLS12}
		}
	}
}

// WithTLSConfig dials over TLS with this configuration (cloned).
func WithTLSConfig(cfg *tls.Config) Option { return func(c *config) { c.tls = cfg.Clone() } }

// WithCAFile dials over TLS, verifying the server with the PEM CA bundle in path.
func WithCAFile(path string) Option {
	return func(c *config) { WithTLS()(c); c.caFile = path }
}

// WithClientCertificate dials over TLS presenting this PEM certificate and
// key (mTLS, for a server started with a client CA).
func WithClientCertificate(certFile, keyFile string) Option {
	return func(c *config) { WithTLS()(c); c.certFile, c.keyFile = certFile, keyFile }
}

// WithToken sends `authorization: Bearer <token>` on every call. Over
// plaintext it is refused unless WithInsecureToken is given too: the token
// would cross the network in the clear.
func WithToken(token string) Option { return func(c *config) { c.token = token } }

// WithInsecureToken allows WithToken without TLS (a server on loopback, or
// behind a TLS-terminating proxy on the same host).
func WithInsecureToken() Option { return func(c *config) { c.insecureToken = true } }

// WithMaxMessageBytes bounds the size of every message sent or received
// (default DefaultMaxMessageBytes).
func WithMaxMessageBytes(n int) Option { return func(c *config) { c.maxMessage = n } }

// WithKeepalive sets the interval of HTTP/2 keepalive pings on active calls
// (default DefaultKeepalive); 0 disables them.
func WithKeepalive(d time.Duration) Option { return func(c *config) { c.keepalive = d } }

// WithDialOptions adds gRPC dial options (after this package's own, so they win).
func WithDialOptions(opts ...grpc.DialOption) Option {
	return func(c *config) { c.dialOptions = append(c.dialOptions, opts...) }
}

type bearer struct {
	token      string
	requireTLS bool
}

func (b bearer) GetRequestMetadata(context.Context, ...string) (map[string]string, error) {
	return map[string]string{"authorization": "Bearer " + b.token}, nil
}

func (b bearer) RequireTransportSecurity() bool { return b.requireTLS }

func (c *config) transport() (grpc.DialOption, error) {
	if c.tls == nil {
		return grpc.WithInsecure(), nil
	}
	cfg := c.tls
	if c.caFile != "" {
		pem, err := os.ReadFile(c.caFile)
		if err != nil {
			return nil, fmt.Errorf("genai: CA file: %w", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("genai: CA file %s holds no PEM certificate", c.caFile)
		}
		cfg.RootCAs = pool
	}
	if c.certFile != "" || c.keyFile != "" {
		cert, err := tls.LoadX509KeyPair(c.certFile, c.keyFile)
		if err != nil {
			return nil, fmt.Errorf("genai: client certificate: %w", err)
		}
		cfg.Certificates = append(cfg.Certificates, cert)
	}
	return grpc.WithTransportCredentials(credentials.NewTLS(cfg)), nil
}

// Client calls GenerateService, SessionService and ModelService over one
// gRPC connection; it is safe for concurrent use.
type Client struct {
	conn     *grpc.ClientConn
	generate pb.GenerateServiceClient
	sessions pb.SessionServiceClient
	model    pb.ModelServiceClient
}

// Dial connects to target ("host:port"); without options over plaintext.
// The connection is made lazily: an unreachable server shows as UNAVAILABLE
// on the first call.
func Dial(target string, options ...Option) (*Client, error) {
	c := &config{maxMessage: DefaultMaxMessageBytes, keepalive: DefaultKeepalive}
	for _, o := range options {
		o(c)
	}
	transport, err := c.transport()
	if err != nil {
		return nil, err
	}
	opts := []grpc.DialOption{
		transport,
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(c.maxMessage), grpc.MaxCallSendMsgSize(c.maxMessage)),
	}
	if c.keepalive > 0 {
		opts = append(opts, grpc.WithKeepaliveParams(keepalive.ClientParameters{Time: c.keepalive, Timeout: keepaliveTimeout}))
	}
	if c.token != "" {
		if c.tls == nil && !c.insecureToken {
			return nil, errors.New("genai: WithToken over plaintext: add WithTLS (or WithCAFile), or WithInsecureToken")
		}
		opts = append(opts, grpc.WithPerRPCCredentials(bearer{c.token, c.tls != nil}))
	}
	conn, err := grpc.Dial(target, append(opts, c.dialOptions...)...)
	if err != nil {
		return nil, wrap(err)
	}
	return NewClient(conn), nil
}

// NewClient uses a connection the caller dialled (and closes).
func NewClient(conn *grpc.ClientConn) *Client {
	return &Client{
		conn:     conn,
		generate: pb.NewGenerateServiceClient(conn),
		sessions: pb.NewSessionServiceClient(conn),
		model:    pb.NewModelServiceClient(conn),
	}
}

// Conn is the underlying connection (for the generated stubs).
func (c *Client) Conn() *grpc.ClientConn { return c.conn }

// Close closes the connection; calls still running fail with CANCELED.
func (c *Client) Close() error { return c.conn.Close() }

// withSession adds the session id header to ctx when id is set.
func withSession(ctx context.Context, id string) context.Context {
	if id == "" {
		return ctx
	}
	return metadata.AppendToOutgoingContext(ctx, SessionIDHeader, id)
}

// Generate runs req to completion and returns the whole result.
func (c *Client) Generate(ctx context.Context, req *Request) (*Result, error) {
	in, err := req.Proto()
	if err != nil {
		return nil, err
	}
	out, err := c.generate.Generate(withSession(ctx, in.SessionId), in)
	if err != nil {
		return nil, wrap(err)
	}
	return resultFromResponse(out), nil
}

// ModelInfo describes the served model.
func (c *Client) ModelInfo(ctx context.Context) (ModelInfo, error) {
	out, err := c.model.GetModelInfo(ctx, &pb.GetModelInfoRequest{})
	if err != nil {
		return ModelInfo{}, wrap(err)
	}
	return modelInfoFrom(out.GetModelInfo()), nil
}

// Tokenize encodes text as the server would (special tokens added unless
// the tokenizer adds none).
func (c *Client) Tokenize(ctx context.Context, text string) ([]uint32, error) {
	out, err := c.model.Tokenize(ctx, &pb.TokenizeRequest{Input: &pb.TokenizeRequest_Text{Text: text}})
	if err != nil {
		return nil, wrap(err)
	}
	return out.GetTokenIds(), nil
}

// Detokenize decodes token ids to text (special tokens skipped).
func (c *Client) Detokenize(ctx context.Context, ids []uint32) (string, error) {
	out, err := c.model.Detokenize(ctx, &pb.DetokenizeRequest{TokenIds: ids})
	if err != nil {
		return "", wrap(err)
	}
	return out.GetText(), nil
}
