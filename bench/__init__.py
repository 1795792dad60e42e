"""Benchmarks of genai-grpc against onnxruntime-genai (``python -m bench.run``).

Modules: ``workload`` (prompts and statistics), ``procs`` (machine info, peak
RSS, child processes), ``ours`` (our engine in-process and through the gRPC
server), ``ortgenai`` (onnxruntime-genai in its own worker processes),
``suite`` (the measurements, rep by rep), ``report`` (the targets and the
markdown section of ``docs/benchmarks.md``) and ``run`` (the command line).
Kept free of imports so that the onnxruntime-genai worker
(``python -m bench.ortgenai``) loads nothing of ours.
"""
