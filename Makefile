# Developer entry points. `make` alone lists them.
#
# test/demo start a private PostgreSQL and RabbitMQ on free ports for the
# duration of the run (integration/servers.sh), installing the Debian
# packages first if they are missing.

SHELL := bash
.DEFAULT_GOAL := help

SERVERS := integration/servers.sh
# The command `make test` runs against the servers; override to narrow a run:
#   make test TEST_CMD='cargo test --test failures -- --nocapture'
TEST_CMD ?= cargo test --all-targets --no-fail-fast -- --test-threads=4

.PHONY: help build test demo bench deb lint clean

help: ## List the targets (default)
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z_-]+:.*## / {printf "  %-8s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

build: ## Build the relay (debug)
	cargo build

test: ## Run all tests against throwaway PostgreSQL + RabbitMQ (TEST_CMD)
	$(SERVERS) install
	$(SERVERS) with $(TEST_CMD)

demo: ## Relay a few outbox events end to end and print the messages
	$(SERVERS) install
	$(SERVERS) with integration/demo.sh

bench: ## Benchmarks vs broker ceiling and polling -> target/bench/report.md (BENCH_EVENTS, BENCH_SECONDS)
	bench/run.sh

deb: ## Release build + Debian package -> target/deb/outbox-relay_<version>_<arch>.deb
	cargo build --release --locked
	deploy/deb/build.sh target/release/outbox-relay

lint: ## rustfmt check + clippy with warnings as errors
	cargo fmt --check
	cargo clippy --all-targets -- -D warnings

clean: ## Remove build artifacts
	cargo clean
