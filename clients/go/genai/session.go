package genai

import (
	"context"
	"errors"

	pb "github.com/genai-grpc/genai-grpc/clients/go/gen/genai/v1"
)

// SessionOptions are CreateSession's: IdleTTLSeconds 0 takes the server's
// default; Metadata are free-form labels kept with the session.
type SessionOptions struct {
	IdleTTLSeconds uint32
	Metadata       map[string]string
	// ContextOverflow: what the session's turns do at the context window
	// ("error" or "slide"; "": the server's default).
	ContextOverflow string
}

// CreateSession creates an empty session.
func (c *Client) CreateSession(ctx context.Context, opts SessionOptions) (SessionInfo, error) {
	overflow, err := contextOverflow(opts.ContextOverflow)
	if err != nil {
		return SessionInfo{}, err
	}
	in := &pb.CreateSessionRequest{Metadata: opts.Metadata, ContextOverflow: overflow}
	if opts.IdleTTLSeconds != 0 {
		in.IdleTtlSeconds = &opts.IdleTTLSeconds
	}
	out, err := c.sessions.CreateSession(ctx, in)
	if err != nil {
		return SessionInfo{}, wrap(err)
	}
	return sessionFrom(out.GetSession()), nil
}

// GetSession describes a session (ErrNotFound if unknown or expired).
func (c *Client) GetSession(ctx context.Context, id string) (SessionInfo, error) {
	out, err := c.sessions.GetSession(withSession(ctx, id), &pb.GetSessionRequest{SessionId: id})
	if err != nil {
		return SessionInfo{}, wrap(err)
	}
	return sessionFrom(out.GetSession()), nil
}

// ResetSession clears a session's history, keeping its id.
func (c *Client) ResetSession(ctx context.Context, id string) (SessionInfo, error) {
	out, err := c.sessions.ResetSession(withSession(ctx, id), &pb.ResetSessionRequest{SessionId: id})
	if err != nil {
		return SessionInfo{}, wrap(err)
	}
	return sessionFrom(out.GetSession()), nil
}

// RewindSessionToTurns keeps a session's first turns completed turns and
// drops the rest; the KV of what is kept stays on the server.
func (c *Client) RewindSessionToTurns(ctx context.Context, id string, turns uint32) (SessionInfo, error) {
	in := &pb.RewindSessionRequest{SessionId: id, Target: &pb.RewindSessionRequest_Turns{Turns: turns}}
	return c.rewind(ctx, id, in)
}

// RewindSessionToTokens keeps the first historyTokens tokens of a
// session's history.
func (c *Client) RewindSessionToTokens(ctx context.Context, id string, historyTokens uint32) (SessionInfo, error) {
	in := &pb.RewindSessionRequest{
		SessionId: id,
		Target:    &pb.RewindSessionRequest_HistoryTokens{HistoryTokens: historyTokens},
	}
	return c.rewind(ctx, id, in)
}

func (c *Client) rewind(ctx context.Context, id string, in *pb.RewindSessionRequest) (SessionInfo, error) {
	out, err := c.sessions.RewindSession(withSession(ctx, id), in)
	if err != nil {
		return SessionInfo{}, wrap(err)
	}
	return sessionFrom(out.GetSession()), nil
}

// ForkOptions are ForkSession's: Turns nil forks the whole history;
// IdleTTLSeconds 0 takes the server's default; Metadata label the fork.
type ForkOptions struct {
	Turns          *uint32
	IdleTTLSeconds uint32
	Metadata       map[string]string
}

// ForkSession makes a new session with the history (and the server-side KV)
// of session id, or of its first *opts.Turns turns.
func (c *Client) ForkSession(ctx context.Context, id string, opts ForkOptions) (SessionInfo, error) {
	in := &pb.ForkSessionRequest{SessionId: id, Turns: opts.Turns, Metadata: opts.Metadata}
	if opts.IdleTTLSeconds != 0 {
		in.IdleTtlSeconds = &opts.IdleTTLSeconds
	}
	out, err := c.sessions.ForkSession(withSession(ctx, id), in)
	if err != nil {
		return SessionInfo{}, wrap(err)
	}
	return sessionFrom(out.GetSession()), nil
}

// CloseSession closes a session and frees what it holds.
func (c *Client) CloseSession(ctx context.Context, id string) error {
	_, err := c.sessions.CloseSession(withSession(ctx, id), &pb.CloseSessionRequest{SessionId: id})
	return wrap(err)
}

// ListSessionsPage returns one page of the caller's open sessions, oldest
// first, and the token of the next page ("" after the last). pageSize 0
// takes the server's default.
func (c *Client) ListSessionsPage(ctx context.Context, pageSize int32, pageToken string) ([]SessionInfo, string, error) {
	out, err := c.sessions.ListSessions(ctx, &pb.ListSessionsRequest{PageSize: pageSize, PageToken: pageToken})
	if err != nil {
		return nil, "", wrap(err)
	}
	infos := make([]SessionInfo, len(out.GetSessions()))
	for i, s := range out.GetSessions() {
		infos[i] = sessionFrom(s)
	}
	return infos, out.GetNextPageToken(), nil
}

// ListSessions returns every page of the caller's open sessions, fetched
// pageSize at a time.
func (c *Client) ListSessions(ctx context.Context, pageSize int32) ([]SessionInfo, error) {
	var all []SessionInfo
	token := ""
	for {
		page, next, err := c.ListSessionsPage(ctx, pageSize, token)
		if err != nil {
			return all, err
		}
		all = append(all, page...)
		if next == "" {
			return all, nil
		}
		token = next
	}
}

// Session is a server-side session; each Generate or Stream is a turn.
type Session struct {
	client *Client
	id     string
}

// NewSession creates a session; Close it when done.
func (c *Client) NewSession(ctx context.Context, opts SessionOptions) (*Session, error) {
	info, err := c.CreateSession(ctx, opts)
	if err != nil {
		return nil, err
	}
	return &Session{c, info.ID}, nil
}

// Session attaches to an existing session id (no call is made).
func (c *Client) Session(id string) *Session { return &Session{c, id} }

// ID is the session id.
func (s *Session) ID() string { return s.id }

func (s *Session) turn(req *Request) *Request {
	var r Request
	if req != nil {
		r = *req // the caller's request is left as it was
	}
	r.SessionID = s.id
	return &r
}

// Generate runs one turn to completion.
func (s *Session) Generate(ctx context.Context, req *Request) (*Result, error) {
	return s.client.Generate(ctx, s.turn(req))
}

// Stream runs one turn, streaming.
func (s *Session) Stream(ctx context.Context, req *Request) (*Stream, error) {
	return s.client.Stream(ctx, s.turn(req))
}

// Info is the session's current state.
func (s *Session) Info(ctx context.Context) (SessionInfo, error) {
	return s.client.GetSession(ctx, s.id)
}

// Reset clears the history (the id stays valid).
func (s *Session) Reset(ctx context.Context) (SessionInfo, error) {
	return s.client.ResetSession(ctx, s.id)
}

// Close closes the session; one that already expired is not an error.
func (s *Session) Close(ctx context.Context) error {
	if err := s.client.CloseSession(ctx, s.id); err != nil && !errors.Is(err, ErrNotFound) {
		return err
	}
	return nil
}
