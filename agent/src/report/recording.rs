//! A saved trace (`pgscope trace --record FILE`): what the findings and the report are made
//! of, so that a report can be written later, elsewhere, or again after pgscope improves its
//! rules. JSON, versioned like the summary: fields are only added within a version.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{bail, Context, Result};
use exporters::Profile;
use serde::{Deserialize, Serialize};

use crate::bpf::abi::Function;
use crate::model::{Analysis, Measurements, NodeFunctions, PgssEvidence, ProbeRow, QueryId, SpinSiteRow};
use crate::postgres::sql::InstanceFacts;

pub const SCHEMA: &str = "pgscope.recording/v1";

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Recording {
    pub schema: String,
    /// What was traced, as the trace's first line says it: `backend 1234 (client backend)`.
    pub target: String,
    /// Major version attribution was decoded for.
    pub postgres_major: Option<u32>,
    pub frequency_hz: u64,
    pub duration_seconds: f64,
    /// On-CPU samples with their labels (queryid, phase, pid, backend_type, …).
    pub on_cpu: Profile,
    /// Off-CPU nanoseconds, idle client waits included; absent when not measured.
    pub off_cpu: Option<Profile>,
    /// Function-probe counts per queryid (estimates where duty-cycled).
    pub probes: Vec<RecordedProbe>,
    /// pg_stat_statements' eviction counter over the trace.
    pub pgss: Option<PgssEvidence>,
    /// Settings and sizes the findings quote (plan_cache_mode, pg_class rows, …).
    #[serde(default)]
    pub instance: Option<InstanceFacts>,
    /// The sessions that held others' heavyweight locks; absent from older recordings.
    #[serde(default)]
    pub blockers: Option<crate::postgres::blockers::BlockerEvidence>,
    /// Spinlock acquisitions that spun, per call site and queryid.
    #[serde(default)]
    pub spin_sites: Vec<SpinSiteRow>,
    /// Normalized query texts by queryid (decimal), when the instance could be reached.
    pub query_texts: BTreeMap<String, String>,
    /// The executor's per-node functions the symbolizer named (`ExecHashJoin` → `HashJoin`):
    /// kept because a later report has no symbolizer, and splits CPU by plan node with them.
    /// Empty in recordings of older versions, whose reports then show no plan nodes.
    #[serde(default)]
    pub plan_node_functions: NodeFunctions,
}

/// One probed function's calls for one queryid.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RecordedProbe {
    /// Decimal: 64-bit values do not survive JSON numbers in most parsers.
    pub queryid: String,
    /// The function's name (`LockRelationOid`, `pgss_store`, …).
    pub function: String,
    pub calls: u64,
    pub total_ns: u64,
    /// `ProbeRow::detail` (pgss_store's kind); absent from recordings of older versions.
    #[serde(default)]
    pub detail: u32,
}

impl RecordedProbe {
    pub fn new(row: &ProbeRow) -> Self {
        Self {
            queryid: row.query_id.to_string(),
            function: row.function.name().to_string(),
            calls: row.calls,
            total_ns: row.total_ns,
            detail: row.detail,
        }
    }

    /// The row the findings read; None for a name that is no function's (a recording edited
    /// by hand).
    fn row(&self) -> Option<ProbeRow> {
        Some(ProbeRow {
            query_id: self.queryid.parse().ok()?,
            function: Function::named(&self.function).ok()?,
            calls: self.calls,
            total_ns: self.total_ns,
            detail: self.detail,
        })
    }
}

impl Recording {
    /// Reads a recording, saying plainly when the file is something else.
    pub fn load(path: &Path) -> Result<Self> {
        let text = crate::input_file::read(path, "the recording", crate::input_file::RECORDING_MAX_BYTES)?;
        Self::parse(&text, path)
    }

    /// A recording from the bytes of the file at `path` (named in errors).
    fn parse(text: &[u8], path: &Path) -> Result<Self> {
        let value: serde_json::Value = serde_json::from_slice(text).with_context(|| {
            format!(
                "`{}` is not JSON: a recording is written by `pgscope trace --record FILE`",
                path.display()
            )
        })?;
        match value.get("schema").and_then(|s| s.as_str()) {
            Some(SCHEMA) => {}
            Some(other) => bail!(
                "`{}` has schema `{other}`, not `{SCHEMA}`: it is not a recording this pgscope \
                 reads (a --json summary is not a recording; use --record)",
                path.display()
            ),
            None => bail!(
                "`{}` is not a pgscope recording (no `schema` field): write one with \
                 `pgscope trace --record FILE`",
                path.display()
            ),
        }
        let recording: Self = serde_json::from_value(value)
            .with_context(|| format!("the recording `{}` is damaged", path.display()))?;
        recording
            .check_bounds()
            .with_context(|| format!("the recording `{}` is damaged", path.display()))?;
        Ok(recording)
    }

    /// Refuses numbers no trace writes, which the findings' arithmetic (in u64 nanoseconds)
    /// cannot hold: a trace samples at 1 to 10 000 Hz, and no sum of its times passes u64
    /// (584 years).
    fn check_bounds(&self) -> Result<()> {
        let period = self.on_cpu.meta.period;
        if !(1..=1_000_000_000).contains(&period) {
            bail!("the on-CPU sampling period {period} ns is not that of 1 Hz or more");
        }
        let samples = self
            .on_cpu
            .samples
            .iter()
            .try_fold(0u64, |sum, s| sum.checked_add(s.count));
        if samples.and_then(|n| n.checked_mul(period)).is_none() {
            bail!("its on-CPU sample counts add up to more time than a trace can hold");
        }
        let mut off_cpu = self.off_cpu.iter().flat_map(|p| &p.samples);
        if off_cpu
            .try_fold(0u64, |sum, s| sum.checked_add(s.count))
            .is_none()
        {
            bail!("its off-CPU times add up to more than a trace can hold");
        }
        let calls = self.probes.iter().try_fold((0u64, 0u64), |(calls, ns), p| {
            Some((calls.checked_add(p.calls)?, ns.checked_add(p.total_ns)?))
        });
        if calls.is_none() {
            bail!("its probe counts add up to more than a trace can hold");
        }
        Ok(())
    }

    pub fn save(&self, path: &Path, mode: crate::output_file::OutputMode) -> Result<()> {
        crate::output_file::write_with(path, mode, |writer| serde_json::to_writer(writer, self))
            .with_context(|| format!("cannot write the recording to `{}`", path.display()))
    }

    /// The probe rows the findings read (functions this version does not know are left out).
    pub fn probe_rows(&self) -> Vec<ProbeRow> {
        self.probes.iter().filter_map(RecordedProbe::row).collect()
    }

    /// Runs `view` over the analysis of what was recorded: the same model a live trace's
    /// views read.
    pub fn with_analysis<R>(&self, view: impl FnOnce(&Analysis) -> R) -> R {
        let probes = self.probe_rows();
        let analysis = Analysis::new(Measurements {
            on_cpu: &self.on_cpu,
            off_cpu: self.off_cpu.as_ref(),
            probes: &probes,
            spin_sites: &self.spin_sites,
            pgss: self.pgss,
            instance: self.instance.as_ref(),
            blockers: self.blockers.as_ref(),
            postgres_major: self.postgres_major,
        })
        .with_plan_nodes(&self.plan_node_functions);
        view(&analysis)
    }

    /// The normalized text of a query, when known.
    pub fn query_text(&self, query_id: QueryId) -> Option<&str> {
        self.query_texts.get(&query_id.to_string()).map(String::as_str)
    }
}

#[cfg(test)]
mod fuzz;

#[cfg(test)]
mod tests {
    use super::*;
    use exporters::{Frame, FrameKind, ProfileMeta, StackSample};

    fn recording() -> Recording {
        let sample = StackSample {
            frames: vec![Frame {
                name: "exec_simple_query".into(),
                kind: FrameKind::User,
                module: None,
            }],
            labels: vec![("queryid".into(), "-42".into())],
            count: 3,
        };
        Recording {
            schema: SCHEMA.into(),
            target: "instance (postmaster 1)".into(),
            postgres_major: Some(15),
            frequency_hz: 99,
            duration_seconds: 1.5,
            on_cpu: Profile {
                meta: ProfileMeta::cpu(99, 1, 2),
                samples: vec![sample],
            },
            off_cpu: None,
            probes: vec![
                RecordedProbe::new(&ProbeRow {
                    query_id: QueryId(-42),
                    function: Function::LockRelationOid,
                    calls: 7,
                    total_ns: 70,
                    detail: 0,
                }),
                RecordedProbe {
                    queryid: "-42".into(),
                    function: "a_function_of_a_later_version".into(),
                    calls: 1,
                    total_ns: 1,
                    detail: 0,
                },
            ],
            pgss: None,
            instance: None,
            blockers: None,
            spin_sites: Vec::new(),
            query_texts: BTreeMap::from([("-42".into(), "SELECT 1".into())]),
            plan_node_functions: NodeFunctions::from([("ExecSort".into(), "Sort".into())]),
        }
    }

    #[test]
    fn a_saved_recording_loads_back_the_same() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("r.json");
        recording()
            .save(&path, crate::output_file::OutputMode::PRIVATE)
            .expect("save");
        let loaded = Recording::load(&path).expect("load");
        assert_eq!(loaded.on_cpu.samples, recording().on_cpu.samples);
        assert_eq!(loaded.probes, recording().probes);
        assert_eq!(loaded.query_text(QueryId(-42)), Some("SELECT 1"));
        assert_eq!(loaded.plan_node_functions, recording().plan_node_functions);
        assert_eq!(
            loaded.probe_rows(),
            vec![ProbeRow {
                query_id: QueryId(-42),
                function: Function::LockRelationOid,
                calls: 7,
                total_ns: 70,
                detail: 0,
            }],
            "unknown functions are left out"
        );
    }

    #[test]
    fn counts_no_trace_writes_are_refused_before_the_findings_overflow() {
        // Found by the recording fuzzer: the findings multiplied these past u64.
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("r.json");
        let mut huge = recording();
        huge.on_cpu.samples[0].count = u64::MAX / 2;
        huge.save(&path, crate::output_file::OutputMode::PRIVATE)
            .expect("save");
        let error = format!("{:#}", Recording::load(&path).unwrap_err());
        assert!(
            error.contains("is damaged") && error.contains("on-CPU sample counts"),
            "{error}"
        );
        let mut zero = recording();
        zero.on_cpu.meta.period = 0;
        zero.save(&path, crate::output_file::OutputMode::PRIVATE)
            .expect("save");
        let error = format!("{:#}", Recording::load(&path).unwrap_err());
        assert!(error.contains("sampling period 0 ns"), "{error}");
    }

    #[test]
    fn other_files_are_refused_with_what_to_do() {
        let dir = tempfile::tempdir().expect("temp dir");
        let summary = dir.path().join("summary.json");
        std::fs::write(&summary, r#"{"schema":"pgscope.trace.summary/v1"}"#).expect("write");
        let error = format!("{:#}", Recording::load(&summary).unwrap_err());
        assert!(error.contains("use --record"), "{error}");
        let text = dir.path().join("notes.txt");
        std::fs::write(&text, "hello").expect("write");
        let error = format!("{:#}", Recording::load(&text).unwrap_err());
        assert!(error.contains("is not JSON"), "{error}");
        let error = format!("{:#}", Recording::load(&dir.path().join("missing")).unwrap_err());
        assert!(error.contains("cannot open the recording"), "{error}");
    }
}
