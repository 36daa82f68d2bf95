//! Each upload interval: every instance's stacks become a `process_cpu` and an `offcpu`
//! profile, split into one series per label set, and go into the upload queue, which sends
//! them to Pyroscope in the background (retrying, bounded, never blocking collection).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use exporters::pyroscope::{self, ClientConfig, Limits, Sender, SenderConfig, SenderStats};
use exporters::{Profile, ProfileMeta};
use symbolizer::KernelSymbols;
use tracing::{debug, warn};

use super::cardinality::{FoldReason, QueryIdRanking};
use super::config::AgentConfig;
use super::pods::PodIndex;
use super::query_texts::QueryTexts;
use crate::collect::instance::InstanceContext;
use crate::collect::session::Instance;
use crate::collect::{off_cpu, InstanceStacks, Session};
use crate::postgres::attribution::LabelNames;
use crate::postgres::sql;

/// How often database names are looked up again for OIDs not known yet.
const DATABASE_NAMES_RETRY: Duration = Duration::from_secs(60);
/// How long kernel symbols are used before /proc/kallsyms is read again.
const KERNEL_SYMBOLS_MAX_AGE: Duration = Duration::from_secs(300);
/// How long a database-name lookup may hold up an upload.
const SQL_TIMEOUT: Duration = Duration::from_secs(2);

pub struct Exporter {
    sender: Sender,
    host: String,
    limits: Limits,
    /// The Kubernetes node (`PGSCOPE_NODE_NAME`, set by the Helm chart), as the `node` label.
    node: Option<String>,
    /// Container ID → pod, from the Kubernetes API when there is one.
    pods: Arc<RwLock<PodIndex>>,
    /// Kernel symbols and when they were read.
    kernel: Option<(KernelSymbols, Instant)>,
    labels_dropped: u64,
    /// Stacks left out because a profile of that one stack alone exceeds Pyroscope's size limit.
    stacks_dropped: u64,
    /// Per instance (root PID): database OID → name, and when they were last looked up.
    database_names: HashMap<u32, (HashMap<u32, String>, Option<Instant>)>,
    /// Per instance (root PID): (database OID, `pg_trigger.oid`) → trigger label, and when
    /// they were last looked up.
    trigger_names: HashMap<u32, (TriggerNames, Option<Instant>)>,
    /// Per instance (root PID): the queryids labelled in its last push.
    rankings: HashMap<u32, QueryIdRanking>,
    /// Series folded to bound the cardinality, per reason.
    series_folded: BTreeMap<FoldReason, u64>,
    /// The `query` label's texts, per instance.
    query_texts: QueryTexts,
}

/// (database OID, `pg_trigger.oid`) → trigger label.
type TriggerNames = HashMap<(u32, u32), String>;

impl Exporter {
    pub fn start(config: &AgentConfig, pods: Arc<RwLock<PodIndex>>) -> Result<Self> {
        let sender = Sender::start(client_config(config)?, sender_config(config))
            .context("starting the Pyroscope sender")?;
        Ok(Self {
            sender,
            host: host_name(),
            limits: Limits::default(),
            node: std::env::var("PGSCOPE_NODE_NAME").ok().filter(|n| !n.is_empty()),
            pods,
            kernel: None,
            labels_dropped: 0,
            stacks_dropped: 0,
            database_names: HashMap::new(),
            trigger_names: HashMap::new(),
            rankings: HashMap::new(),
            series_folded: BTreeMap::new(),
            query_texts: QueryTexts::default(),
        })
    }

    /// A reload: new URL, credentials or queue size apply to the batches sent from now on;
    /// batches already queued stay queued.
    pub fn reconfigure(&mut self, config: &AgentConfig) -> Result<()> {
        self.sender
            .reconfigure(client_config(config)?, sender_config(config))
            .context("applying the new Pyroscope settings")
    }

    /// The instance's name in the `instance` label.
    pub fn instance_name(&self, context: &InstanceContext) -> String {
        context.facts.name(&self.host)
    }

    pub fn labels_dropped(&self) -> u64 {
        self.labels_dropped
    }

    pub fn stacks_dropped(&self) -> u64 {
        self.stacks_dropped
    }

    /// Series folded to bound the cardinality, per reason, since the start.
    pub fn series_folded(&self) -> &BTreeMap<FoldReason, u64> {
        &self.series_folded
    }

    pub fn stats(&self) -> SenderStats {
        self.sender.stats()
    }

    /// Queues the stacks of every instance counted over `interval` (unix ns), and starts the
    /// next interval empty; each instance's findings are evaluated over what it sends.
    pub async fn upload(
        &mut self,
        session: &mut Session,
        config: &AgentConfig,
        interval: std::ops::Range<u64>,
        probe_rows: &BTreeMap<u32, Vec<super::probes::CallRow>>,
        enqueued: &mut BTreeMap<&'static str, u64>,
        findings: &mut super::findings_state::AgentFindings,
    ) {
        let (start, end) = (interval.start, interval.end);
        let names: HashMap<u32, (String, Vec<(String, String)>)> = session
            .instances()
            .map(|instance| {
                let context = &instance.context;
                (
                    context.root,
                    (self.instance_name(context), container_labels(context)),
                )
            })
            .collect();
        let mut pgss = HashMap::new();
        let mut blockers = HashMap::new();
        let mut majors = HashMap::new();
        for instance in session.instances() {
            let root = instance.context.root;
            majors.insert(root, instance.context.version.map(|table| table.major));
            let oids = instance.stacks.on_cpu.database_oids();
            self.refresh_database_names(root, &oids).await;
            let triggers = instance.stacks.on_cpu.triggers_by_database();
            self.refresh_trigger_names(root, &triggers).await;
            // Read as the stacks are taken, so that the counter spans the same interval.
            if let Some(evidence) = findings.read_pgss(root).await {
                pgss.insert(root, evidence);
            }
            if let Some(evidence) = findings.take_blockers(root) {
                blockers.insert(root, evidence);
            }
        }
        // Out of `self` while frames are named: enqueueing needs `self` mutably.
        let cached = self.kernel_symbols();
        let kernel = cached.as_ref().map(|(symbols, _)| symbols);
        let (taken, symbolizer) = session.take_stacks();
        for (root, stacks) in taken {
            let Some((name, container)) = names.get(&root) else {
                continue;
            };
            let databases = self
                .database_names
                .get(&root)
                .map(|(names, _)| names.clone())
                .unwrap_or_default();
            let triggers = self
                .trigger_names
                .get(&root)
                .map(|(names, _)| names.clone())
                .unwrap_or_default();
            let names = LabelNames {
                databases: &databases,
                triggers: &triggers,
            };
            let mut profiles = profiles_of(&stacks, symbolizer, kernel, names, config, start, end);
            // What the interval shows, diagnosed from the profiles about to be sent.
            findings.evaluate(
                name,
                &profiles,
                probe_rows.get(&root).map(Vec::as_slice),
                pgss.get(&root).copied(),
                blockers.get(&root),
                majors.get(&root).copied().flatten(),
            );
            if let Some(rows) = probe_rows.get(&root) {
                profiles.extend(super::probes::profiles(rows, start, end));
            }
            self.fold(root, &mut profiles, config, end);
            if config.labels.query_text {
                if let Some(client) = findings.lend_pgss(root) {
                    if let Some(client) = self.query_texts.refresh(root, &profiles, client).await {
                        findings.return_pgss(root, client);
                    }
                }
                self.query_texts.apply(root, &mut profiles);
            }
            self.enqueue(name, container, profiles, config, enqueued);
        }
        self.kernel = cached;
    }

    /// Queues what is left of an instance that is gone, counted in `enqueued` like every
    /// interval's profiles (a batch delivered or dropped must have been counted as queued).
    pub fn upload_instance(
        &mut self,
        session: &mut Session,
        gone: Instance,
        config: &AgentConfig,
        enqueued: &mut BTreeMap<&'static str, u64>,
    ) {
        let name = self.instance_name(&gone.context);
        let container = container_labels(&gone.context);
        let end = super::unix_nanos();
        let cached = self.kernel_symbols();
        let kernel = cached.as_ref().map(|(symbols, _)| symbols);
        let databases = self
            .database_names
            .remove(&gone.context.root)
            .map(|(names, _)| names)
            .unwrap_or_default();
        let triggers = self
            .trigger_names
            .remove(&gone.context.root)
            .map(|(names, _)| names)
            .unwrap_or_default();
        let names = LabelNames {
            databases: &databases,
            triggers: &triggers,
        };
        // The interval it belonged to is not known here: it ends now.
        let start = end.saturating_sub(config.collection.upload_interval.as_nanos() as u64);
        let mut profiles = profiles_of(
            &gone.stacks,
            &mut session.symbolizer,
            kernel,
            names,
            config,
            start,
            end,
        );
        self.kernel = cached;
        self.fold(gone.context.root, &mut profiles, config, end);
        self.rankings.remove(&gone.context.root);
        // Gone: the texts already read, none asked for.
        if config.labels.query_text {
            self.query_texts.apply(gone.context.root, &mut profiles);
        }
        self.query_texts.forget(gone.context.root);
        self.enqueue(&name, &container, profiles, config, enqueued);
    }

    /// Bounds the series of an instance's push (daemon/cardinality.rs) of the interval ending
    /// at `end` (ns since the epoch), after the findings have read every queryid.
    fn fold(&mut self, root: u32, profiles: &mut [(&'static str, Profile)], config: &AgentConfig, end: u64) {
        let folded = self.rankings.entry(root).or_default().fold(
            profiles,
            config.labels.limits(),
            Duration::from_nanos(end),
        );
        for (reason, series) in folded.by_reason {
            *self.series_folded.entry(reason).or_default() += series;
        }
    }

    fn enqueue(
        &mut self,
        instance: &str,
        container: &[(String, String)],
        profiles: Vec<(&'static str, Profile)>,
        config: &AgentConfig,
        enqueued: &mut BTreeMap<&'static str, u64>,
    ) {
        let mut base = base_labels(instance, config);
        base.extend(container.iter().cloned());
        let pod = container
            .iter()
            .find(|(name, _)| name == "container_id")
            .and_then(|(_, id)| self.pods.read().ok()?.lookup(id).cloned());
        if let Some(pod) = pod {
            if config.labels.pod_service_name {
                if let Some(slot) = base.iter_mut().find(|(name, _)| name == "service_name") {
                    slot.1 = pod.service_name.clone();
                }
            }
            base.push(("namespace".to_string(), pod.namespace));
            base.push(("pod".to_string(), pod.pod));
            base.push(("container".to_string(), pod.container));
        }
        if let Some(node) = &self.node {
            base.push(("node".to_string(), node.clone()));
        }
        for (kind, profile) in profiles {
            if profile.samples.is_empty() {
                continue;
            }
            let profile = without_pid(profile, config.labels.pid);
            match pyroscope::build_series(&profile, kind, &base, &self.limits) {
                Ok(built) => {
                    self.labels_dropped += built.labels_dropped;
                    self.stacks_dropped += built.samples_dropped;
                    if built.series.is_empty() {
                        continue;
                    }
                    self.sender.enqueue(built.series);
                    *enqueued.entry(kind).or_insert(0) += 1;
                }
                Err(error) => warn!(instance, profile = kind, "profile not sent: {error:#}"),
            }
        }
    }

    /// Looks up database names over SQL when OIDs without a name show up (at most once a
    /// minute per instance: a failing connection must not slow every upload down).
    async fn refresh_database_names(&mut self, root: u32, oids: &std::collections::HashSet<u32>) {
        let entry = self
            .database_names
            .entry(root)
            .or_insert_with(|| (HashMap::new(), None));
        let unknown = oids.iter().any(|oid| !entry.0.contains_key(oid));
        let due = entry.1.is_none_or(|last| last.elapsed() >= DATABASE_NAMES_RETRY);
        if !unknown || !due {
            return;
        }
        entry.1 = Some(Instant::now());
        let lookup = async {
            let target = sql::Connect::for_process(root)?;
            let client = sql::connect(&target).await?;
            sql::database_names(&client).await
        };
        match tokio::time::timeout(SQL_TIMEOUT, lookup).await {
            Ok(Ok(names)) => entry.0 = names,
            Ok(Err(error)) => debug!(postmaster = root, "database labels stay OIDs: {error:#}"),
            Err(_) => debug!(
                postmaster = root,
                "database labels stay OIDs: the lookup timed out"
            ),
        }
    }

    /// Names the triggers the instance's samples ran in (`triggers`, by database OID) that
    /// are not named yet, in their databases, at most once a minute per instance like the
    /// databases' names.
    async fn refresh_trigger_names(
        &mut self,
        root: u32,
        triggers: &std::collections::BTreeMap<u32, std::collections::BTreeSet<u32>>,
    ) {
        let entry = self
            .trigger_names
            .entry(root)
            .or_insert_with(|| (HashMap::new(), None));
        let unknown: Vec<(u32, Vec<u32>)> = triggers
            .iter()
            .map(|(&database, oids)| {
                let oids = oids
                    .iter()
                    .copied()
                    .filter(|&oid| !entry.0.contains_key(&(database, oid)))
                    .collect::<Vec<u32>>();
                (database, oids)
            })
            .filter(|(_, oids)| !oids.is_empty())
            .collect();
        let due = entry.1.is_none_or(|last| last.elapsed() >= DATABASE_NAMES_RETRY);
        if unknown.is_empty() || !due {
            return;
        }
        entry.1 = Some(Instant::now());
        let databases = self
            .database_names
            .get(&root)
            .map(|(names, _)| names.clone())
            .unwrap_or_default();
        for (database, oids) in unknown {
            let Some(name) = databases.get(&database) else {
                continue;
            };
            let lookup = async {
                let target = sql::Connect::for_process(root)?;
                let client = sql::connect_db(&target, Some(name)).await?;
                sql::trigger_names(&client, &oids).await
            };
            match tokio::time::timeout(SQL_TIMEOUT, lookup).await {
                Ok(Ok(found)) => {
                    if let Some(entry) = self.trigger_names.get_mut(&root) {
                        entry
                            .0
                            .extend(found.into_iter().map(|(oid, label)| ((database, oid), label)));
                    }
                }
                Ok(Err(error)) => {
                    debug!(postmaster = root, database = %name, "trigger labels stay OIDs: {error:#}")
                }
                Err(_) => debug!(
                    postmaster = root,
                    database = %name,
                    "trigger labels stay OIDs: the lookup timed out"
                ),
            }
        }
    }

    /// The kernel's symbols, read again every few minutes (modules load and unload; reading
    /// /proc/kallsyms costs tens of milliseconds), taken out of the cache for the caller to put
    /// back.
    fn kernel_symbols(&mut self) -> Option<(KernelSymbols, Instant)> {
        let fresh = self
            .kernel
            .as_ref()
            .is_some_and(|(_, read)| read.elapsed() < KERNEL_SYMBOLS_MAX_AGE);
        if fresh {
            return self.kernel.take();
        }
        match KernelSymbols::load() {
            Ok(symbols) => Some((symbols, Instant::now())),
            Err(error) => {
                debug!("kernel frames will be unnamed: {error}");
                None
            }
        }
    }

    /// Sends what is queued until `deadline`; returns the batches left unsent.
    pub async fn shutdown(self, deadline: Duration) -> u64 {
        self.sender.flush(deadline).await
    }
}

/// The on-CPU and off-CPU profiles of one instance's interval.
fn profiles_of(
    stacks: &InstanceStacks,
    symbolizer: &mut symbolizer::Symbolizer,
    kernel: Option<&KernelSymbols>,
    names: LabelNames<'_>,
    config: &AgentConfig,
    start: u64,
    end: u64,
) -> Vec<(&'static str, Profile)> {
    let duration = end.saturating_sub(start);
    let cpu_meta = ProfileMeta::cpu(config.collection.frequency, start, duration);
    let mut profiles = vec![(
        "process_cpu",
        stacks.on_cpu.to_profile(symbolizer, kernel, cpu_meta, names),
    )];
    if stacks.off_cpu.distinct() > 0 {
        let meta = ProfileMeta::off_cpu(start, duration);
        let profile = stacks.off_cpu.to_profile(symbolizer, kernel, meta, names);
        let profile = match config.collection.off_cpu_idle {
            true => profile,
            false => off_cpu::without_idle(&profile),
        };
        profiles.push(("offcpu", profile));
    }
    profiles
}

/// `service_name`, `instance` and the static labels, shared by every series of an instance.
fn base_labels(instance: &str, config: &AgentConfig) -> Vec<(String, String)> {
    let mut labels = vec![
        (
            "service_name".to_string(),
            config.labels.service_name.replace("{instance}", instance),
        ),
        ("instance".to_string(), instance.to_string()),
    ];
    labels.extend(
        config
            .labels
            .static_labels
            .iter()
            .map(|(k, v)| (k.clone(), v.clone())),
    );
    labels
}

/// Where a containerised instance runs: its container ID and the postmaster's PID in its own
/// PID namespace (what `ps` shows inside the container).
fn container_labels(context: &InstanceContext) -> Vec<(String, String)> {
    let container = &context.facts.container;
    let mut labels = Vec::new();
    if let Some(id) = &container.container_id {
        labels.push(("container_id".to_string(), id.clone()));
    }
    if let Some(pid) = container.namespace_pid {
        labels.push(("container_pid".to_string(), pid.to_string()));
    }
    labels
}

/// The `pid` label makes one series per backend: kept only on request.
fn without_pid(mut profile: Profile, keep: bool) -> Profile {
    if !keep {
        for sample in &mut profile.samples {
            sample
                .labels
                .retain(|(name, _)| name != crate::model::labels::PID);
        }
    }
    profile
}

fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|name| name.trim().to_string())
        .ok()
        .filter(|name| !name.is_empty())
        .unwrap_or_else(|| "localhost".to_string())
}

fn client_config(config: &AgentConfig) -> Result<ClientConfig> {
    let pyroscope = &config.pyroscope;
    let ca_cert_pem = match &pyroscope.ca_file {
        Some(path) => Some(crate::input_file::read(
            path,
            "pyroscope.ca_file",
            crate::input_file::CA_MAX_BYTES,
        )?),
        None => None,
    };
    Ok(ClientConfig {
        url: pyroscope.url.clone().unwrap_or_default(),
        basic_auth: pyroscope.basic_auth_user.clone().zip(
            pyroscope
                .basic_auth_password
                .as_ref()
                .map(|p| p.expose().to_string()),
        ),
        bearer_token: pyroscope.bearer_token.as_ref().map(|t| t.expose().to_string()),
        tenant_id: pyroscope.tenant_id.clone(),
        ca_cert_pem,
        timeout: pyroscope.timeout,
        user_agent: format!("pgscope/{}", env!("CARGO_PKG_VERSION")),
    })
}

fn sender_config(config: &AgentConfig) -> SenderConfig {
    SenderConfig {
        queue_max_bytes: config.pyroscope.queue_max_bytes,
        ..SenderConfig::default()
    }
}
