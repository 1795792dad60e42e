# genai-grpc: one place for set-up, tests and running.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.setup-stamp

.PHONY: setup stubs test test-fast lint serve bench clean

PROTOS := $(shell find protos -name '*.proto' 2>/dev/null)
PROTO_OUT := genai_service/_proto
PROTO_STAMP := $(PROTO_OUT)/.stamp

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -e '.[dev]'
	@touch $(STAMP)

# Generated stubs are build output: git-ignored, never edited. protoc writes
# absolute imports (`from genai.v1 import ...`); they are rewritten to the
# package they live in, since `kvstore` is also our own top-level package.
$(PROTO_STAMP): $(PROTOS) $(STAMP)
	rm -rf $(PROTO_OUT) && mkdir -p $(PROTO_OUT)
	@if [ -n "$(PROTOS)" ]; then \
	  $(PY) -m grpc_tools.protoc -Iprotos --python_out=$(PROTO_OUT) --pyi_out=$(PROTO_OUT) \
	    --grpc_python_out=$(PROTO_OUT) $(PROTOS) && \
	  find $(PROTO_OUT) -type d -exec touch {}/__init__.py \; && \
	  find $(PROTO_OUT) -name '*.py' -o -name '*.pyi' | xargs sed -i -E \
	    's/^from (genai|kvstore)(\.v1)? import/from genai_service._proto.\1\2 import/'; \
	fi
	@touch $(PROTO_OUT)/__init__.py $(PROTO_STAMP)

stubs: $(PROTO_STAMP)

setup: $(STAMP) $(PROTO_STAMP)

test: setup
	$(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check genai_service genai_client kvstore tests
	$(VENV)/bin/mypy genai_service

clean:
	rm -rf $(VENV) build *.egg-info
