"""The gRPC frontend: servicers, the engine process handle, start-up and shutdown."""
