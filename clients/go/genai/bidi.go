package genai

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"strings"
	"sync"

	pb "github.com/genai-grpc/genai-grpc/clients/go/gen/genai/v1"
	"google.golang.org/grpc/codes"
)

// BidiEvent is one event of a Bidi call, tagged with its request: exactly
// one of Delta, Result and Err is set. A request gets zero or more deltas,
// then one Result (its Text is the deltas' text joined) or one Err (an
// *Error; the call itself goes on).
type BidiEvent struct {
	RequestID string
	Delta     *Delta
	Result    *Result
	Err       error
}

// Done reports whether this is its request's last event.
func (e BidiEvent) Done() bool { return e.Result != nil || e.Err != nil }

// Bidi multiplexes several requests on one GenerateBidi call. Start and
// Cancel may be called from any goroutine; Next, Event and Err from one.
// Next returns false once every started request has ended (Start more and
// call Next again), or when the call failed (Err). Close ends the call,
// cancelling requests still running.
type Bidi struct {
	call   pb.GenerateService_GenerateBidiClient
	cancel context.CancelFunc
	send   sync.Mutex
	mu     sync.Mutex
	texts  map[string]*strings.Builder // running request id -> its text so far
	event  BidiEvent
	err    error
	closed bool
}

// Bidi opens a GenerateBidi call; ctx bounds the whole call.
func (c *Client) Bidi(ctx context.Context) (*Bidi, error) {
	ctx, cancel := context.WithCancel(ctx)
	call, err := c.generate.GenerateBidi(ctx)
	if err != nil {
		cancel()
		return nil, wrap(err)
	}
	return &Bidi{call: call, cancel: cancel, texts: map[string]*strings.Builder{}}, nil
}

func newRequestID() string {
	b := make([]byte, 16)
	if _, err := rand.Read(b); err != nil {
		panic(err) // crypto/rand does not fail on supported platforms
	}
	return hex.EncodeToString(b)
}

// Start sends req (its RequestID, or a fresh random one) and returns the
// request id.
func (b *Bidi) Start(req *Request) (string, error) {
	in, err := req.Proto()
	if err != nil {
		return "", err
	}
	if in.RequestId == "" {
		in.RequestId = newRequestID()
	}
	b.mu.Lock()
	if b.closed {
		b.mu.Unlock()
		return "", errors.New("genai: the bidi call is closed")
	}
	if _, running := b.texts[in.RequestId]; running {
		b.mu.Unlock()
		return "", fmt.Errorf("genai: request_id %q is already running on this call", in.RequestId)
	}
	b.texts[in.RequestId] = &strings.Builder{}
	b.mu.Unlock()
	if err := b.sendMsg(&pb.BidiRequest{Action: &pb.BidiRequest_Start{Start: in}}); err != nil {
		b.mu.Lock()
		delete(b.texts, in.RequestId)
		b.mu.Unlock()
		return "", err
	}
	return in.RequestId, nil
}

// Cancel asks the server to cancel a started request; it then ends with a
// Result whose FinishReason is "CANCELLED". An ended request is ignored.
func (b *Bidi) Cancel(requestID string) error {
	return b.sendMsg(&pb.BidiRequest{Action: &pb.BidiRequest_Cancel{Cancel: &pb.CancelRequest{RequestId: requestID}}})
}

func (b *Bidi) sendMsg(m *pb.BidiRequest) error {
	b.send.Lock()
	defer b.send.Unlock()
	if err := b.call.Send(m); err != nil {
		if errors.Is(err, io.EOF) { // the call ended; Recv has its status
			_, err = b.call.Recv()
		}
		return wrap(err)
	}
	return nil
}

// Pending is the ids of the started requests that have not ended.
func (b *Bidi) Pending() []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	ids := make([]string, 0, len(b.texts))
	for id := range b.texts {
		ids = append(ids, id)
	}
	return ids
}

func (b *Bidi) pending() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.texts)
}

// Next waits for the next event of any started request.
func (b *Bidi) Next() bool {
	for b.err == nil && b.pending() > 0 {
		msg, err := b.call.Recv()
		if err != nil {
			if errors.Is(err, io.EOF) {
				err = &Error{Code: codes.Internal, Message: fmt.Sprintf(
					"the call ended with requests still running: %v", b.Pending())}
			}
			b.err = wrap(err)
			return false
		}
		id := msg.GetRequestId()
		b.mu.Lock()
		text, ok := b.texts[id]
		if ok && msg.GetEvent() != nil {
			b.event = BidiEvent{RequestID: id}
			switch ev := msg.GetEvent().(type) {
			case *pb.BidiResponse_Delta:
				d := deltaFrom(ev.Delta)
				text.WriteString(d.Text)
				b.event.Delta = &d
			case *pb.BidiResponse_Final:
				b.event.Result = resultFromFinal(ev.Final, text.String())
				delete(b.texts, id)
			case *pb.BidiResponse_Error:
				b.event.Err = fromProtoStatus(ev.Error)
				delete(b.texts, id)
			}
		}
		b.mu.Unlock()
		if ok {
			return true
		}
	}
	return false
}

// Event is the event Next last read.
func (b *Bidi) Event() BidiEvent { return b.event }

// Err is the failure of the whole call, or nil.
func (b *Bidi) Err() error { return b.err }

// Results reads events until every started request has ended and returns
// each one's result or error, by request id.
func (b *Bidi) Results() (map[string]*Result, map[string]error, error) {
	results, errs := map[string]*Result{}, map[string]error{}
	for b.Next() {
		if ev := b.Event(); ev.Result != nil {
			results[ev.RequestID] = ev.Result
		} else if ev.Err != nil {
			errs[ev.RequestID] = ev.Err
		}
	}
	return results, errs, b.err
}

// Close half-closes the call and waits for the server to end it when no
// request is running; requests still running are cancelled with the call.
func (b *Bidi) Close() error {
	b.mu.Lock()
	if b.closed {
		b.mu.Unlock()
		return nil
	}
	b.closed = true
	running := len(b.texts) > 0
	b.texts = map[string]*strings.Builder{}
	b.mu.Unlock()
	defer b.cancel()
	if running || b.err != nil {
		return nil
	}
	b.send.Lock()
	err := b.call.CloseSend()
	b.send.Unlock()
	for err == nil {
		_, err = b.call.Recv()
	}
	if errors.Is(err, io.EOF) {
		return nil
	}
	return wrap(err)
}
