// Command genai-bench runs streams at once against a server and reports when
// each one's tokens arrived, for bench/ (the Go client's rows of `make bench`):
//
//	genai-bench -target localhost:50051 < plan.json > result.json
//
// The plan on stdin is a JSON list of requests, each
// {"token_ids": [...], "max_new_tokens": N, "temperature": T, "top_k": K,
// "top_p": P, "repetition_penalty": R, "seed": S} (sampling fields optional:
// greedy without them; EOS is always ignored). It dials, calls ModelInfo so
// the connection is up before the clock starts, then starts every request at
// once, each in its own goroutine. The result on stdout is
// {"streams": [{"first_s": .., "last_s": .., "tokens": n}, ...], "cpu_s": c}:
// seconds from the submit instant to each stream's first and last token, and
// the CPU seconds (user + system) this process took from submit to the end.
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"sync"
	"syscall"
	"time"

	"github.com/genai-grpc/genai-grpc/clients/go/genai"
)

type planned struct {
	TokenIDs          []uint32 `json:"token_ids"`
	MaxNewTokens      uint32   `json:"max_new_tokens"`
	Temperature       *float32 `json:"temperature"`
	TopK              *uint32  `json:"top_k"`
	TopP              *float32 `json:"top_p"`
	RepetitionPenalty *float32 `json:"repetition_penalty"`
	Seed              *uint64  `json:"seed"`
}

type timing struct {
	FirstS float64 `json:"first_s"`
	LastS  float64 `json:"last_s"`
	Tokens int     `json:"tokens"`
	Error  string  `json:"error,omitempty"`
}

func main() {
	target := "localhost:50051"
	if len(os.Args) == 3 && os.Args[1] == "-target" {
		target = os.Args[2]
	} else if len(os.Args) != 1 {
		fmt.Fprintln(os.Stderr, "usage: genai-bench [-target host:port] < plan.json")
		os.Exit(2)
	}
	var plan []planned
	if err := json.NewDecoder(os.Stdin).Decode(&plan); err != nil {
		fail(fmt.Errorf("plan: %w", err))
	}
	client, err := genai.Dial(target)
	if err != nil {
		fail(err)
	}
	defer client.Close()
	ctx := context.Background()
	if _, err := client.ModelInfo(ctx); err != nil {
		fail(err)
	}

	out := make([]timing, len(plan))
	var wg sync.WaitGroup
	cpu0 := cpuSeconds()
	submit := time.Now()
	for i := range plan {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			out[i] = run(ctx, client, &plan[i], submit)
		}(i)
	}
	wg.Wait()
	result := struct {
		Streams []timing `json:"streams"`
		CPUS    float64  `json:"cpu_s"`
	}{out, cpuSeconds() - cpu0}
	if err := json.NewEncoder(os.Stdout).Encode(result); err != nil {
		fail(err)
	}
}

func run(ctx context.Context, client *genai.Client, p *planned, submit time.Time) timing {
	req := &genai.Request{
		TokenIDs:          p.TokenIDs,
		MaxNewTokens:      genai.Ptr(p.MaxNewTokens),
		IgnoreEOS:         true,
		Temperature:       p.Temperature,
		TopK:              p.TopK,
		TopP:              p.TopP,
		RepetitionPenalty: p.RepetitionPenalty,
		Seed:              p.Seed,
	}
	var t timing
	stream, err := client.Stream(ctx, req)
	if err != nil {
		t.Error = err.Error()
		return t
	}
	defer stream.Close()
	for stream.Next() {
		if n := len(stream.Delta().TokenIDs); n > 0 {
			t.LastS = time.Since(submit).Seconds()
			if t.Tokens == 0 {
				t.FirstS = t.LastS
			}
			t.Tokens += n
		}
	}
	if err := stream.Err(); err != nil {
		t.Error = err.Error()
	}
	return t
}

// cpuSeconds is this process's user + system CPU time so far.
func cpuSeconds() float64 {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	tv := func(t syscall.Timeval) float64 { return float64(t.Sec) + float64(t.Usec)/1e6 }
	return tv(ru.Utime) + tv(ru.Stime)
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "genai-bench:", err)
	os.Exit(1)
}
