package genai

// Tests against a live server, run by tests/clients/test_go_client.py (which
// starts one on a tiny fixture model); skipped without GENAI_TARGET.
// GENAI_CA, GENAI_CERT and GENAI_KEY (PEM files) dial TLS/mTLS, GENAI_TOKEN
// sends a bearer token.

import (
	"context"
	"errors"
	"os"
	"strings"
	"testing"
	"time"
)

func liveOptions(t *testing.T, withToken bool) (string, []Option) {
	target := os.Getenv("GENAI_TARGET")
	if target == "" {
		t.Skip("GENAI_TARGET is not set (tests/clients/test_go_client.py sets it)")
	}
	var opts []Option
	if ca := os.Getenv("GENAI_CA"); ca != "" {
		opts = append(opts, WithCAFile(ca))
	}
	if cert := os.Getenv("GENAI_CERT"); cert != "" {
		opts = append(opts, WithClientCertificate(cert, os.Getenv("GENAI_KEY")))
	}
	if token := os.Getenv("GENAI_TOKEN"); token != "" && withToken {
		opts = append(opts, WithToken(token))
	}
	return target, opts
}

func liveClient(t *testing.T) *Client {
	target, opts := liveOptions(t, true)
	c, err := Dial(target, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func testContext(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func TestLiveStreamDeltasMakeTheFinalText(t *testing.T) {
	c, ctx := liveClient(t), testContext(t)
	req := &Request{Prompt: "the cat", MaxNewTokens: Ptr[uint32](12), IgnoreEOS: true}
	stream, err := c.Stream(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	defer stream.Close()
	var text strings.Builder
	var ids []uint32
	deltas := 0
	for stream.Next() {
		deltas++
		text.WriteString(stream.Delta().Text)
		ids = append(ids, stream.Delta().TokenIDs...)
	}
	if err := stream.Err(); err != nil {
		t.Fatal(err)
	}
	final := stream.Final()
	if deltas == 0 || final.Text != text.String() || len(ids) != 12 || len(final.TokenIDs) != 12 ||
		final.Usage.CompletionTokens != 12 || final.FinishReason != "MAX_TOKENS" {
		t.Fatalf("deltas=%d text=%q ids=%v final=%+v", deltas, text.String(), ids, final)
	}
	unary, err := c.Generate(ctx, req) // greedy: the same tokens
	if err != nil {
		t.Fatal(err)
	}
	if unary.Text != final.Text || len(unary.TokenIDs) != 12 {
		t.Fatalf("Generate %q != streamed %q", unary.Text, final.Text)
	}
}

func TestLiveTwoTurnSessionReusesTheHistory(t *testing.T) {
	c, ctx := liveClient(t), testContext(t)
	s, err := c.NewSession(ctx, SessionOptions{Metadata: map[string]string{"user": "ada"}})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close(ctx)
	t1, err := s.Generate(ctx, &Request{Prompt: "hello , who are you ?", MaxNewTokens: Ptr[uint32](6), IgnoreEOS: true})
	if err != nil {
		t.Fatal(err)
	}
	stream, err := s.Stream(ctx, &Request{Prompt: "what is your name ?", MaxNewTokens: Ptr[uint32](6), IgnoreEOS: true})
	if err != nil {
		t.Fatal(err)
	}
	t2, err := stream.Collect()
	if err != nil {
		t.Fatal(err)
	}
	if t2.SessionID != s.ID() || t2.Usage.CachedTokens < t1.Usage.PromptTokens+t1.Usage.CompletionTokens {
		t.Fatalf("turn 2 reused %d tokens of turn 1's %d+%d", t2.Usage.CachedTokens,
			t1.Usage.PromptTokens, t1.Usage.CompletionTokens)
	}
	info, err := s.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.Turns != 2 || info.HistoryTokens != t2.SessionTokens || info.Metadata["user"] != "ada" {
		t.Fatalf("session info %+v", info)
	}
	other, err := c.NewSession(ctx, SessionOptions{})
	if err != nil {
		t.Fatal(err)
	}
	listed, err := c.ListSessions(ctx, 1) // one per page: paging is followed
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	for _, l := range listed {
		seen[l.ID] = true
	}
	if !seen[s.ID()] || !seen[other.ID()] {
		t.Fatalf("ListSessions missed a session: %v", listed)
	}
	if err := other.Close(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := c.GetSession(ctx, other.ID()); !errors.Is(err, ErrNotFound) {
		t.Fatalf("a closed session: want ErrNotFound, got %v", err)
	}
	reset, err := s.Reset(ctx)
	if err != nil || reset.HistoryTokens != 0 {
		t.Fatalf("reset: %+v %v", reset, err)
	}
}

func TestLiveCancelAStream(t *testing.T) {
	c := liveClient(t)
	ctx, cancel := context.WithCancel(testContext(t))
	stream, err := c.Stream(ctx, &Request{Prompt: "the cat", MaxNewTokens: Ptr[uint32](4000), IgnoreEOS: true})
	if err != nil {
		t.Fatal(err)
	}
	if !stream.Next() {
		t.Fatalf("no first delta: %v", stream.Err())
	}
	cancel()
	for i := 0; stream.Next(); i++ { // deltas already received may still come
		if i > 4000 {
			t.Fatal("the stream went on after its context was cancelled")
		}
	}
	err = stream.Err()
	if !errors.Is(err, ErrCanceled) || !errors.Is(err, context.Canceled) || stream.Final() != nil {
		t.Fatalf("want a Canceled error, got %v", err)
	}
}

func TestLiveBadRequestIsTypedAndNamesTheField(t *testing.T) {
	c, ctx := liveClient(t), testContext(t)
	_, err := c.Generate(ctx, &Request{Prompt: "hello", Temperature: Ptr[float32](-1)})
	var e *Error
	if !errors.As(err, &e) || !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("want an InvalidArgument *Error, got %#v", err)
	}
	if _, ok := e.Field("sampling.temperature"); !ok || !strings.Contains(e.Message, "sampling.temperature") {
		t.Fatalf("the error must name sampling.temperature: %v %+v", e, e.FieldViolations)
	}
	stream, err := c.Stream(ctx, &Request{Prompt: "hello", TopP: Ptr[float32](2)})
	if err == nil {
		stream.Next()
		err = stream.Err()
	}
	if !errors.As(err, &e) || e.Code != ErrInvalidArgument.Code || len(e.FieldViolations) != 1 ||
		e.FieldViolations[0].Field != "sampling.top_p" {
		t.Fatalf("stream: want INVALID_ARGUMENT naming sampling.top_p, got %v", err)
	}
}

func TestLiveBidiTwoRequestsOneCancelledOneBad(t *testing.T) {
	c, ctx := liveClient(t), testContext(t)
	bidi, err := c.Bidi(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer bidi.Close()
	short, err := bidi.Start(&Request{Prompt: "the dog", MaxNewTokens: Ptr[uint32](5), IgnoreEOS: true})
	if err != nil {
		t.Fatal(err)
	}
	long, err := bidi.Start(&Request{RequestID: "long", Prompt: "the cat", MaxNewTokens: Ptr[uint32](4000), IgnoreEOS: true})
	if err != nil {
		t.Fatal(err)
	}
	bad, err := bidi.Start(&Request{Prompt: "hello", TopP: Ptr[float32](2)})
	if err != nil {
		t.Fatal(err)
	}
	cancelled := false
	results, errs := map[string]*Result{}, map[string]error{}
	for bidi.Next() {
		ev := bidi.Event()
		if ev.RequestID == long && ev.Delta != nil && !cancelled {
			if err := bidi.Cancel(long); err != nil {
				t.Fatal(err)
			}
			cancelled = true
		}
		if ev.Result != nil {
			results[ev.RequestID] = ev.Result
		} else if ev.Err != nil {
			errs[ev.RequestID] = ev.Err
		}
	}
	if err := bidi.Err(); err != nil {
		t.Fatal(err)
	}
	if len(results[short].TokenIDs) != 5 || results[long].FinishReason != "CANCELLED" ||
		!errors.Is(errs[bad], ErrInvalidArgument) {
		t.Fatalf("results %+v errors %v", results, errs)
	}
	var e *Error
	if errors.As(errs[bad], &e); e == nil || len(e.FieldViolations) == 0 || e.FieldViolations[0].Field != "sampling.top_p" {
		t.Fatalf("bidi error event must name sampling.top_p: %v", errs[bad])
	}
	if err := bidi.Close(); err != nil {
		t.Fatal(err)
	}
}

func TestLiveWithoutTokenIsUnauthenticated(t *testing.T) {
	if os.Getenv("GENAI_TOKEN") == "" {
		t.Skip("the server has no token")
	}
	target, opts := liveOptions(t, false)
	c, err := Dial(target, opts...)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.ModelInfo(testContext(t)); !errors.Is(err, ErrUnauthenticated) {
		t.Fatalf("want ErrUnauthenticated, got %v", err)
	}
}

func TestLiveModelInfoAndTokenizer(t *testing.T) {
	c, ctx := liveClient(t), testContext(t)
	info, err := c.ModelInfo(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.VocabSize == 0 || info.ContextLength == 0 || info.RunnerKind == "" {
		t.Fatalf("model info %+v", info)
	}
	ids, err := c.Tokenize(ctx, "the cat")
	if err != nil || len(ids) == 0 {
		t.Fatalf("tokenize: %v %v", ids, err)
	}
	text, err := c.Detokenize(ctx, ids)
	if err != nil || text != "the cat" {
		t.Fatalf("detokenize: %q %v", text, err)
	}
}

func TestLiveRewindAndFork(t *testing.T) {
	c, ctx := liveClient(t), testContext(t)
	s, err := c.NewSession(ctx, SessionOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close(ctx)
	req := func(prompt string) *Request {
		return &Request{Prompt: prompt, MaxNewTokens: Ptr[uint32](4), IgnoreEOS: true}
	}
	t1, err := s.Generate(ctx, req("hello , who are you ?"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Generate(ctx, req("what is your name ?")); err != nil {
		t.Fatal(err)
	}
	fork, err := c.ForkSession(ctx, s.ID(), ForkOptions{Turns: Ptr[uint32](1), Metadata: map[string]string{"b": "1"}})
	if err != nil {
		t.Fatal(err)
	}
	defer c.CloseSession(ctx, fork.ID)
	if fork.Turns != 1 || fork.HistoryTokens != t1.SessionTokens || fork.Metadata["b"] != "1" {
		t.Fatalf("fork %+v, turn 1 ended at %d tokens", fork, t1.SessionTokens)
	}
	info, err := c.RewindSessionToTurns(ctx, s.ID(), 1)
	if err != nil {
		t.Fatal(err)
	}
	if info.Turns != 1 || info.HistoryTokens != t1.SessionTokens {
		t.Fatalf("rewound %+v", info)
	}
	if info, err = c.RewindSessionToTokens(ctx, s.ID(), 2); err != nil || info.HistoryTokens != 2 {
		t.Fatalf("rewound to 2 tokens: %+v %v", info, err)
	}
	if _, err := c.RewindSessionToTurns(ctx, s.ID(), 5); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("rewind past the end: %v", err)
	}
}
