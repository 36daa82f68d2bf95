//! pgscope: an eBPF profiler for PostgreSQL.

// First: its `out!` and `note!` macros print for every module below.
#[macro_use]
mod console;
mod aggregate;
mod bpf;
mod collect;
mod container;
mod daemon;
mod findings;
#[cfg(test)]
mod fuzz_tests;
#[cfg(test)]
mod fuzzing;
mod input_file;
mod liveness;
mod model;
mod output_file;
mod postgres;
mod preflight;
mod redact;
mod report;
mod signals;
mod target;
mod trace;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use tracing_subscriber::EnvFilter;

#[derive(Parser)]
#[command(
    name = "pgscope",
    version,
    about = "eBPF profiler for PostgreSQL: which query, in which backend, spends its time where"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Profile one backend (--pid) or every process of one instance (--instance) on CPU, then
    /// print the top functions and write flamegraphs.
    Trace(Box<TraceArgs>),
    /// Profile every Postgres instance on this host continuously and send the profiles to
    /// Grafana Pyroscope (one series per instance, query, backend type, database and wait
    /// event). Serves /metrics, /healthz and /readyz. SIGHUP reloads the configuration;
    /// SIGTERM sends what was collected and detaches. Exit codes: 0 stopped by a signal,
    /// 1 could not run (e.g. no BPF), 2 invalid configuration.
    Agent(Box<AgentArgs>),
    /// Write the HTML report of a saved trace (`pgscope trace --record FILE`): findings, the
    /// on-CPU and off-CPU flamegraphs and a table per queryid, in one self-contained page.
    Report(ReportArgs),
    /// Measure what one probe hit costs on this machine: a bare uprobe (empty program) and a
    /// pgscope function probe (entry + return). `bench/probes.sh` quotes it.
    Calibrate,
}

#[derive(Args)]
struct ReportArgs {
    /// The recording written by `pgscope trace --record FILE`.
    #[arg(long, value_name = "FILE")]
    from: PathBuf,
    /// Where to write the page.
    #[arg(long, value_name = "FILE", default_value = "report.html")]
    out: PathBuf,
    /// Permission bits of the page, octal (it can hold query texts with literals).
    #[arg(long, value_name = "MODE", default_value = "0600")]
    output_mode: output_file::OutputMode,
}

#[derive(Args)]
struct TraceArgs {
    /// PID of a Postgres backend (see pg_stat_activity.pid).
    #[arg(long, required_unless_present = "instance", conflicts_with = "instance")]
    pid: Option<u32>,
    /// Postmaster PID or data directory: profile every process of that instance, each sample
    /// labelled with its backend PID; backends started during the trace are followed.
    #[arg(long, value_name = "POSTMASTER_PID|DATA_DIR")]
    instance: Option<String>,
    /// How long to profile, e.g. 30s, 2m, 500ms.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    duration: Duration,
    /// Samples per second per CPU.
    #[arg(long, default_value_t = 99, value_parser = clap::value_parser!(u64).range(1..=10_000))]
    frequency: u64,
    /// Write an SVG flamegraph here.
    #[arg(long, value_name = "FILE")]
    svg: Option<PathBuf>,
    /// Write folded stacks (Brendan Gregg's format, root first) here.
    #[arg(long, value_name = "FILE")]
    folded: Option<PathBuf>,
    /// Write the summary as JSON here (schema `pgscope.trace.summary/v1`, see docs/trace.md).
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Save the trace as a recording here (JSON, schema `pgscope.recording/v1`):
    /// `pgscope report --from FILE` writes its HTML report later.
    #[arg(long, value_name = "FILE")]
    record: Option<PathBuf>,
    /// Write the HTML report here: findings, on-CPU and off-CPU flamegraphs, per-queryid
    /// tables, in one self-contained page.
    #[arg(long, value_name = "FILE")]
    report: Option<PathBuf>,
    /// Write a gzipped pprof profile here; samples carry the labels pid, backend_type,
    /// database, state, queryid, wait_event and phase.
    #[arg(long, value_name = "FILE")]
    pprof: Option<PathBuf>,
    /// Permission bits of every file written, octal. The default keeps them to their owner:
    /// query texts in them can hold literals.
    #[arg(long, value_name = "MODE", default_value = "0600")]
    output_mode: output_file::OutputMode,
    /// Extra directory holding separate debug files in a `.build-id/xx/rest.debug` tree
    /// (/usr/lib/debug is always searched). Repeatable.
    #[arg(long = "debug-dir", value_name = "DIR")]
    debug_dirs: Vec<PathBuf>,
    /// How many functions the summary lists.
    #[arg(long, default_value_t = 20)]
    top: usize,
    /// Measure every call of these Postgres functions (comma-separated, or `all`): pgss_store,
    /// s_lock, LockRelationOid, GetCachedPlan, PortalStart, vac_update_datfrozenxid,
    /// _bt_getroot, or any other function of the postgres executable by name (up to 25,
    /// e.g. SubTransGetParent). Each call costs a uprobe trap (1-3 µs): opt in for the
    /// functions you need.
    #[arg(long, value_delimiter = ',', value_name = "FUNCTIONS")]
    probes: Vec<String>,
    /// Probe a function at a location you give, in files where pgscope cannot find its name
    /// (e.g. pgss_store=/usr/lib/postgresql/15/lib/pg_stat_statements.so:0x4d80, the offset
    /// of its first instruction in the file). Repeatable; implies --probes for it.
    #[arg(long = "probe", value_name = "FUNCTION=PATH:OFFSET", value_parser = parse_explicit_probe)]
    explicit_probes: Vec<trace::ExplicitProbe>,
    /// Overhead budget of the probes, in percent of the instance's CPU time, or `none` to
    /// measure every call. Under a budget the hot probes are attached part of the time and
    /// their counts are estimates, marked "est.": calls while attached, scaled by all the
    /// statements the instance ran over those it ran while they were attached.
    #[arg(long, default_value = "2", value_name = "PERCENT|none", value_parser = parse_budget)]
    probe_budget: Budget,
    /// Connection for reading query texts from pg_stat_statements at the end, libpq style
    /// (e.g. "host=/var/run/postgresql user=postgres dbname=postgres"). Default: the instance's
    /// Unix socket, as the OS user that owns the data directory (peer authentication).
    #[arg(long, value_name = "CONNINFO")]
    conninfo: Option<String>,
    /// How time off CPU is measured: where backends wait, labelled with their wait event and
    /// queryid. `sampled` (the default): at each tick every backend off CPU is sampled with its
    /// stack, weighing one tick; `exact`: every context switch is traced and each wait timed
    /// (costs several % of a busy instance: bench/offcpu.sh); `both` (for checking one against
    /// the other; the exact profile goes to the JSON's `off_cpu_exact`); `none`.
    #[arg(long, value_enum, value_name = "MODE", default_value = "sampled", num_args = 0..=1,
          default_missing_value = "sampled", require_equals = true)]
    off_cpu: collect::off_cpu::OffCpuMode,
    /// `--off-cpu=exact`: off-CPU waits at least this long are recorded with their stacks; shorter ones are
    /// counted (time, wait event, queryid) without one.
    #[arg(long, default_value = "100us", value_parser = parse_duration, value_name = "DURATION")]
    off_cpu_min_stack: Duration,
    /// `--off-cpu=exact`: off-CPU stacks taken per second per CPU at most (stacks are taken when a wait begins;
    /// waits over the rate are counted without one, marked as such).
    #[arg(long, default_value_t = collect::off_cpu::DEFAULT_STACK_RATE, value_name = "N")]
    off_cpu_stack_rate: u64,
    /// Keep idle waits (clients between statements, background processes in their main loops)
    /// in the off-CPU flamegraphs and profiles and, row by row, in the printed off-CPU table;
    /// they are always in the summary's totals and the JSON.
    #[arg(long)]
    off_cpu_idle: bool,
    /// Keep only samples of this query (pg_stat_statements.queryid / pg_stat_activity.query_id).
    #[arg(long = "queryid", value_name = "QUERYID", allow_negative_numbers = true)]
    query_id: Option<i64>,
}

#[derive(Args)]
struct AgentArgs {
    /// Configuration file (TOML; see docs/agent.md). Environment variables PGSCOPE_* override
    /// it, flags override both.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Check the configuration, print it, and exit (0 valid, 2 invalid).
    #[arg(long)]
    check_config: bool,
    /// Pyroscope's base URL, e.g. http://pyroscope:4040.
    #[arg(long, value_name = "URL")]
    pyroscope_url: Option<String>,
    /// `service_name` of the series; `{instance}` becomes the instance's name.
    #[arg(long, value_name = "NAME")]
    service_name: Option<String>,
    /// On-CPU samples per second per CPU (default 19).
    #[arg(long, value_name = "HZ")]
    frequency: Option<u64>,
    /// How often profiles are sent (default 15s).
    #[arg(long, value_parser = parse_duration, value_name = "DURATION")]
    upload_interval: Option<Duration>,
    /// Address of /metrics, /healthz and /readyz (default 127.0.0.1:9437: loopback only).
    #[arg(long, value_name = "ADDR:PORT")]
    metrics_addr: Option<std::net::SocketAddr>,
    /// How off-CPU time is profiled: `sampled` (the default), `exact` (traces every context
    /// switch; costs more: bench/offcpu.sh) or `none`.
    #[arg(long, value_enum, value_name = "MODE")]
    off_cpu: Option<collect::off_cpu::OffCpuMode>,
    /// Log as JSON lines instead of text.
    #[arg(long)]
    log_json: bool,
    /// Probe these Postgres functions (comma-separated, or `all`): calls and time per
    /// queryid, shipped as the pg_function_calls and pg_function_time profiles.
    #[arg(long, value_delimiter = ',', value_name = "FUNCTIONS")]
    probes: Option<Vec<String>>,
}

fn parse_explicit_probe(text: &str) -> Result<trace::ExplicitProbe, String> {
    trace::parse_explicit_probe(text).map_err(|error| format!("{error:#}"))
}

/// `--probe-budget`: a fraction of the instance's CPU, or no budget.
#[derive(Clone, Copy, Debug)]
struct Budget(Option<f64>);

fn parse_budget(text: &str) -> Result<Budget, String> {
    if text == "none" {
        return Ok(Budget(None));
    }
    match text.trim_end_matches('%').parse::<f64>() {
        Ok(pct) if pct > 0.0 && pct <= 100.0 => Ok(Budget(Some(pct / 100.0))),
        _ => Err("give a percentage in (0, 100], e.g. 2, or `none`".into()),
    }
}

fn parse_duration(text: &str) -> Result<Duration, String> {
    let duration = humantime::parse_duration(text).map_err(|e| format!("{e} (try 30s, 2m or 500ms)"))?;
    if duration.is_zero() {
        return Err("the duration must be longer than zero".into());
    }
    Ok(duration)
}

fn init_logs(default_level: &str, json: bool) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_level));
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        // Colours only for a person: journald, kubectl logs and files get plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    if json {
        logs.json().init();
    } else {
        logs.init();
    }
}

/// Exit code of an invalid configuration (clap's usage errors use it too).
const EXIT_BAD_CONFIG: u8 = 2;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let (agent, config) = match &cli.command {
        Command::Agent(args) => {
            let source = daemon::ConfigSource {
                file: args.config.clone(),
                flags: daemon::config::Overrides {
                    pyroscope_url: args.pyroscope_url.clone(),
                    service_name: args.service_name.clone(),
                    frequency: args.frequency,
                    upload_interval: args.upload_interval,
                    metrics_addr: args.metrics_addr,
                    off_cpu: args.off_cpu,
                    log_format: args.log_json.then_some(daemon::config::LogFormat::Json),
                    probes: args.probes.clone(),
                },
            };
            let config = match source.load() {
                Ok(config) => config,
                Err(error) => {
                    note!("pgscope agent: invalid configuration: {error:#}");
                    return ExitCode::from(EXIT_BAD_CONFIG);
                }
            };
            if args.check_config {
                // A summary, not the whole struct: passwords and tokens stay out of terminals.
                out!("configuration is valid:\n{}", config.summary());
                return ExitCode::SUCCESS;
            }
            init_logs(
                "info",
                config.server.log_format == daemon::config::LogFormat::Json,
            );
            (Some(source), Some(config))
        }
        _ => {
            init_logs("warn", false);
            (None, None)
        }
    };
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(error) => {
            note!("pgscope: cannot start the async runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            Command::Calibrate => trace::calibrate(),
            Command::Report(args) => report::run(&args.from, &args.out, args.output_mode),
            Command::Agent(_) => match (agent, config) {
                (Some(source), Some(config)) => daemon::run(source, config).await,
                _ => Err(anyhow::anyhow!("the agent's configuration was not loaded")),
            },
            Command::Trace(args) => {
                trace::run(trace::TraceOptions {
                    pid: args.pid,
                    instance: args.instance,
                    duration: args.duration,
                    frequency_hz: args.frequency,
                    svg: args.svg,
                    folded: args.folded,
                    pprof: args.pprof,
                    output_mode: args.output_mode,
                    debug_dirs: args.debug_dirs,
                    top: args.top,
                    query_id: args.query_id,
                    json: args.json,
                    record: args.record,
                    report: args.report,
                    probes: args.probes,
                    explicit_probes: args.explicit_probes,
                    probe_budget: args.probe_budget.0,
                    conninfo: args.conninfo,
                    off_cpu: args.off_cpu,
                    off_cpu_min_stack: args.off_cpu_min_stack,
                    off_cpu_stack_rate: args.off_cpu_stack_rate,
                    off_cpu_idle: args.off_cpu_idle,
                })
                .await
            }
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            note!("pgscope: {error:#}");
            ExitCode::FAILURE
        }
    }
}
