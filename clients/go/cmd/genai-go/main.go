// Command genai-go streams one generation to stdout:
//
//	genai-go -target localhost:50051 -max-new-tokens 64 "Once upon a time"
//
// The prompt is the arguments joined by spaces, or stdin when there are
// none. The finish reason and token usage go to stderr.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"

	"github.com/genai-grpc/genai-grpc/clients/go/genai"
)

func main() {
	target := flag.String("target", "localhost:50051", "server address, host:port")
	useTLS := flag.Bool("tls", false, "dial over TLS (system roots unless -ca)")
	ca := flag.String("ca", "", "PEM CA bundle to verify the server (implies -tls)")
	cert := flag.String("cert", "", "PEM client certificate for mTLS (with -key)")
	key := flag.String("key", "", "PEM client key for mTLS")
	tokenFile := flag.String("token-file", "", "file holding the bearer token (else $GENAI_TOKEN)")
	insecureToken := flag.Bool("insecure-token", false, "allow the token over plaintext")
	maxNew := flag.Uint("max-new-tokens", 0, "most tokens to generate (0: the server's default)")
	temperature := flag.Float64("temperature", 0, "sampling temperature (0: greedy)")
	seed := flag.Int64("seed", -1, "sampling seed (-1: the server picks one)")
	session := flag.String("session", "", "run as a turn of this session id")
	flag.Parse()

	prompt := strings.Join(flag.Args(), " ")
	if prompt == "" {
		in, err := io.ReadAll(os.Stdin)
		if err != nil {
			fail(err)
		}
		prompt = string(in)
	}
	var opts []genai.Option
	if *useTLS {
		opts = append(opts, genai.WithTLS())
	}
	if *ca != "" {
		opts = append(opts, genai.WithCAFile(*ca))
	}
	if *cert != "" || *key != "" {
		opts = append(opts, genai.WithClientCertificate(*cert, *key))
	}
	token := os.Getenv("GENAI_TOKEN")
	if *tokenFile != "" {
		b, err := os.ReadFile(*tokenFile)
		if err != nil {
			fail(err)
		}
		token = strings.TrimSpace(string(b))
	}
	if token != "" {
		opts = append(opts, genai.WithToken(token))
	}
	if *insecureToken {
		opts = append(opts, genai.WithInsecureToken())
	}
	client, err := genai.Dial(*target, opts...)
	if err != nil {
		fail(err)
	}
	defer client.Close()

	req := &genai.Request{Prompt: prompt, SessionID: *session}
	if *maxNew > 0 {
		req.MaxNewTokens = genai.Ptr(uint32(*maxNew))
	}
	if *temperature > 0 {
		req.Temperature = genai.Ptr(float32(*temperature))
	}
	if *seed >= 0 {
		req.Seed = genai.Ptr(uint64(*seed))
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt) // Ctrl-C cancels the request
	defer stop()
	stream, err := client.Stream(ctx, req)
	if err != nil {
		fail(err)
	}
	defer stream.Close()
	for stream.Next() {
		fmt.Print(stream.Delta().Text)
	}
	fmt.Println()
	if err := stream.Err(); err != nil {
		fail(err)
	}
	final := stream.Final()
	fmt.Fprintf(os.Stderr, "finish_reason=%s prompt_tokens=%d completion_tokens=%d cached_tokens=%d\n",
		final.FinishReason, final.Usage.PromptTokens, final.Usage.CompletionTokens, final.Usage.CachedTokens)
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "genai-go:", err)
	if e, ok := err.(*genai.Error); ok {
		for _, v := range e.FieldViolations {
			fmt.Fprintf(os.Stderr, "  %s: %s\n", v.Field, v.Description)
		}
	}
	os.Exit(1)
}
