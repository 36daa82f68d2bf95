//! Harness for pgscope's integration tests: throw-away Postgres clusters of two builds, sessions
//! running CPU-bound queries, the `pgscope` binary, and `perf` as the reference profiler.
//!
//! Tests need root (BPF, and `perf -p` on another user's process) and run one at a time:
//! `cargo test -p pgscope-tests -- --test-threads=1`.

pub mod activity;
pub mod activity_sampler;
pub mod agent;
pub mod agreement;
pub mod app_database;
pub mod bpf_objects;
pub mod chromium;
pub mod cluster;
pub mod compare;
pub mod connection;
pub mod container_pg;
pub mod cpu_window;
pub mod debuginfod;
pub mod fault_pyroscope;
pub mod findings_json;
pub mod fork_events;
pub mod freeze;
pub mod gdb;
pub mod initdb_template;
pub mod install;
pub mod kube;
pub mod perf;
pub mod pgbench;
pub mod pgscope;
pub mod pgss_discovery;
pub mod pgstack;
pub mod plan_json;
pub mod pprof;
pub mod probe_matrix;
pub mod probe_workloads;
pub mod process;
pub mod profile;
pub mod pyroscope_capture;
pub mod pyroscope_server;
pub mod rss_watch;
pub mod running_trace;
pub mod session;
pub mod spin_calls;
pub mod summary;
pub mod system;
pub mod uprobe_count;
pub mod watch;
pub mod workload;

use std::path::{Path, PathBuf};

pub use agent::RunningAgent;
pub use cluster::PgCluster;
pub use compare::{compare_top, disagreements, format_comparison, FunctionDiff, SelfTable};
pub use connection::Connection;
pub use cpu_window::{ensure_samples_cover, expected_samples, CpuWindow, SchedTime};
pub use debuginfod::DebuginfodServer;
pub use install::PgInstall;
pub use perf::{perf_record, PerfRecording, PerfTimer};
pub use pgbench::BackgroundPgbench;
pub use pgscope::{pgscope_bin, run_pgscope, run_pgscope_ok, Trace, TraceOutput};
pub use pgstack::{runs_under_exec_simple_query, Statics};
pub use pprof::{LabeledProfile, LabeledSample};
pub use process::wait_for;
pub use profile::{Profile, Stack};
pub use pyroscope_capture::PyroscopeCapture;
pub use running_trace::RunningTrace;
pub use session::Session;
pub use summary::TraceSummary;
pub use system::require_root_and_bpf;
pub use watch::ProcessWatch;

/// The cargo workspace root (this crate's parent directory).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the tests crate lives in the workspace")
        .to_path_buf()
}
