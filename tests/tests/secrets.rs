//! No credential pgscope is given is ever printed or logged: distinct secrets are planted in
//! every place one can be given (`--conninfo` in both forms, the Pyroscope URL's userinfo and
//! query, `basic_auth_password` and `bearer_token` in the config file and in the environment),
//! then pgscope is run where each gets used or refused — `agent --check-config`, the agent at
//! debug level pushing to a closed port and reloading a bad config, `trace` connecting with a
//! wrong role — and everything it wrote to stdout and stderr is searched for them.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use pgscope_tests::agent::{http_get, metric_value};
use pgscope_tests::pgscope::pgscope_command;
use pgscope_tests::process::{output_with_timeout, wait_for, wait_timeout};
use pgscope_tests::workload::CPU_BOUND;
use pgscope_tests::{require_root_and_bpf, PgCluster, PgInstall, Trace};

/// One secret per place; each distinct, so that a hit names where it leaked from.
const URL_PASSWORD: &str = "UrlUserinfoSecret4Q7";
const URL_TOKEN: &str = "UrlQueryTokenSecret9X2";
const FILE_PASSWORD: &str = "FileBasicAuthSecret3K8";
const FILE_TOKEN: &str = "FileBearerSecret6M1";
const ENV_PASSWORD: &str = "EnvPasswordSecret2W5";
const ENV_TOKEN: &str = "EnvTokenSecret8Z3";
const TYPO_PASSWORD: &str = "MisspeltKeySecret5H9";
const CONNINFO_PASSWORD: &str = "ConninfoKvSecret1J4";
const CONNINFO_URI_PASSWORD: &str = "ConninfoUriSecret7P6";
const SECRETS: [&str; 9] = [
    URL_PASSWORD,
    URL_TOKEN,
    FILE_PASSWORD,
    FILE_TOKEN,
    ENV_PASSWORD,
    ENV_TOKEN,
    TYPO_PASSWORD,
    CONNINFO_PASSWORD,
    CONNINFO_URI_PASSWORD,
];

/// How long a command may run (a hang fails the test); the agent runs until it is stopped.
const RUN_TIMEOUT: Duration = Duration::from_secs(180);

/// Environment variables of a run.
type Envs<'a> = &'a [(&'a str, &'a str)];
/// A `--check-config` run: what it checks, its arguments and environment, its exit code.
type CheckConfig<'a> = (&'a str, Vec<&'a str>, Envs<'a>, i32);
/// An agent run: what it checks, its config file and environment.
type AgentRun<'a> = (&'a str, String, Envs<'a>);

/// Everything one run printed, with what it was.
struct Printed {
    what: String,
    text: String,
}

/// Fails naming every secret found in every output.
fn assert_no_secret(printed: &[Printed]) -> Result<()> {
    let mut leaks = Vec::new();
    for run in printed {
        for secret in SECRETS {
            if let Some(at) = run.text.find(secret) {
                let line = run.text[..at].rfind('\n').map_or(0, |i| i + 1);
                let end = run.text[at..].find('\n').map_or(run.text.len(), |i| at + i);
                leaks.push(format!("{}: `{secret}` in: {}", run.what, &run.text[line..end]));
            }
        }
    }
    ensure!(leaks.is_empty(), "secrets printed:\n{}", leaks.join("\n"));
    Ok(())
}

/// A loopback port nothing listens on: bound, then released.
fn closed_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// Runs `pgscope <args>` with `envs` to the end; stdout and stderr as one text.
fn run(what: &str, args: &[&str], envs: &[(&str, &str)]) -> Result<(Option<i32>, Printed)> {
    let mut command = pgscope_command(args)?;
    command.env("RUST_LOG", "debug");
    for (name, value) in envs {
        command.env(name, value);
    }
    let out = output_with_timeout(&mut command, RUN_TIMEOUT)?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("--- {what} ({}) ---\n{text}", out.status);
    Ok((
        out.status.code(),
        Printed {
            what: what.to_string(),
            text,
        },
    ))
}

#[test]
fn check_config_never_prints_a_secret() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let port = closed_port()?;
    let url = format!("http://agent:{URL_PASSWORD}@127.0.0.1:{port}/?token={URL_TOKEN}");
    let config = |name: &str, text: &str| -> Result<String> {
        let path = dir.path().join(name);
        std::fs::write(&path, text)?;
        Ok(path.to_string_lossy().into_owned())
    };
    let url_only = config("url.toml", &format!("[pyroscope]\nurl = \"{url}\"\n"))?;
    let basic = config(
        "basic.toml",
        &format!("[pyroscope]\nbasic_auth_user = \"agent\"\nbasic_auth_password = \"{FILE_PASSWORD}\"\n"),
    )?;
    let bearer = config(
        "bearer.toml",
        &format!("[pyroscope]\nbearer_token = \"{FILE_TOKEN}\"\n"),
    )?;
    let both = config(
        "both.toml",
        &format!("[pyroscope]\nurl = \"{url}\"\nbasic_auth_user = \"agent\"\nbasic_auth_password = \"{FILE_PASSWORD}\"\n"),
    )?;
    let typo = config(
        "typo.toml",
        &format!("[pyroscope]\nbasic_auth_user = \"agent\"\nbasic_auth_pasword = \"{TYPO_PASSWORD}\"\n"),
    )?;
    let plain_url = format!("http://127.0.0.1:{port}");
    let env_password = [
        ("PGSCOPE_PYROSCOPE_URL", plain_url.as_str()),
        ("PGSCOPE_PYROSCOPE_PASSWORD", ENV_PASSWORD),
    ];
    let env_token = [
        ("PGSCOPE_PYROSCOPE_URL", plain_url.as_str()),
        ("PGSCOPE_PYROSCOPE_TOKEN", ENV_TOKEN),
    ];
    let url_flag = ["agent", "--check-config", "--pyroscope-url", url.as_str()];
    let cases: [CheckConfig; 7] = [
        (
            "URL with credentials in the file",
            vec!["agent", "--check-config", "--config", &url_only],
            &[],
            0,
        ),
        ("URL with credentials as a flag", url_flag.to_vec(), &[], 0),
        (
            "basic auth from the file and the environment",
            vec!["agent", "--check-config", "--config", &basic],
            &env_password,
            0,
        ),
        (
            "bearer token from the file and the environment",
            vec!["agent", "--check-config", "--config", &bearer],
            &env_token,
            0,
        ),
        (
            "URL credentials and basic auth both",
            vec!["agent", "--check-config", "--config", &both],
            &[],
            2,
        ),
        (
            "a misspelt password key",
            vec!["agent", "--check-config", "--config", &typo],
            &env_password,
            2,
        ),
        (
            "the token twice, as a URL and a token",
            url_flag.to_vec(),
            &env_token,
            2,
        ),
    ];
    let mut printed = Vec::new();
    let mut wrong_exits = Vec::new();
    for (what, args, envs, expected) in cases {
        let (code, output) = run(what, &args, envs)?;
        if code != Some(expected) {
            wrong_exits.push(format!("{what}: exit {code:?}, expected {expected}"));
        }
        printed.push(output);
    }
    // Leaks first: they are what this test is about.
    assert_no_secret(&printed)?;
    ensure!(wrong_exits.is_empty(), "{}", wrong_exits.join("\n"));
    Ok(())
}

/// The agent, at debug level, pushing to a closed port (so every push fails and is logged),
/// then reloading a config that is refused.
#[test]
fn the_agent_never_logs_a_secret() -> Result<()> {
    require_root_and_bpf();
    let cluster = PgCluster::start_with_pg_stat_statements(&PgInstall::distro()?, &[])?;
    let _busy = cluster.spawn_session(CPU_BOUND)?;
    let port = closed_port()?;
    let dir = tempfile::tempdir()?;
    let mut printed = Vec::new();
    let url = format!("http://agent:{URL_PASSWORD}@127.0.0.1:{port}/?token={URL_TOKEN}");
    let plain_url = format!("http://127.0.0.1:{port}");
    let mut refusals = Vec::new();
    let runs: [AgentRun; 2] = [
        (
            "credentials in the URL",
            format!("[pyroscope]\nurl = \"{url}\"\n"),
            &[],
        ),
        (
            "bearer token from the file, overridden by the environment",
            format!("[pyroscope]\nurl = \"{plain_url}\"\nbearer_token = \"{FILE_TOKEN}\"\n"),
            &[("PGSCOPE_PYROSCOPE_TOKEN", ENV_TOKEN)],
        ),
    ];
    for (what, config, envs) in runs {
        let config_path = dir.path().join("agent.toml");
        std::fs::write(&config_path, &config)?;
        let log_path = dir.path().join("agent.log");
        let metrics_port = closed_port()?;
        let mut agent = Agent::start(&config_path, &log_path, metrics_port, envs)?;
        let failed = r#"pgscope_export_pushes_total{result="retryable_error"}"#;
        wait_for(
            "a push to the closed port to fail",
            Duration::from_secs(60),
            || {
                let (_, body) = http_get(metrics_port, "/metrics").unwrap_or_default();
                Ok(metric_value(&body, failed).filter(|n| *n >= 1.0))
            },
        )
        .with_context(|| std::fs::read_to_string(&log_path).unwrap_or_default())?;
        // A reload that is refused logs why: the URL's and the file's credentials clash.
        std::fs::write(
            &config_path,
            format!("[pyroscope]\nurl = \"{url}\"\nbasic_auth_user = \"agent\"\nbasic_auth_password = \"{FILE_PASSWORD}\"\n"),
        )?;
        agent.signal(libc::SIGHUP);
        let reloads = r#"pgscope_config_reloads_total{result="failed"}"#;
        let refused = wait_for("the bad reload to be refused", Duration::from_secs(30), || {
            let (_, body) = http_get(metrics_port, "/metrics").unwrap_or_default();
            Ok(metric_value(&body, reloads).filter(|n| *n >= 1.0))
        });
        agent.stop()?;
        let text = std::fs::read_to_string(&log_path)?;
        eprintln!("--- agent: {what} ---\n{text}");
        ensure!(
            text.contains("cannot reach Pyroscope"),
            "{what}: the failed pushes were not logged:\n{text}"
        );
        printed.push(Printed {
            what: format!("agent, {what}"),
            text,
        });
        refusals.push(refused.map(|_| ()));
    }
    // Leaks first: they are what this test is about.
    assert_no_secret(&printed)?;
    refusals.into_iter().collect()
}

/// `trace` reads query texts over `--conninfo` with a role that does not exist: the
/// connection fails and the error is printed, in both conninfo forms.
#[test]
fn trace_never_prints_the_conninfo_password() -> Result<()> {
    require_root_and_bpf();
    let cluster = PgCluster::start_with_pg_stat_statements(&PgInstall::distro()?, &[])?;
    let _busy = cluster.spawn_session(CPU_BOUND)?;
    let port = cluster.port();
    let conninfos = [
        format!("host=127.0.0.1 port={port} user=no_such_role password={CONNINFO_PASSWORD} dbname=postgres"),
        format!("postgresql://no_such_role:{CONNINFO_URI_PASSWORD}@127.0.0.1:{port}/postgres"),
    ];
    let mut printed = Vec::new();
    for conninfo in conninfos {
        let trace = Trace::instance(cluster.data_dir())
            .duration_secs(2)
            .conninfo(&conninfo)
            .env("RUST_LOG", "debug");
        let out = output_with_timeout(&mut trace.command()?, RUN_TIMEOUT)?;
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        ensure!(out.status.success(), "the trace failed:\n{text}");
        ensure!(
            text.contains("no_such_role"),
            "the failed connection was not reported:\n{text}"
        );
        printed.push(Printed {
            what: "trace --conninfo".to_string(),
            text,
        });
    }
    assert_no_secret(&printed)
}

/// `pgscope agent` with its output in a file, stopped with SIGTERM.
struct Agent(Option<Child>);

impl Agent {
    fn start(config: &Path, log: &Path, metrics_port: u16, envs: &[(&str, &str)]) -> Result<Self> {
        let log = std::fs::File::create(log)?;
        let mut command: Command = pgscope_command(["agent", "--config"])?;
        command
            .arg(config)
            .args(["--metrics-addr", &format!("127.0.0.1:{metrics_port}")])
            .args(["--upload-interval", "1s"])
            .env("RUST_LOG", "debug")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        for (name, value) in envs {
            command.env(name, value);
        }
        Ok(Self(Some(command.spawn().context("starting pgscope agent")?)))
    }

    fn signal(&self, signal: libc::c_int) {
        if let Some(child) = &self.0 {
            // SAFETY: kill(2) on our own child's pid.
            unsafe { libc::kill(child.id() as libc::pid_t, signal) };
        }
    }

    fn stop(&mut self) -> Result<()> {
        self.signal(libc::SIGTERM);
        let mut child = self.0.take().context("the agent is not running")?;
        if wait_timeout(&mut child, Duration::from_secs(60))?.is_none() {
            let _ = child.kill();
            let _ = child.wait();
            anyhow::bail!("the agent did not stop within 60 s of SIGTERM");
        }
        Ok(())
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if let Some(mut child) = self.0.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
