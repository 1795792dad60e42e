package genai

import (
	"encoding/json"
	"errors"
	"fmt"
	"strings"

	"google.golang.org/protobuf/proto"

	pb "github.com/genai-grpc/genai-grpc/clients/go/gen/genai/v1"
)

// Ptr returns a pointer to v, for the optional fields of Request:
// Request{Temperature: genai.Ptr[float32](0.8)}.
func Ptr[T any](v T) *T { return &v }

// Message is one message of a chat conversation ("system", "user",
// "assistant" or "tool"); a tool's result names the ToolCallID it answers.
type Message struct {
	Role       string
	Content    string
	Name       string
	ToolCallID string
	ToolCalls  []ToolCall
}

// ToolCall is a call of one of the request's tools; ArgumentsJSON is a JSON
// object as text.
type ToolCall struct {
	ID            string
	Name          string
	ArgumentsJSON string
}

// Tool is a function the model may call; ParametersJSONSchema is the JSON
// Schema of its arguments (empty: any object).
type Tool struct {
	Name                 string
	Description          string
	ParametersJSONSchema string
}

// FIM is a fill-in-the-middle input (generate.proto's Fim).
type FIM struct {
	Prefix, Suffix string
	Mode           string // "" or "psm": prefix, suffix, middle; "spm": suffix first
}

var fimModes = map[string]pb.FimMode{
	"":    pb.FimMode_FIM_MODE_UNSPECIFIED,
	"psm": pb.FimMode_FIM_MODE_PSM,
	"spm": pb.FimMode_FIM_MODE_SPM,
}

// Request is one generation request; the zero value of every optional field
// (nil pointers, empty strings and slices, false) leaves it unset so that
// the server's default applies. The fields and their names follow the
// Python client's keyword options; protos/genai/v1/generate.proto has the
// exact semantics.
type Request struct {
	// Input: exactly one of Prompt, TokenIDs, Messages and FIM.
	Prompt   string
	TokenIDs []uint32
	Messages []Message
	// FIM: fill in between Prefix and Suffix (the model needs FIM tokens,
	// ModelInfo.FIMSupported); Mode "" or "psm", or "spm".
	FIM *FIM

	// SessionID makes the request a turn of that session (Session sets it).
	SessionID string
	// RequestID: empty lets the server assign one (Bidi.Start makes one).
	RequestID string

	// Sampling. Temperature nil or 0: greedy decoding.
	Temperature       *float32
	TopK              *uint32
	TopP              *float32
	MinP              *float32
	RepetitionPenalty *float32
	FrequencyPenalty  *float32
	PresencePenalty   *float32
	Seed              *uint64

	// The rest of the decoding surface (generate.proto's SamplingParams has
	// the semantics and ranges); nil or empty is off.
	RepetitionPenaltyLastN *uint32
	TypicalP               *float32
	TopA                   *float32
	XTCThreshold           *float32
	XTCProbability         *float32
	DRYMultiplier          *float32
	DRYBase                *float32
	DRYAllowedLength       *uint32
	DRYPenaltyLastN        *uint32
	DRYSequenceBreakers    []string
	Mirostat               *uint32 // 2: Mirostat v2
	MirostatTau            *float32
	MirostatEta            *float32
	// LogitBias is added to those token ids' logits, each in [-100, 100].
	LogitBias       map[uint32]float32
	BannedTokenIDs  []uint32
	AllowedTokenIDs []uint32
	BadWords        []string

	// Stopping.
	MaxNewTokens        *uint32
	MinNewTokens        uint32
	Stop                []string
	StopTokenIDs        []uint32
	IgnoreEOS           bool
	IncludeStopSequence bool
	TimeLimitMs         *uint32

	// TopLogprobs: N >= 1 returns every token's logprob with the N most
	// likely alternatives.
	TopLogprobs uint32
	// PromptLogprobs: N >= 1 returns every prompt token's logprob (but the
	// first's) with N alternatives, in Result.PromptLogprobs.
	PromptLogprobs uint32
	// N > 1: that many completions (Result.Completions, Delta.Index), the
	// prompt prefilled once; BestOf >= N generates more and returns the N
	// most likely.
	N      uint32
	BestOf *uint32
	// Priority: "", "low", "normal" or "high".
	Priority          string
	AddSpecialTokens  *bool
	SkipSpecialTokens *bool
	// CacheSalt: only requests with the same salt share reused prompt KV.
	CacheSalt string
	// TruncatePromptTokens: a longer prompt keeps its first sink tokens and
	// its last ones, this many in all (Usage.DroppedTokens counts the rest).
	TruncatePromptTokens *uint32
	// ChatTemplateKwargs: with Messages, more variables for the model's chat
	// template, e.g. {"enable_thinking": false} for Qwen3.
	ChatTemplateKwargs map[string]any
	// ContextOverflow: at the context window, "error" stops and "slide"
	// drops the oldest tokens after the sink tokens and goes on; "": the
	// session's or the server's default.
	ContextOverflow string

	// Structured output, at most one.
	JSONSchema string
	Regex      string
	Grammar    string
	Choice     []string
	JSONObject bool

	// Tools (with Messages) and ToolChoice ("", "auto", "none", "required"
	// or a tool's name).
	Tools      []Tool
	ToolChoice string
}

var overflows = map[string]pb.ContextOverflow{
	"":      pb.ContextOverflow_CONTEXT_OVERFLOW_UNSPECIFIED,
	"error": pb.ContextOverflow_CONTEXT_OVERFLOW_ERROR,
	"slide": pb.ContextOverflow_CONTEXT_OVERFLOW_SLIDE,
}

// contextOverflow is ContextOverflow as its proto value.
func contextOverflow(mode string) (pb.ContextOverflow, error) {
	value, ok := overflows[strings.ToLower(strings.TrimPrefix(mode, "CONTEXT_OVERFLOW_"))]
	if !ok {
		return 0, fmt.Errorf("genai: ContextOverflow %q is not one of \"error\", \"slide\"", mode)
	}
	return value, nil
}

var priorities = map[string]pb.Priority{
	"":       pb.Priority_PRIORITY_UNSPECIFIED,
	"low":    pb.Priority_PRIORITY_LOW,
	"normal": pb.Priority_PRIORITY_NORMAL,
	"high":   pb.Priority_PRIORITY_HIGH,
}

func toolCallsProto(calls []ToolCall) []*pb.ToolCall {
	out := make([]*pb.ToolCall, len(calls))
	for i, c := range calls {
		out[i] = &pb.ToolCall{Id: c.ID, Name: c.Name, ArgumentsJson: c.ArgumentsJSON}
	}
	return out
}

func messagesProto(messages []Message) *pb.Messages {
	out := &pb.Messages{Messages: make([]*pb.ChatMessage, len(messages))}
	for i, m := range messages {
		out.Messages[i] = &pb.ChatMessage{
			Role: m.Role, Content: m.Content, Name: m.Name,
			ToolCallId: m.ToolCallID, ToolCalls: toolCallsProto(m.ToolCalls),
		}
	}
	return out
}

func (r *Request) constraint() (*pb.Constraint, error) {
	var set []string
	var c *pb.Constraint
	if r.JSONSchema != "" {
		set, c = append(set, "JSONSchema"), &pb.Constraint{Kind: &pb.Constraint_JsonSchema{JsonSchema: r.JSONSchema}}
	}
	if r.Regex != "" {
		set, c = append(set, "Regex"), &pb.Constraint{Kind: &pb.Constraint_Regex{Regex: r.Regex}}
	}
	if r.Grammar != "" {
		set, c = append(set, "Grammar"), &pb.Constraint{Kind: &pb.Constraint_Grammar{Grammar: r.Grammar}}
	}
	if r.Choice != nil {
		set, c = append(set, "Choice"), &pb.Constraint{Kind: &pb.Constraint_Choice{Choice: &pb.Choice{Choices: r.Choice}}}
	}
	if r.JSONObject {
		set, c = append(set, "JSONObject"), &pb.Constraint{Kind: &pb.Constraint_JsonObject{JsonObject: true}}
	}
	if len(set) > 1 {
		return nil, fmt.Errorf("genai: give at most one constraint (got %s)", strings.Join(set, ", "))
	}
	return c, nil
}

// Proto is the request as a genai.v1.GenerateRequest; it fails (before any
// call) when the input is not exactly one of Prompt, TokenIDs and Messages,
// when more than one constraint is set, or on an unknown Priority.
func (r *Request) Proto() (*pb.GenerateRequest, error) {
	if r == nil {
		return nil, errors.New("genai: nil Request")
	}
	out := &pb.GenerateRequest{
		RequestId:         r.RequestID,
		SessionId:         r.SessionID,
		TopLogprobs:       r.TopLogprobs,
		PromptLogprobs:    r.PromptLogprobs,
		N:                 r.N,
		BestOf:            r.BestOf,
		AddSpecialTokens:  r.AddSpecialTokens,
		SkipSpecialTokens: r.SkipSpecialTokens,
		ToolChoice:        r.ToolChoice,
	}
	var inputs []string
	if r.Prompt != "" {
		inputs, out.Input = append(inputs, "Prompt"), &pb.GenerateRequest_Text{Text: r.Prompt}
	}
	if r.TokenIDs != nil {
		inputs, out.Input = append(inputs, "TokenIDs"), &pb.GenerateRequest_TokenIds{TokenIds: &pb.TokenIds{Ids: r.TokenIDs}}
	}
	if r.Messages != nil {
		inputs, out.Input = append(inputs, "Messages"), &pb.GenerateRequest_Messages{Messages: messagesProto(r.Messages)}
	}
	if r.FIM != nil {
		mode, ok := fimModes[strings.ToLower(r.FIM.Mode)]
		if !ok {
			return nil, fmt.Errorf("genai: FIM.Mode %q is not one of \"psm\", \"spm\"", r.FIM.Mode)
		}
		inputs, out.Input = append(inputs, "FIM"), &pb.GenerateRequest_Fim{Fim: &pb.Fim{
			Prefix: r.FIM.Prefix, Suffix: r.FIM.Suffix, Mode: mode,
		}}
	}
	if len(inputs) != 1 {
		return nil, fmt.Errorf("genai: give exactly one of Prompt, TokenIDs, Messages, FIM (got %d: %s)",
			len(inputs), strings.Join(inputs, ", "))
	}
	priority, ok := priorities[strings.ToLower(strings.TrimPrefix(r.Priority, "PRIORITY_"))]
	if !ok {
		return nil, fmt.Errorf("genai: Priority %q is not one of \"low\", \"normal\", \"high\"", r.Priority)
	}
	out.Priority = priority
	if r.CacheSalt != "" {
		out.CacheSalt = &r.CacheSalt
	}
	out.TruncatePromptTokens = r.TruncatePromptTokens
	if len(r.ChatTemplateKwargs) > 0 {
		kwargs, err := json.Marshal(r.ChatTemplateKwargs)
		if err != nil {
			return nil, fmt.Errorf("genai: ChatTemplateKwargs: %w", err)
		}
		out.ChatTemplateKwargs = string(kwargs)
	}
	overflow, err := contextOverflow(r.ContextOverflow)
	if err != nil {
		return nil, err
	}
	out.ContextOverflow = overflow
	sampling := &pb.SamplingParams{
		Temperature: r.Temperature, TopK: r.TopK, TopP: r.TopP, MinP: r.MinP,
		RepetitionPenalty: r.RepetitionPenalty, FrequencyPenalty: r.FrequencyPenalty,
		PresencePenalty: r.PresencePenalty, Seed: r.Seed,
		RepetitionPenaltyLastN: r.RepetitionPenaltyLastN, TypicalP: r.TypicalP, TopA: r.TopA,
		XtcThreshold: r.XTCThreshold, XtcProbability: r.XTCProbability,
		DryMultiplier: r.DRYMultiplier, DryBase: r.DRYBase, DryAllowedLength: r.DRYAllowedLength,
		DryPenaltyLastN: r.DRYPenaltyLastN, DrySequenceBreakers: r.DRYSequenceBreakers,
		Mirostat: r.Mirostat, MirostatTau: r.MirostatTau, MirostatEta: r.MirostatEta,
		LogitBias: r.LogitBias, BannedTokenIds: r.BannedTokenIDs,
		AllowedTokenIds: r.AllowedTokenIDs, BadWords: r.BadWords,
	}
	if proto.Size(sampling) > 0 {
		out.Sampling = sampling
	}
	if r.MaxNewTokens != nil || r.MinNewTokens != 0 || r.Stop != nil || r.StopTokenIDs != nil ||
		r.IgnoreEOS || r.IncludeStopSequence || r.TimeLimitMs != nil {
		out.Stopping = &pb.StoppingCriteria{
			MaxNewTokens: r.MaxNewTokens, MinNewTokens: r.MinNewTokens,
			StopSequences: r.Stop, StopTokenIds: r.StopTokenIDs, IgnoreEos: r.IgnoreEOS,
			IncludeStopSequence: r.IncludeStopSequence, TimeLimitMs: r.TimeLimitMs,
		}
	}
	constraint, err := r.constraint()
	if err != nil {
		return nil, err
	}
	out.Constraint = constraint
	for _, t := range r.Tools {
		out.Tools = append(out.Tools, &pb.Tool{
			Name: t.Name, Description: t.Description, ParametersJsonSchema: t.ParametersJSONSchema,
		})
	}
	return out, nil
}
