//! The agent's configuration: one TOML file, then `PGSCOPE_*` environment variables, then
//! flags, each overriding the one before. Validated as a whole at start (and on reload) with
//! errors that name the bad key.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Deserializer};

use crate::collect::off_cpu::OffCpuMode;
use crate::input_file;
use crate::redact::{self, Secret};

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
    /// `s_lock`, `_bt_getroot`, `vac_update_datfrozenxid`, or any other function of the
    /// postgres executable, up to 25 of those) or `all`.
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

/// Its `Debug` shows the URL redacted and the password and token as `***`.
#[derive(Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct PyroscopeConfig {
    /// Base URL of Pyroscope (or of a gateway in front of it), e.g. `http://pyroscope:4040`.
    /// Credentials in it (`https://user:pass@…`) are used as basic auth.
    pub url: Option<String>,
    pub basic_auth_user: Option<String>,
    pub basic_auth_password: Option<Secret>,
    pub bearer_token: Option<Secret>,
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

impl std::fmt::Debug for PyroscopeConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PyroscopeConfig")
            .field("url", &self.url.as_deref().map(redact::url))
            .field("basic_auth_user", &self.basic_auth_user)
            .field("basic_auth_password", &self.basic_auth_password)
            .field("bearer_token", &self.bearer_token)
            .field("tenant_id", &self.tenant_id)
            .field("ca_file", &self.ca_file)
            .field("timeout", &self.timeout)
            .field("queue_max_bytes", &self.queue_max_bytes)
            .finish()
    }
}

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct CollectionConfig {
    /// On-CPU samples per second per CPU.
    pub frequency: u64,
    #[serde(deserialize_with = "duration")]
    pub upload_interval: Duration,
    /// Off-CPU profiling: `"sampled"` (the default: each tick samples the backends off CPU),
    /// `"exact"` (every context switch on the host runs a BPF program; bench/offcpu.sh
    /// measures what that costs) or `"none"`. `true` and `false` read as sampled and none.
    #[serde(deserialize_with = "off_cpu_mode")]
    pub off_cpu: OffCpuMode,
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
    /// Per instance, the queryids that keep their own `queryid` label, heaviest over the last
    /// minutes first; the others are pushed as `queryid="other"` (0: every queryid).
    pub top_queryids: usize,
    /// Series one instance's push may hold; over it the lightest are folded into coarser label
    /// sets (0: no cap).
    pub max_series: usize,
    /// Label each labelled queryid with its normalized text from pg_stat_statements (`query`).
    pub query_text: bool,
    /// Also label samples with the statement's `state` and `phase` (more series).
    pub statement_detail: bool,
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
    /// Where `/metrics`, `/healthz` and `/readyz` are served: loopback by default, so that
    /// nothing off the host reads them unless asked (the Helm chart sets the pod's IP).
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
            off_cpu: OffCpuMode::Sampled,
            off_cpu_min_stack: Duration::from_micros(100),
            off_cpu_stack_rate: crate::collect::off_cpu::DEFAULT_STACK_RATE,
            off_cpu_idle: false,
            debug_dirs: Vec::new(),
        }
    }
}

impl LabelsConfig {
    /// The cardinality limits.
    pub fn limits(&self) -> super::cardinality::Limits {
        super::cardinality::Limits {
            top_queryids: self.top_queryids,
            max_series: self.max_series,
            statement_detail: self.statement_detail,
        }
    }

    fn cardinality_summary(&self) -> String {
        let limit = |n: usize| match n {
            0 => "no limit".to_string(),
            n => n.to_string(),
        };
        format!(
            "top queryids {}, series per push {}, query texts {}, state and phase {}",
            limit(self.top_queryids),
            limit(self.max_series),
            if self.query_text { "on" } else { "off" },
            if self.statement_detail { "on" } else { "off" }
        )
    }
}

impl Default for LabelsConfig {
    fn default() -> Self {
        Self {
            service_name: "postgres/{instance}".to_string(),
            pid: false,
            static_labels: BTreeMap::new(),
            pod_service_name: true,
            top_queryids: 100,
            max_series: 1000,
            query_text: true,
            statement_detail: false,
        }
    }
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            metrics_addr: SocketAddr::from(([127, 0, 0, 1], 9437)),
            log_format: LogFormat::Text,
        }
    }
}

/// `line L, column C (key `k`): ` of byte `offset` of a TOML text; the key is the text before
/// `=` on that line when it looks like a key.
fn place(text: &str, offset: usize) -> String {
    let mut offset = offset.min(text.len());
    while !text.is_char_boundary(offset) {
        offset -= 1;
    }
    let before = &text[..offset];
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    let line = before.matches('\n').count() + 1;
    let column = before[line_start..].chars().count() + 1;
    let line_text = text[line_start..].lines().next().unwrap_or_default();
    let key = line_text
        .split_once('=')
        .map(|(key, _)| key.trim())
        .filter(|key| !key.is_empty() && key.len() <= 64)
        .filter(|key| {
            key.chars()
                .all(|c| c.is_ascii_lowercase() || c == '_' || c == '.')
        });
    match key {
        Some(key) => format!("line {line}, column {column} (key `{key}`): "),
        None => format!("line {line}, column {column}: "),
    }
}

/// `PGSCOPE_METRICS_ADDR`: `IP:PORT`, or an IP alone (what Kubernetes' `status.podIP` gives)
/// served on `port`.
fn metrics_addr(value: &str, port: u16) -> Result<SocketAddr> {
    if let Ok(addr) = value.parse::<SocketAddr>() {
        return Ok(addr);
    }
    match value
        .trim_start_matches('[')
        .trim_end_matches(']')
        .parse::<IpAddr>()
    {
        Ok(ip) => Ok(SocketAddr::new(ip, port)),
        Err(_) => bail!("PGSCOPE_METRICS_ADDR: `{value}` is neither IP:PORT nor an IP address"),
    }
}

fn duration<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Duration, D::Error> {
    let text = String::deserialize(deserializer)?;
    humantime::parse_duration(&text).map_err(|error| {
        serde::de::Error::custom(format!("`{text}` is not a duration (e.g. 15s, 500ms): {error}"))
    })
}

/// `collection.off_cpu`: a mode, or a boolean as earlier versions took it (on is sampled).
fn off_cpu_mode<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<OffCpuMode, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum ModeOrBool {
        Bool(bool),
        Mode(String),
    }
    match ModeOrBool::deserialize(deserializer)? {
        ModeOrBool::Bool(true) => Ok(OffCpuMode::Sampled),
        ModeOrBool::Bool(false) => Ok(OffCpuMode::None),
        ModeOrBool::Mode(text) => match text.as_str() {
            "sampled" => Ok(OffCpuMode::Sampled),
            "exact" => Ok(OffCpuMode::Exact),
            "none" => Ok(OffCpuMode::None),
            "both" => Ok(OffCpuMode::Both),
            _ => Err(serde::de::Error::custom(format!(
                "`{text}` is not an off-CPU mode: use \"sampled\", \"exact\" or \"none\""
            ))),
        },
    }
}

/// What the command line sets; `None` leaves the file's (or the default) value.
#[derive(Clone, Debug, Default)]
pub struct Overrides {
    pub pyroscope_url: Option<String>,
    pub service_name: Option<String>,
    pub frequency: Option<u64>,
    pub upload_interval: Option<Duration>,
    pub metrics_addr: Option<SocketAddr>,
    pub off_cpu: Option<OffCpuMode>,
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
                let text = input_file::read_to_string(path, "the config file", input_file::CONFIG_MAX_BYTES)?;
                Self::parse(&text).with_context(|| format!("in the config file `{}`", path.display()))?
            }
            None => Self::default(),
        };
        config.apply_env(env)?;
        config.apply(flags);
        config.validate()?;
        Ok(config)
    }

    /// Errors say where (line, column, key) and what, e.g. "unknown field `frequncy`", but
    /// never quote the file's line as toml would: a password may be on it, under a misspelt
    /// key that redaction cannot recognise.
    pub fn parse(text: &str) -> Result<Self> {
        toml::from_str(text).map_err(|error| {
            let place = error
                .span()
                .map(|span| place(text, span.start))
                .unwrap_or_default();
            anyhow::anyhow!("{place}{}", redact::text(error.message().trim_end()))
        })
    }

    /// `PGSCOPE_PYROSCOPE_URL`, … : secrets (password, token) are best given this way, e.g.
    /// from a Kubernetes Secret, rather than in the file.
    fn apply_env(&mut self, env: &dyn Fn(&str) -> Option<String>) -> Result<()> {
        let pyroscope = &mut self.pyroscope;
        for (name, slot) in [
            ("PGSCOPE_PYROSCOPE_URL", &mut pyroscope.url),
            ("PGSCOPE_PYROSCOPE_USER", &mut pyroscope.basic_auth_user),
            ("PGSCOPE_PYROSCOPE_TENANT", &mut pyroscope.tenant_id),
        ] {
            if let Some(value) = env(name).filter(|v| !v.is_empty()) {
                *slot = Some(value);
            }
        }
        for (name, slot) in [
            ("PGSCOPE_PYROSCOPE_PASSWORD", &mut pyroscope.basic_auth_password),
            ("PGSCOPE_PYROSCOPE_TOKEN", &mut pyroscope.bearer_token),
        ] {
            if let Some(value) = env(name).filter(|v| !v.is_empty()) {
                *slot = Some(Secret::new(value));
            }
        }
        if let Some(value) = env("PGSCOPE_METRICS_ADDR").filter(|v| !v.is_empty()) {
            self.server.metrics_addr = metrics_addr(&value, self.server.metrics_addr.port())?;
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
             labels: service_name `{}`, pid {}, {} static, {}\n  \
             discovery: {} include / {} exclude filters\n  \
             probes: {}\n  \
             server: {}, {:?} logs",
            redact::url(self.pyroscope.url.as_deref().unwrap_or("?")),
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
            self.collection.off_cpu.name(),
            self.labels.service_name,
            if self.labels.pid { "on" } else { "off" },
            self.labels.static_labels.len(),
            self.labels.cardinality_summary(),
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
        // Says what is wrong without quoting a password the URL holds.
        let (_, url_auth) = exporters::pyroscope::split_credentials(url)
            .map_err(|error| anyhow::anyhow!("pyroscope.url: {error}"))?;
        if url_auth.is_some()
            && (self.pyroscope.basic_auth_user.is_some() || self.pyroscope.bearer_token.is_some())
        {
            bail!("pyroscope.url holds credentials (user:password@) and pyroscope.basic_auth_user or bearer_token is set too: keep one");
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
        if self.collection.off_cpu == OffCpuMode::Both {
            bail!("collection.off_cpu = \"both\" is for `pgscope trace` (it would ship off-CPU time twice): use \"sampled\", \"exact\" or \"none\"");
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
mod tests;

#[cfg(test)]
mod fuzz;
