# The one entry point for building, testing and running the driver.
# `make help` lists the targets.

CARGO ?= cargo
GO ?= go
TOOLS := $(CURDIR)/.tools

.PHONY: help build release test lint fmt fuzz bench generate

help: ## list targets
	@grep -E '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/' | sort

build: ## debug build of every crate
	$(CARGO) build --workspace --all-targets

release: ## release build of the binaries and the simulator
	$(CARGO) build --release --workspace

lint: ## rustfmt check and clippy with warnings as errors
	$(CARGO) fmt --all --check
	$(CARGO) clippy --workspace --all-targets --locked -- -D warnings

fmt: ## format the code
	$(CARGO) fmt --all

test: lint ## everything CI checks: lint, then all tests
	$(CARGO) test --workspace --locked

generate: ## regenerate committed generated files (protobuf bindings, JSON schema)
	UPDATE_GENERATED=1 $(CARGO) test --workspace --locked generated_

FUZZ_SECONDS ?= 600
fuzz: ## run the opaque-config fuzzer (needs a nightly toolchain and cargo-fuzz)
	rustup toolchain list | grep -q nightly || rustup toolchain install nightly --profile minimal
	command -v cargo-fuzz >/dev/null || $(CARGO) install cargo-fuzz --locked
	cd api/fuzz && $(CARGO) +nightly fuzz run decode_validate -- -max_total_time=$(FUZZ_SECONDS)

bench: ## benchmarks: print figures (medians, percentiles, ratios)
	$(CARGO) run --release --locked -p gpu-dra-api --example bench_validate
	$(CARGO) build --release --locked -p gpu-dra-sim --lib --bins
	$(CARGO) run --release --locked -p gpu-kubelet-plugin --example bench_mps
