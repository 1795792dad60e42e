package genai

import (
	"context"
	"errors"
	"testing"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

func TestRequestProtoSetsOnlyWhatIsGiven(t *testing.T) {
	plain, err := (&Request{Prompt: "hi"}).Proto()
	if err != nil {
		t.Fatal(err)
	}
	if plain.GetText() != "hi" || plain.Sampling != nil || plain.Stopping != nil || plain.Constraint != nil {
		t.Fatalf("unset options must stay unset: %v", plain)
	}
	full, err := (&Request{
		TokenIDs: []uint32{5, 6}, Temperature: Ptr[float32](0.5), Seed: Ptr[uint64](7),
		MaxNewTokens: Ptr[uint32](3), Stop: []string{"."}, Priority: "high", CacheSalt: "s",
		Choice: []string{"yes", "no"}, ChatTemplateKwargs: map[string]any{"enable_thinking": false},
	}).Proto()
	if err != nil {
		t.Fatal(err)
	}
	if full.GetSampling().GetTemperature() != 0.5 || full.GetSampling().GetSeed() != 7 ||
		full.GetStopping().GetMaxNewTokens() != 3 || full.GetStopping().GetStopSequences()[0] != "." ||
		full.GetPriority().String() != "PRIORITY_HIGH" || full.GetCacheSalt() != "s" ||
		len(full.GetConstraint().GetChoice().GetChoices()) != 2 || len(full.GetTokenIds().GetIds()) != 2 ||
		full.GetChatTemplateKwargs() != `{"enable_thinking":false}` {
		t.Fatalf("options lost: %v", full)
	}
}

func TestRequestProtoCarriesTheDecodingSurface(t *testing.T) {
	req, err := (&Request{
		Prompt: "hi", TypicalP: Ptr[float32](0.9), Mirostat: Ptr[uint32](2),
		DRYMultiplier: Ptr[float32](0.8), DRYSequenceBreakers: []string{"\n"},
		LogitBias: map[uint32]float32{42: -100}, BannedTokenIDs: []uint32{1},
		AllowedTokenIDs: []uint32{2, 3}, BadWords: []string{"no"},
	}).Proto()
	if err != nil {
		t.Fatal(err)
	}
	s := req.GetSampling()
	if s.GetTypicalP() != 0.9 || s.GetMirostat() != 2 || s.GetDryMultiplier() != 0.8 ||
		s.GetDrySequenceBreakers()[0] != "\n" || s.GetLogitBias()[42] != -100 ||
		len(s.GetBannedTokenIds()) != 1 || len(s.GetAllowedTokenIds()) != 2 || s.GetBadWords()[0] != "no" {
		t.Fatalf("decoding options lost: %v", s)
	}
}

func TestRequestProtoFIM(t *testing.T) {
	req, err := (&Request{FIM: &FIM{Prefix: "a", Suffix: "b", Mode: "spm"}}).Proto()
	if err != nil {
		t.Fatal(err)
	}
	if f := req.GetFim(); f.GetPrefix() != "a" || f.GetSuffix() != "b" || f.GetMode().String() != "FIM_MODE_SPM" {
		t.Fatalf("FIM lost: %v", req)
	}
	if _, err := (&Request{Prompt: "x", FIM: &FIM{Prefix: "a"}}).Proto(); err == nil {
		t.Fatal("Prompt and FIM: want an error")
	}
	if _, err := (&Request{FIM: &FIM{Mode: "middle"}}).Proto(); err == nil {
		t.Fatal("an unknown FIM mode: want an error")
	}
}

func TestRequestProtoRefusesAmbiguousInput(t *testing.T) {
	for _, r := range []*Request{{}, {Prompt: "a", TokenIDs: []uint32{1}}, {Prompt: "a", Regex: "x", Grammar: "y"}, {Prompt: "a", Priority: "urgent"}} {
		if _, err := r.Proto(); err == nil {
			t.Errorf("%+v: want an error", r)
		}
	}
}

func TestErrorsCarryCodeAndFieldViolations(t *testing.T) {
	s, err := status.New(codes.InvalidArgument, "sampling.top_p: 2 is out of range").WithDetails(&errdetails.BadRequest{
		FieldViolations: []*errdetails.BadRequest_FieldViolation{{Field: "sampling.top_p", Description: "2 is out of range"}},
	})
	if err != nil {
		t.Fatal(err)
	}
	got := wrap(s.Err())
	var e *Error
	if !errors.As(got, &e) || !errors.Is(got, ErrInvalidArgument) || errors.Is(got, ErrNotFound) {
		t.Fatalf("not an InvalidArgument *Error: %#v", got)
	}
	if v, ok := e.Field("sampling.top_p"); !ok || v.Description != "2 is out of range" {
		t.Fatalf("field violations: %+v", e.FieldViolations)
	}
	if Code(got) != codes.InvalidArgument || status.Code(got) != codes.InvalidArgument {
		t.Fatalf("code: %v", Code(got))
	}
	canceled := wrap(status.Error(codes.Canceled, "context canceled"))
	if !errors.Is(canceled, context.Canceled) || !errors.Is(canceled, ErrCanceled) {
		t.Fatalf("a cancelled call must match context.Canceled: %v", canceled)
	}
}

func TestTokenOverPlaintextNeedsConsent(t *testing.T) {
	if _, err := Dial("127.0.0.1:1", WithToken("t")); err == nil {
		t.Fatal("a token over plaintext must be refused without WithInsecureToken")
	}
	c, err := Dial("127.0.0.1:1", WithToken("t"), WithInsecureToken())
	if err != nil {
		t.Fatal(err)
	}
	c.Close()
	if _, err := Dial("127.0.0.1:1", WithCAFile("/nonexistent/ca.pem")); err == nil {
		t.Fatal("a missing CA file must fail Dial")
	}
}
