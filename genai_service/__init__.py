"""genai-grpc server side: the engine (ONNX Runtime) and the gRPC frontend."""

__version__ = "0.1.0"
