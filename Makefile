# Developer entry points. `make` alone lists them.
#
# test/demo start a private PostgreSQL and RabbitMQ on free ports for the
# duration of the run (integration/servers.sh), installing the Debian
# packages first if they are missing.

SHELL := bash
.DEFAULT_GOAL := help

SERVERS := integration/servers.sh
# `make test` runs the whole suite in three lanes, each with servers of its
# own (integration/suite.sh). TEST_CMD narrows a run to one command against
# one set of servers:
#   make test TEST_CMD='cargo test --test it -- chaos:: --nocapture'
TEST_CMD ?=

.PHONY: help build test test-matrix demo bench deb lint clean soak check-seed

help: ## List the targets (default)
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z_-]+:.*## / {printf "  %-8s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

build: ## Build the relay (debug)
	cargo build

test: ## Run all tests against throwaway PostgreSQL + RabbitMQ (TEST_CMD)
	$(SERVERS) install
ifeq ($(strip $(TEST_CMD)),)
	integration/suite.sh
else
	$(SERVERS) with $(TEST_CMD)
endif

# PostgreSQL majors of `make test-matrix` (15: Debian's; 16-18: npm,
# integration/pgdist.sh).
PG_MAJORS ?= 15 16 17 18

test-matrix: ## The whole suite on each PostgreSQL major, one after another (PG_MAJORS)
	failed=""; for v in $(PG_MAJORS); do \
		echo "test-matrix: PostgreSQL $$v"; \
		OUTBOX_IT_PG_MAJOR=$$v OUTBOX_IT_COMPAT_MAJORS= integration/suite.sh || failed="$$failed $$v"; \
	done; \
	if [[ -n $$failed ]]; then echo "test-matrix: failed on PostgreSQL$$failed"; exit 1; fi; \
	echo "test-matrix: passed on PostgreSQL $(PG_MAJORS)"

demo: ## Relay a few outbox events end to end and print the messages
	$(SERVERS) install
	$(SERVERS) with integration/demo.sh

bench: ## Benchmarks vs broker ceiling and polling -> target/bench/report.md (BENCH_EVENTS, BENCH_SECONDS)
	bench/run.sh

# Where cargo puts what it builds: CARGO_TARGET_DIR or build.target-dir
# when set (common in CI), else target/. Asked of cargo, which knows both;
# expanded only by the targets that use it.
TARGET_DIR = $(shell cargo metadata --format-version 1 --no-deps | sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')

deb: ## Release build + Debian package -> <target dir>/deb/outbox-relay_<version>_<arch>.deb
	cargo build --release --locked
	DEB_OUT="$${DEB_OUT:-$(TARGET_DIR)/deb}" deploy/deb/build.sh "$(TARGET_DIR)/release/outbox-relay"

# bench/ is a crate of its own (the relay's library is one of its
# publishers), so nothing else builds it: linted here, with a target
# directory of its own, so that an API change breaks CI, not the next
# `make bench`.
lint: ## rustfmt check + clippy with warnings as errors (the relay and bench/)
	cargo fmt --check
	cargo fmt --check --manifest-path bench/Cargo.toml
	cargo clippy --all-targets -- -D warnings
	CARGO_TARGET_DIR="$(TARGET_DIR)/bench-build" cargo clippy --locked --manifest-path bench/Cargo.toml --all-targets -- -D warnings

clean: ## Remove build artifacts
	cargo clean

# The whole-system checker (checker/): `make test` runs its fixed seeds;
# these run more of it against servers of their own.
SOAK_SECONDS ?= 3600
SOAK_LANES ?= 1
soak: ## Checker: random seeds for SOAK_SECONDS (SOAK_LANES at once) -> target/checker/soak.md
	SOAK_SECONDS=$(SOAK_SECONDS) SOAK_LANES=$(SOAK_LANES) integration/soak.sh

check-seed: ## Checker: replay one seed (SEED=n) or a schedule file (SCHEDULE=path)
	$(SERVERS) install
	cargo test --test checker --no-run
	CHECK_SEED=$(SEED) CHECK_SCHEDULE=$(SCHEDULE) $(SERVERS) with cargo test --test checker
