//! The agent's configuration: one TOML file, then `PGSCOPE_*` environment variables, then
//! flags, each overriding the one before. Validated as a whole at start (and on reload) with
//! errors that name the bad key.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Deserializer};

/// The whole configuration; every section and key is optional in the file.
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct AgentConfig {
    pub pyroscope: PyroscopeConfig,
    pub collection: CollectionConfig,
    pub labels: LabelsConfig,
    pub discovery: DiscoveryConfig,
    pub probes: ProbesConfig,
    pub server: ServerConfig,
}

/// Function probes (uprobes on Postgres functions): calls and time per function and queryid,
/// shipped as the `pg_function_calls` and `pg_function_time` profiles. None by default.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ProbesConfig {
    /// Function names (`GetCachedPlan`, `LockRelationOid`, `PortalStart`, `pgss_store`,
    /// `s_lock`, `_bt_getroot`, `vac_update_datfrozenxid`) or `all`.
    pub functions: Vec<String>,
    /// Share of each instance's CPU the probes may cost: hot probes are attached part of the
    /// time and their counts scaled up. 0 measures every call whatever it costs.
    pub budget: f64,
}

impl Default for ProbesConfig {
    fn default() -> Self {
        Self {
            functions: Vec::new(),
            budget: 0.02,
        }
    }
}

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct PyroscopeConfig {
    /// Base URL of Pyroscope (or of a gateway in front of it), e.g. `http://pyroscope:4040`.
    pub url: Option<String>,
    pub basic_auth_user: Option<String>,
    pub basic_auth_password: Option<String>,
    pub bearer_token: Option<String>,
    /// `X-Scope-OrgID`, for multi-tenant Pyroscope.
    pub tenant_id: Option<String>,
    /// PEM file of a CA to trust besides the system's.
    pub ca_file: Option<PathBuf>,
    #[serde(deserialize_with = "duration")]
    pub timeout: Duration,
    /// Memory the upload queue may hold while Pyroscope is unreachable; older batches are
    /// dropped (and counted) beyond it.
    pub queue_max_bytes: u64,
}

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct CollectionConfig {
    /// On-CPU samples per second per CPU.
    pub frequency: u64,
    #[serde(deserialize_with = "duration")]
    pub upload_interval: Duration,
    /// Off-CPU profiling: every context switch and syscall on the host then runs a BPF
    /// program (bench/offcpu.sh measures what that costs); off by default.
    pub off_cpu: bool,
    #[serde(deserialize_with = "duration")]
    pub off_cpu_min_stack: Duration,
    /// Off-CPU stacks taken per second per CPU at most (taken when a wait begins).
    pub off_cpu_stack_rate: u64,
    /// Ship idle client waits (`Client:ClientRead` between statements) in the off-CPU profile.
    pub off_cpu_idle: bool,
    /// Extra directories with separate debug files in a `.build-id/xx/rest.debug` tree
    /// (/usr/lib/debug is always searched).
    pub debug_dirs: Vec<PathBuf>,
}

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct LabelsConfig {
    /// `service_name` of every series; `{instance}` is replaced by the instance's name
    /// (cluster_name, else host:port).
    pub service_name: String,
    /// Label samples with the backend PID (one series per backend: high cardinality).
    pub pid: bool,
    /// Added to every series.
    #[serde(rename = "static")]
    pub static_labels: BTreeMap<String, String>,
    /// On Kubernetes, name an instance in a pod after the pod (annotation
    /// `pgscope.io/service-name`, else `<namespace>/<operator cluster or owner>`) instead of
    /// `service_name`.
    pub pod_service_name: bool,
}

#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct DiscoveryConfig {
    /// When non-empty, only instances matching one of these are profiled.
    pub include: Vec<InstanceFilter>,
    /// Instances matching one of these are never profiled.
    pub exclude: Vec<InstanceFilter>,
}

/// Matches an instance when every field given matches.
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct InstanceFilter {
    pub data_dir: Option<PathBuf>,
    pub port: Option<u16>,
    /// The postgres executable, e.g. `/usr/lib/postgresql/15/bin/postgres`.
    pub binary: Option<PathBuf>,
}

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    /// Where `/metrics`, `/healthz` and `/readyz` are served.
    pub metrics_addr: SocketAddr,
    /// `text` or `json` logs.
    pub log_format: LogFormat,
}

#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

impl Default for PyroscopeConfig {
    fn default() -> Self {
        Self {
            url: None,
            basic_auth_user: None,
            basic_auth_password: None,
            bearer_token: None,
            tenant_id: None,
            ca_file: None,
            timeout: Duration::from_secs(10),
            queue_max_bytes: 64 << 20,
        }
    }
}

impl Default for CollectionConfig {
    fn default() -> Self {
        Self {
            // What Grafana Alloy, Parca and the OpenTelemetry profiler sample at: profiles
            // from several agents then line up.
            frequency: 19,
            upload_interval: Duration::from_secs(15),
            off_cpu: false,
            off_cpu_min_stack: Duration::from_micros(100),
            off_cpu_stack_rate: crate::collect::off_cpu::DEFAULT_STACK_RATE,
            off_cpu_idle: false,
            debug_dirs: Vec::new(),
        }
    }
}

impl Default for LabelsConfig {
    fn default() -> Self {
        Self {
            service_name: "postgres/{instance}".to_string(),
            pid: false,
            static_labels: BTreeMap::new(),
            pod_service_name: true,
        }
    }
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            metrics_addr: SocketAddr::from(([0, 0, 0, 0], 9437)),
            log_format: LogFormat::Text,
        }
    }
}

fn duration<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Duration, D::Error> {
    let text = String::deserialize(deserializer)?;
    humantime::parse_duration(&text).map_err(|error| {
        serde::de::Error::custom(format!("`{text}` is not a duration (e.g. 15s, 500ms): {error}"))
    })
}

/// What the command line sets; `None` leaves the file's (or the default) value.
#[derive(Clone, Debug, Default)]
pub struct Overrides {
    pub pyroscope_url: Option<String>,
    pub service_name: Option<String>,
    pub frequency: Option<u64>,
    pub upload_interval: Option<Duration>,
    pub metrics_addr: Option<SocketAddr>,
    pub off_cpu: Option<bool>,
    pub log_format: Option<LogFormat>,
    /// `--probes`: replaces `probes.functions`.
    pub probes: Option<Vec<String>>,
}

impl AgentConfig {
    /// File (if any), then environment, then flags; validated.
    pub fn load(
        file: Option<&Path>,
        env: &dyn Fn(&str) -> Option<String>,
        flags: &Overrides,
    ) -> Result<Self> {
        let mut config = match file {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .with_context(|| format!("reading the config file `{}`", path.display()))?;
                Self::parse(&text).with_context(|| format!("in the config file `{}`", path.display()))?
            }
            None => Self::default(),
        };
        config.apply_env(env)?;
        config.apply(flags);
        config.validate()?;
        Ok(config)
    }

    pub fn parse(text: &str) -> Result<Self> {
        // toml's message names the key and shows the line, e.g. "unknown field `frequncy`".
        toml::from_str(text).map_err(|error| anyhow::anyhow!("{}", error.to_string().trim_end()))
    }

    /// `PGSCOPE_PYROSCOPE_URL`, … : secrets (password, token) are best given this way, e.g.
    /// from a Kubernetes Secret, rather than in the file.
    fn apply_env(&mut self, env: &dyn Fn(&str) -> Option<String>) -> Result<()> {
        let pyroscope = &mut self.pyroscope;
        for (name, slot) in [
            ("PGSCOPE_PYROSCOPE_URL", &mut pyroscope.url),
            ("PGSCOPE_PYROSCOPE_USER", &mut pyroscope.basic_auth_user),
            ("PGSCOPE_PYROSCOPE_PASSWORD", &mut pyroscope.basic_auth_password),
            ("PGSCOPE_PYROSCOPE_TOKEN", &mut pyroscope.bearer_token),
            ("PGSCOPE_PYROSCOPE_TENANT", &mut pyroscope.tenant_id),
        ] {
            if let Some(value) = env(name).filter(|v| !v.is_empty()) {
                *slot = Some(value);
            }
        }
        if let Some(value) = env("PGSCOPE_SERVICE_NAME").filter(|v| !v.is_empty()) {
            self.labels.service_name = value;
        }
        if let Some(value) = env("PGSCOPE_FREQUENCY").filter(|v| !v.is_empty()) {
            self.collection.frequency = value
                .parse()
                .with_context(|| format!("PGSCOPE_FREQUENCY: `{value}` is not a whole number of Hz"))?;
        }
        Ok(())
    }

    fn apply(&mut self, flags: &Overrides) {
        if let Some(url) = &flags.pyroscope_url {
            self.pyroscope.url = Some(url.clone());
        }
        if let Some(name) = &flags.service_name {
            self.labels.service_name = name.clone();
        }
        if let Some(frequency) = flags.frequency {
            self.collection.frequency = frequency;
        }
        if let Some(interval) = flags.upload_interval {
            self.collection.upload_interval = interval;
        }
        if let Some(addr) = flags.metrics_addr {
            self.server.metrics_addr = addr;
        }
        if let Some(off_cpu) = flags.off_cpu {
            self.collection.off_cpu = off_cpu;
        }
        if let Some(format) = flags.log_format {
            self.server.log_format = format;
        }
        if let Some(functions) = &flags.probes {
            self.probes.functions = functions.clone();
        }
    }

    /// What the agent will do, for `--check-config` and the start log; secrets left out.
    pub fn summary(&self) -> String {
        let auth = match (&self.pyroscope.basic_auth_user, &self.pyroscope.bearer_token) {
            (Some(user), _) => format!("basic auth as `{user}`"),
            (None, Some(_)) => "bearer token".to_string(),
            (None, None) => "no auth".to_string(),
        };
        format!(
            "  pyroscope: {} ({auth}{}{}), queue up to {} MiB\n  \
             collection: {} Hz, upload every {:?}, off-CPU {}\n  \
             labels: service_name `{}`, pid {}, {} static\n  \
             discovery: {} include / {} exclude filters\n  \
             probes: {}\n  \
             server: {}, {:?} logs",
            self.pyroscope.url.as_deref().unwrap_or("?"),
            self.pyroscope
                .tenant_id
                .as_ref()
                .map(|t| format!(", tenant `{t}`"))
                .unwrap_or_default(),
            self.pyroscope
                .ca_file
                .as_ref()
                .map(|f| format!(", CA {}", f.display()))
                .unwrap_or_default(),
            self.pyroscope.queue_max_bytes >> 20,
            self.collection.frequency,
            self.collection.upload_interval,
            if self.collection.off_cpu { "on" } else { "off" },
            self.labels.service_name,
            if self.labels.pid { "on" } else { "off" },
            self.labels.static_labels.len(),
            self.discovery.include.len(),
            self.discovery.exclude.len(),
            if self.probes.functions.is_empty() {
                "none".to_string()
            } else if self.probes.budget == 0.0 {
                format!("{} (every call)", self.probes.functions.join(", "))
            } else {
                format!(
                    "{} (budget {:.1}% of each instance's CPU)",
                    self.probes.functions.join(", "),
                    self.probes.budget * 100.0
                )
            },
            self.server.metrics_addr,
            self.server.log_format,
        )
    }

    /// Checks what the types cannot: each error names its key.
    pub fn validate(&self) -> Result<()> {
        let Some(url) = &self.pyroscope.url else {
            bail!("pyroscope.url is not set: pass --pyroscope-url, set PGSCOPE_PYROSCOPE_URL or `url` under [pyroscope]");
        };
        if !(url.starts_with("http://") || url.starts_with("https://")) {
            bail!("pyroscope.url `{url}` must start with http:// or https://");
        }
        if self.pyroscope.basic_auth_user.is_some() != self.pyroscope.basic_auth_password.is_some() {
            bail!("pyroscope.basic_auth_user and pyroscope.basic_auth_password go together: set both or neither");
        }
        if self.pyroscope.basic_auth_user.is_some() && self.pyroscope.bearer_token.is_some() {
            bail!("pyroscope.bearer_token and pyroscope.basic_auth_user exclude each other: keep one");
        }
        if let Some(ca) = &self.pyroscope.ca_file {
            if !ca.is_file() {
                bail!("pyroscope.ca_file `{}` is not a readable file", ca.display());
            }
        }
        if self.pyroscope.timeout.is_zero() {
            bail!("pyroscope.timeout must be more than 0");
        }
        if self.pyroscope.queue_max_bytes < 1 << 20 {
            bail!("pyroscope.queue_max_bytes must be at least 1 MiB (1048576)");
        }
        if !(1..=1000).contains(&self.collection.frequency) {
            bail!(
                "collection.frequency {} Hz is outside 1..=1000",
                self.collection.frequency
            );
        }
        if self.collection.upload_interval < Duration::from_secs(1) {
            bail!("collection.upload_interval must be at least 1s");
        }
        if let Err(error) = crate::collect::probes::parse_probe_list(&self.probes.functions) {
            bail!("probes.functions: {error:#}");
        }
        if !(0.0..=1.0).contains(&self.probes.budget) {
            bail!(
                "probes.budget {} must be a share of CPU between 0 (no budget: every call) and 1",
                self.probes.budget
            );
        }
        if self.labels.service_name.trim().is_empty() {
            bail!("labels.service_name must not be empty");
        }
        for name in self.labels.static_labels.keys() {
            let valid = !name.is_empty()
                && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                && !name.starts_with(|c: char| c.is_ascii_digit())
                && !name.starts_with("__");
            if !valid {
                bail!("labels.static: `{name}` is not a valid label name ([a-zA-Z_][a-zA-Z0-9_]*, not starting with __)");
            }
        }
        for (list, filters) in [
            ("include", &self.discovery.include),
            ("exclude", &self.discovery.exclude),
        ] {
            for (index, filter) in filters.iter().enumerate() {
                if filter == &InstanceFilter::default() {
                    bail!("discovery.{list}[{index}] matches every instance: give data_dir, port or binary");
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn no_env(_: &str) -> Option<String> {
        None
    }

    #[test]
    fn an_empty_file_is_the_defaults() {
        let config = AgentConfig::parse("").expect("empty config parses");
        assert_eq!(config, AgentConfig::default());
        assert_eq!(config.collection.frequency, 19);
        assert_eq!(config.collection.upload_interval, Duration::from_secs(15));
    }

    #[test]
    fn a_full_file_parses() {
        let config = AgentConfig::parse(
            r#"
            [pyroscope]
            url = "https://pyroscope.example:4040"
            basic_auth_user = "u"
            basic_auth_password = "p"
            tenant_id = "team-a"
            timeout = "5s"
            [collection]
            frequency = 49
            upload_interval = "10s"
            off_cpu = true
            off_cpu_min_stack = "1ms"
            [labels]
            service_name = "pg/{instance}"
            pid = true
            static = { env = "prod", region = "eu" }
            [[discovery.exclude]]
            port = 5433
            [server]
            metrics_addr = "127.0.0.1:9999"
            log_format = "json"
            "#,
        )
        .expect("full config parses");
        config.validate().expect("full config is valid");
        assert_eq!(config.collection.off_cpu_min_stack, Duration::from_millis(1));
        assert_eq!(
            config.labels.static_labels.get("region").map(String::as_str),
            Some("eu")
        );
        assert_eq!(config.discovery.exclude[0].port, Some(5433));
        assert_eq!(config.server.log_format, LogFormat::Json);
    }

    #[test]
    fn errors_name_the_bad_key() {
        let error = AgentConfig::parse("[collection]\nfrequncy = 10\n").unwrap_err();
        assert!(format!("{error:#}").contains("frequncy"), "{error:#}");
        let error = AgentConfig::parse("[collection]\nupload_interval = \"soon\"\n").unwrap_err();
        assert!(format!("{error:#}").contains("upload_interval"), "{error:#}");
        let mut config = AgentConfig::default();
        config.pyroscope.url = Some("pyroscope:4040".into());
        let error = config.validate().unwrap_err();
        assert!(format!("{error:#}").contains("pyroscope.url"), "{error:#}");
        config.pyroscope.url = Some("http://p:4040".into());
        config.collection.frequency = 0;
        assert!(format!("{:#}", config.validate().unwrap_err()).contains("collection.frequency"));
        config.collection.frequency = 19;
        config.labels.static_labels.insert("bad-name".into(), "x".into());
        assert!(format!("{:#}", config.validate().unwrap_err()).contains("bad-name"));
    }

    #[test]
    fn flags_override_the_environment_which_overrides_the_file() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("agent.toml");
        std::fs::write(
            &path,
            "[pyroscope]\nurl = \"http://file:4040\"\n[collection]\nfrequency = 7\n",
        )
        .expect("write config");
        let env = |name: &str| match name {
            "PGSCOPE_PYROSCOPE_URL" => Some("http://env:4040".to_string()),
            "PGSCOPE_FREQUENCY" => Some("11".to_string()),
            _ => None,
        };
        let config = AgentConfig::load(Some(&path), &env, &Overrides::default()).expect("loads");
        assert_eq!(config.pyroscope.url.as_deref(), Some("http://env:4040"));
        assert_eq!(config.collection.frequency, 11);
        let flags = Overrides {
            pyroscope_url: Some("http://flag:4040".into()),
            frequency: Some(29),
            ..Overrides::default()
        };
        let config = AgentConfig::load(Some(&path), &env, &flags).expect("loads");
        assert_eq!(config.pyroscope.url.as_deref(), Some("http://flag:4040"));
        assert_eq!(config.collection.frequency, 29);
        let missing = AgentConfig::load(None, &no_env, &Overrides::default()).unwrap_err();
        assert!(format!("{missing:#}").contains("pyroscope.url"));
    }
}
