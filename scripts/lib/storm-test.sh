# shellcheck shell=bash
# The pg_stat_statements eviction storm's agreement test (tests/tests/off_cpu_sampled.rs, part
# of `make test`), as the off-CPU benchmarks run it again and again (sourced, not run).
# `storm_build` installs what it needs and builds pgscope and the test once; `storm_run` runs it
# once, its output on stdout and stderr, its status the test's.

STORM_TEST=sampled_waits_agree_with_the_exact_tracer_in_an_eviction_storm

storm_build() {
  scripts/install-deps.sh
  cargo build --locked -q -p pgscope-agent
  export PGSCOPE_BIN=$PWD/target/debug/pgscope
  cargo test --locked -q -p pgscope-tests --test off_cpu_sampled --no-run
}

storm_run() {
  cargo test --locked -q -p pgscope-tests --test off_cpu_sampled -- \
    --exact "$STORM_TEST" --test-threads=1 --nocapture
}
