package genai

import (
	"strings"
	"time"

	pb "github.com/genai-grpc/genai-grpc/clients/go/gen/genai/v1"
)

// Usage is the token accounting of one request. CachedTokens are prompt
// tokens whose KV cache was reused (prefix cache, session history, kvstore)
// instead of recomputed; DroppedTokens were cut by TruncatePromptTokens or
// dropped by a context slide.
type Usage struct {
	PromptTokens     uint32
	CompletionTokens uint32
	CachedTokens     uint32
	DroppedTokens    uint32
}

// TopLogprob is one alternative token at a generation step.
type TopLogprob struct {
	TokenID uint32
	Text    string
	Logprob float32
}

// TokenLogprob is the natural-log probability of a generated token, with the
// most likely alternatives at that step (most likely first).
type TokenLogprob struct {
	TokenID uint32
	Text    string
	Logprob float32
	Top     []TopLogprob
}

// Delta is the output of a streamed request since its previous delta. Text
// may be empty while the new tokens do not complete a character (or may
// start a stop sequence); the deltas' texts concatenated are the whole text.
type Delta struct {
	Text     string
	TokenIDs []uint32
	Logprobs []TokenLogprob
	// PromptLogprobs: the first delta of a request with PromptLogprobs.
	PromptLogprobs []TokenLogprob
	// Index: with Request.N > 1, the completion these tokens belong to.
	Index uint32
}

// Completion is one of the completions of a request with N > 1.
type Completion struct {
	Index        uint32
	Text         string
	TokenIDs     []uint32
	FinishReason string
	StopSequence string
	Logprobs     []TokenLogprob
	ToolCalls    []ToolCall
}

func completionsFrom(in []*pb.Completion, texts map[uint32]string) []Completion {
	if len(in) == 0 {
		return nil
	}
	out := make([]Completion, len(in))
	for i, c := range in {
		text := c.GetText()
		if texts != nil {
			text = texts[c.GetIndex()]
		}
		out[i] = Completion{
			Index: c.GetIndex(), Text: text, TokenIDs: c.GetTokenIds(),
			FinishReason: finishReason(c.GetFinishReason()), StopSequence: c.GetStopSequence(),
			Logprobs: logprobsFrom(c.GetLogprobs()), ToolCalls: toolCallsFrom(c.GetToolCalls()),
		}
	}
	return out
}

// Result is the whole outcome of one request. FinishReason is one of
// "MAX_TOKENS", "EOS_TOKEN", "STOP_SEQUENCE", "CONTEXT_LENGTH",
// "TIME_LIMIT", "CANCELLED". SessionID is empty and SessionTokens 0 for a
// stateless request.
type Result struct {
	Text          string
	TokenIDs      []uint32
	FinishReason  string
	StopSequence  string
	Logprobs      []TokenLogprob
	Usage         Usage
	Seed          uint64
	SessionID     string
	SessionTokens uint32
	RequestID     string
	ToolCalls     []ToolCall
	// PromptLogprobs (Request.PromptLogprobs): entry i is prompt token i+1's.
	PromptLogprobs []TokenLogprob
	// Completions: with Request.N > 1, every completion (the fields above
	// are completion 0's).
	Completions []Completion
}

// SessionInfo is a server-side session (SessionService).
type SessionInfo struct {
	ID             string
	CreatedAt      time.Time
	LastUsedAt     time.Time
	HistoryTokens  uint32
	Turns          uint32
	IdleTTLSeconds uint32
	Busy           bool
	Metadata       map[string]string
	// ContextOverflow is "error" or "slide"; DroppedTokens counts the history
	// the window's slides dropped since creation or the last reset.
	ContextOverflow string
	DroppedTokens   uint64
}

// ModelInfo describes the served model. RunnerKind is "PAST_PRESENT",
// "SHARED_BUFFER" or "STATIC_CACHE".
type ModelInfo struct {
	ModelID         string
	ContextLength   uint32
	VocabSize       uint32
	EOSTokenIDs     []uint32
	RunnerKind      string
	HasChatTemplate bool
	KVChunkSize     uint32
	// FIMSupported: the tokenizer has fill-in-the-middle tokens (Request.FIM).
	FIMSupported bool
	// SpeculativeMode: "" (speculation off), "PROMPT_LOOKUP", "DRAFT" or "AUTO";
	// SpeculativeTokens: draft tokens checked per step; DraftModelID: the
	// draft model's id ("" without one).
	SpeculativeMode   string
	SpeculativeTokens uint32
	DraftModelID      string
}

func logprobsFrom(in []*pb.TokenLogprob) []TokenLogprob {
	if len(in) == 0 {
		return nil
	}
	out := make([]TokenLogprob, len(in))
	for i, l := range in {
		top := make([]TopLogprob, len(l.GetTop()))
		for j, t := range l.GetTop() {
			top[j] = TopLogprob{t.GetTokenId(), t.GetText(), t.GetLogprob()}
		}
		out[i] = TokenLogprob{l.GetTokenId(), l.GetText(), l.GetLogprob(), top}
	}
	return out
}

func toolCallsFrom(in []*pb.ToolCall) []ToolCall {
	var out []ToolCall
	for _, c := range in {
		out = append(out, ToolCall{c.GetId(), c.GetName(), c.GetArgumentsJson()})
	}
	return out
}

func usageFrom(u *pb.Usage) Usage {
	return Usage{u.GetPromptTokens(), u.GetCompletionTokens(), u.GetCachedTokens(), u.GetDroppedTokens()}
}

func finishReason(r pb.FinishReason) string {
	return strings.TrimPrefix(r.String(), "FINISH_REASON_")
}

func resultFromResponse(r *pb.GenerateResponse) *Result {
	return &Result{
		Text: r.GetText(), TokenIDs: r.GetTokenIds(), FinishReason: finishReason(r.GetFinishReason()),
		StopSequence: r.GetStopSequence(), Logprobs: logprobsFrom(r.GetLogprobs()),
		Usage: usageFrom(r.GetUsage()), Seed: r.GetSeed(), SessionID: r.GetSessionId(),
		SessionTokens: r.GetSessionTokens(), RequestID: r.GetRequestId(),
		ToolCalls: toolCallsFrom(r.GetToolCalls()), PromptLogprobs: logprobsFrom(r.GetPromptLogprobs()),
		Completions: completionsFrom(r.GetCompletions(), nil),
	}
}

// resultFromFinal is a stream's Result: its text is the deltas' text.
func resultFromFinal(f *pb.Final, text string) *Result {
	return &Result{
		Text: text, TokenIDs: f.GetTokenIds(), FinishReason: finishReason(f.GetFinishReason()),
		StopSequence: f.GetStopSequence(), Logprobs: logprobsFrom(f.GetLogprobs()),
		Usage: usageFrom(f.GetUsage()), Seed: f.GetSeed(), SessionID: f.GetSessionId(),
		SessionTokens: f.GetSessionTokens(), RequestID: f.GetRequestId(),
		ToolCalls: toolCallsFrom(f.GetToolCalls()),
	}
}

func deltaFrom(d *pb.Delta) Delta {
	return Delta{
		Text: d.GetText(), TokenIDs: d.GetTokenIds(), Logprobs: logprobsFrom(d.GetLogprobs()),
		PromptLogprobs: logprobsFrom(d.GetPromptLogprobs()), Index: d.GetIndex(),
	}
}

func sessionFrom(s *pb.Session) SessionInfo {
	return SessionInfo{
		ID: s.GetSessionId(), CreatedAt: s.GetCreatedAt().AsTime(), LastUsedAt: s.GetLastUsedAt().AsTime(),
		HistoryTokens: s.GetHistoryTokens(), Turns: s.GetTurns(), IdleTTLSeconds: s.GetIdleTtlSeconds(),
		Busy: s.GetBusy(), Metadata: s.GetMetadata(),
		ContextOverflow: strings.ToLower(strings.TrimPrefix(s.GetContextOverflow().String(), "CONTEXT_OVERFLOW_")),
		DroppedTokens:   s.GetDroppedTokens(),
	}
}

func modelInfoFrom(m *pb.ModelInfo) ModelInfo {
	return ModelInfo{
		ModelID: m.GetModelId(), ContextLength: m.GetContextLength(), VocabSize: m.GetVocabSize(),
		EOSTokenIDs: m.GetEosTokenIds(), RunnerKind: strings.TrimPrefix(m.GetRunnerKind().String(), "RUNNER_KIND_"),
		HasChatTemplate: m.GetHasChatTemplate(), KVChunkSize: m.GetKvChunkSize(),
		FIMSupported: m.GetFimSupported(), SpeculativeMode: speculativeMode(m.GetSpeculativeMode()),
		SpeculativeTokens: m.GetSpeculativeTokens(), DraftModelID: m.GetDraftModelId(),
	}
}

func speculativeMode(m pb.SpeculativeMode) string {
	if m == pb.SpeculativeMode_SPECULATIVE_MODE_UNSPECIFIED {
		return ""
	}
	return strings.TrimPrefix(m.String(), "SPECULATIVE_MODE_")
}
