package genai

import (
	"context"
	"errors"
	"io"
	"strings"

	pb "github.com/genai-grpc/genai-grpc/clients/go/gen/genai/v1"
	"google.golang.org/grpc/codes"
)

// Stream is a running GenerateStream call, read like a bufio.Scanner:
//
//	for stream.Next() {
//		fmt.Print(stream.Delta().Text)
//	}
//	if err := stream.Err(); err != nil { ... }
//	result := stream.Final()
//
// Cancelling the context given to Client.Stream, or Close, cancels the
// request on the server (which aborts it and frees what it holds); Next then
// returns false and Err is an *Error with code Canceled. A Stream is not
// safe for concurrent use.
type Stream struct {
	call   pb.GenerateService_GenerateStreamClient
	cancel context.CancelFunc
	delta  Delta
	text   strings.Builder
	final  *Result
	err    error
	prompt []TokenLogprob              // the first delta's PromptLogprobs
	others map[uint32]*strings.Builder // N > 1: the text of completions 1..
}

// Stream starts req as a streamed request.
func (c *Client) Stream(ctx context.Context, req *Request) (*Stream, error) {
	in, err := req.Proto()
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(withSession(ctx, in.SessionId))
	call, err := c.generate.GenerateStream(ctx, in)
	if err != nil {
		cancel()
		return nil, wrap(err)
	}
	return &Stream{call: call, cancel: cancel}, nil
}

// Next waits for the next delta and reports whether there is one; false at
// the end of the request (Final is then set) or on failure (Err).
func (s *Stream) Next() bool {
	for s.final == nil && s.err == nil {
		msg, err := s.call.Recv()
		if err != nil {
			if errors.Is(err, io.EOF) {
				err = &Error{Code: codes.Internal, Message: "the stream ended without a final message"}
			}
			s.err = wrap(err)
			s.cancel()
			break
		}
		if d := msg.GetDelta(); d != nil {
			s.delta = deltaFrom(d)
			if s.delta.Index == 0 {
				s.text.WriteString(s.delta.Text)
			} else {
				if s.others == nil {
					s.others = map[uint32]*strings.Builder{}
				}
				if s.others[s.delta.Index] == nil {
					s.others[s.delta.Index] = &strings.Builder{}
				}
				s.others[s.delta.Index].WriteString(s.delta.Text)
			}
			if s.delta.PromptLogprobs != nil {
				s.prompt = s.delta.PromptLogprobs
			}
			return true
		}
		if f := msg.GetFinal(); f != nil {
			s.final = resultFromFinal(f, s.text.String())
			s.final.PromptLogprobs = s.prompt
			texts := map[uint32]string{0: s.text.String()}
			for i, b := range s.others {
				texts[i] = b.String()
			}
			s.final.Completions = completionsFrom(f.GetCompletions(), texts)
			s.cancel() // the call is over; releases the context's resources
		}
	}
	return false
}

// Delta is the delta Next last read.
func (s *Stream) Delta() Delta { return s.delta }

// Err is the failure that ended the stream, or nil.
func (s *Stream) Err() error { return s.err }

// Final is the whole result once Next returned false without error (its
// Text is the deltas' text joined); nil before that or after a failure.
func (s *Stream) Final() *Result { return s.final }

// Collect reads the remaining deltas and returns the whole result.
func (s *Stream) Collect() (*Result, error) {
	for s.Next() {
	}
	return s.final, s.err
}

// Close cancels the request if it is still running; safe to call twice.
func (s *Stream) Close() { s.cancel() }
