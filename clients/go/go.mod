module github.com/genai-grpc/genai-grpc/clients/go

go 1.19

require (
	google.golang.org/genproto v0.0.0-20200413115906-b5235f65be36
	google.golang.org/grpc v1.33.3
	google.golang.org/protobuf v1.28.1
)
