//! Reading back the JSON summary of `pgscope trace --json` (schema `pgscope.trace.summary/v1`,
//! documented in the README): the probe tables and the sample counters the tests check.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{bail, ensure, Context, Result};
use serde_json::Value;

/// The schema this reader understands.
pub const SCHEMA: &str = "pgscope.trace.summary/v1";

/// One `pgscope trace --json` file.
#[derive(Debug, Clone)]
pub struct TraceSummary {
    json: Value,
}

/// Calls, time and latency histogram of one probed function (`probes[]` or
/// `probes_by_query[]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallStats {
    pub calls: u64,
    /// The function's own time: the traps of the probed calls it made taken out.
    pub total_ns: u64,
    /// From entry to return as measured, nested probe traps included (what `max_ns` and the
    /// histogram measure).
    pub total_ns_with_nested_traps: u64,
    pub max_ns: u64,
    /// `histogram_log2_ns[i]` counts calls that took [2^i, 2^(i+1)) ns.
    pub histogram_log2_ns: Vec<u64>,
}

/// One `relation_locks[]` row: LockRelationOid calls of one query on one relation in one mode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RelationLock {
    pub relid: u32,
    /// `AccessShareLock`, `RowExclusiveLock`, …
    pub lockmode: String,
    pub calls: u64,
}

/// One `spin_sites[]` row: s_lock calls from one call site under one query.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpinSite {
    pub queryid: String,
    pub file: String,
    pub line: u32,
    pub function: String,
    pub calls: u64,
    pub total_ns: u64,
}

/// One `off_cpu.by_wait[]` row: off-CPU time of one backend type in one wait event and class.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OffCpuWait {
    pub backend_type: String,
    pub wait_event: String,
    pub off_cpu: String,
    pub ns: u64,
}

/// One wait of one query in `off_cpu.by_query[]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OffCpuQueryWait {
    pub queryid: String,
    pub wait_event: String,
    pub off_cpu: String,
    pub ns: u64,
    /// Where its longest stack waited (the wait machinery skipped), innermost first, joined by
    /// ` ← `.
    pub stack: String,
}

/// One `wall_clock[]` row: a statement's wall-clock time (the client's time left out) and its
/// parts, largest first.
#[derive(Debug, Clone, PartialEq)]
pub struct StatementWall {
    pub queryid: String,
    pub total_ns: u64,
    pub parts: Vec<WallPart>,
}

/// One part of a statement's time: `CPU`, a wait event, or the class of off-CPU time without one.
#[derive(Debug, Clone, PartialEq)]
pub struct WallPart {
    pub name: String,
    pub ns: u64,
    pub pct: f64,
}

/// One entry of `modules[]`.
#[derive(Debug, Clone, serde::Deserialize)]
pub struct ModuleShare {
    pub name: String,
    pub self_samples: u64,
    pub total_samples: u64,
    pub self_pct: f64,
    pub total_pct: f64,
}

/// One of a statement's `hot_paths[]`.
#[derive(Debug, Clone, serde::Deserialize)]
pub struct HotPath {
    pub samples: u64,
    pub self_samples: u64,
    pub frames: Vec<PathFrame>,
}

#[derive(Debug, Clone, serde::Deserialize)]
pub struct PathFrame {
    pub name: String,
    pub module: Option<String>,
    pub samples: u64,
}

impl TraceSummary {
    /// Parses `path` and checks its `schema`.
    pub fn read(path: &Path) -> Result<Self> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("cannot read `{}`", path.display()))?;
        let json: Value =
            serde_json::from_str(&text).with_context(|| format!("`{}` is not JSON", path.display()))?;
        let schema = json.get("schema").and_then(Value::as_str);
        ensure!(
            schema == Some(SCHEMA),
            "`{}` has schema {schema:?}, expected `{SCHEMA}`",
            path.display()
        );
        Ok(Self { json })
    }

    /// `modules[]`: every module's samples, most self first.
    pub fn modules(&self) -> Result<Vec<ModuleShare>> {
        let modules = self.json.get("modules").context("the summary has no `modules`")?;
        serde_json::from_value(modules.clone()).context("`modules` is not what pgscope writes")
    }

    /// `top_functions[0].self_pct`: the largest share one function holds on its own.
    pub fn top_self_pct(&self) -> Result<f64> {
        self.json
            .pointer("/top_functions/0/self_pct")
            .and_then(Value::as_f64)
            .context("the summary has no top function")
    }

    /// `queries[].queryid`, most samples first.
    pub fn query_ids(&self) -> Result<Vec<String>> {
        let queries = self
            .json
            .get("queries")
            .and_then(Value::as_array)
            .context("the summary has no `queries`")?;
        Ok(queries
            .iter()
            .filter_map(|q| q.get("queryid").and_then(Value::as_str).map(str::to_string))
            .collect())
    }

    /// `queries[].samples` and `queries[].hot_paths` of `queryid`.
    pub fn hot_paths_of_query(&self, queryid: &str) -> Result<(u64, Vec<HotPath>)> {
        let query = self
            .json
            .get("queries")
            .and_then(Value::as_array)
            .and_then(|queries| {
                queries
                    .iter()
                    .find(|q| q.get("queryid").and_then(Value::as_str) == Some(queryid))
            })
            .with_context(|| format!("no query `{queryid}` in the summary"))?;
        let samples = query
            .get("samples")
            .and_then(Value::as_u64)
            .context("a query without `samples`")?;
        let paths = query.get("hot_paths").context("a query without `hot_paths`")?;
        let paths =
            serde_json::from_value(paths.clone()).context("`hot_paths` is not what pgscope writes")?;
        Ok((samples, paths))
    }

    /// `pg_stat_statements[queryid]`: what the statement's pg_stat_statements counters grew by
    /// over the trace, by column; None when the summary has none for it.
    pub fn pgss_delta(&self, queryid: &str) -> Result<Option<BTreeMap<String, f64>>> {
        self.counters_of("pg_stat_statements", queryid)
    }

    /// `view[row]` (`view` one of `pg_stat_database`, by database, and `pg_stat_io`, by
    /// `backend type/object/context`): what the row's counters grew by over the trace; None
    /// when the row did not move (or the view was not read).
    pub fn stat_view_delta(&self, view: &str, row: &str) -> Result<Option<BTreeMap<String, f64>>> {
        self.counters_of(view, row)
    }

    /// `top[row]`: counters by column; None without that row.
    fn counters_of(&self, top: &str, row: &str) -> Result<Option<BTreeMap<String, f64>>> {
        let rows = self
            .json
            .get(top)
            .and_then(Value::as_object)
            .with_context(|| format!("the summary has no object `{top}`"))?;
        let Some(columns) = rows.get(row) else {
            return Ok(None);
        };
        let columns = columns
            .as_object()
            .with_context(|| format!("`{top}.{row}` is not an object"))?;
        columns
            .iter()
            .map(|(name, value)| {
                let value = value
                    .as_f64()
                    .with_context(|| format!("`{top}.{row}.{name}` is {value}"))?;
                Ok((name.clone(), value))
            })
            .collect::<Result<_>>()
            .map(Some)
    }

    /// The rows of `view` the summary has (those that moved).
    pub fn stat_view_rows(&self, view: &str) -> Result<Vec<String>> {
        let rows = self
            .json
            .get(view)
            .and_then(Value::as_object)
            .with_context(|| format!("the summary has no object `{view}`"))?;
        Ok(rows.keys().cloned().collect())
    }

    /// `postgres_major`: the major attribution was decoded with, `None` when pgscope had no
    /// table for the instance's major (JSON null).
    pub fn postgres_major(&self) -> Result<Option<u32>> {
        match self.json.get("postgres_major") {
            Some(Value::Null) => Ok(None),
            Some(value) => {
                let major = value
                    .as_u64()
                    .and_then(|m| u32::try_from(m).ok())
                    .with_context(|| format!("`postgres_major` is {value}, not a major version"))?;
                Ok(Some(major))
            }
            None => bail!("the summary has no field `postgres_major`"),
        }
    }

    /// Samples per statement phase (`parse`, `plan`, `run`, `commit`, …, and `other`), summed
    /// over every `queries[].phases`: the phases of the statements pgscope attributed.
    pub fn phase_samples(&self) -> Result<BTreeMap<String, u64>> {
        let mut phases = BTreeMap::new();
        for query in self.array("queries")? {
            let of_query = query
                .get("phases")
                .and_then(Value::as_object)
                .with_context(|| format!("no object `phases` in {query}"))?;
            for (phase, n) in of_query {
                let n = n
                    .as_u64()
                    .with_context(|| format!("phase `{phase}` has `{n}` samples, not a count"))?;
                *phases.entry(phase.clone()).or_insert(0) += n;
            }
        }
        Ok(phases)
    }

    /// Samples per phase of one statement (`queries[].phases` of `queryid`).
    pub fn phases_of_query(&self, queryid: &str) -> Result<BTreeMap<String, u64>> {
        self.counts_of_query(queryid, "phases")
    }

    /// `queries[].triggers` of `queryid`: samples per trigger label (`constraint <name>`).
    pub fn triggers_of_query(&self, queryid: &str) -> Result<BTreeMap<String, u64>> {
        self.counts_of_query(queryid, "triggers")
    }

    /// An object of sample counts in the `queries[]` entry of `queryid`.
    fn counts_of_query(&self, queryid: &str, key: &str) -> Result<BTreeMap<String, u64>> {
        let query = self
            .array("queries")?
            .iter()
            .find(|q| q.get("queryid").and_then(Value::as_str) == Some(queryid))
            .with_context(|| format!("no entry for queryid {queryid} in `queries`"))?;
        let counts = query
            .get(key)
            .and_then(Value::as_object)
            .with_context(|| format!("no object `{key}` in {query}"))?;
        counts
            .iter()
            .map(|(name, n)| {
                let n = n
                    .as_u64()
                    .with_context(|| format!("`{key}.{name}` has `{n}` samples, not a count"))?;
                Ok((name.clone(), n))
            })
            .collect()
    }

    /// `samples.user_stacks_complete_pct`.
    pub fn user_stacks_complete_pct(&self) -> Result<f64> {
        self.json
            .pointer("/samples/user_stacks_complete_pct")
            .and_then(Value::as_f64)
            .context("the summary has no number `samples.user_stacks_complete_pct`")
    }

    /// `samples.filtered_out`: samples of other queries left out by `--queryid`.
    pub fn samples_filtered_out(&self) -> Result<u64> {
        self.json
            .pointer("/samples/filtered_out")
            .and_then(Value::as_u64)
            .context("the summary has no number `samples.filtered_out`")
    }

    /// `samples.taken_in_kernel`: samples of the target processes the BPF side took.
    pub fn samples_taken_in_kernel(&self) -> Result<u64> {
        self.json
            .pointer("/samples/taken_in_kernel")
            .and_then(Value::as_u64)
            .context("the summary has no number `samples.taken_in_kernel`")
    }

    /// The sum of `samples.lost`: samples taken but never delivered, whatever the reason.
    pub fn samples_lost(&self) -> Result<u64> {
        let lost = self
            .json
            .pointer("/samples/lost")
            .and_then(Value::as_object)
            .context("the summary has no object `samples.lost`")?;
        lost.iter()
            .map(|(reason, n)| {
                n.as_u64()
                    .with_context(|| format!("`samples.lost.{reason}` is not a count: {n}"))
            })
            .sum()
    }

    /// `samples.off_cpu_sought_stack`: off-CPU samples that sought a stack.
    pub fn off_cpu_sought_stack(&self) -> Result<u64> {
        self.json
            .pointer("/samples/off_cpu_sought_stack")
            .and_then(Value::as_u64)
            .context("the summary has no number `samples.off_cpu_sought_stack`")
    }

    /// `samples.degraded`: samples kept with a part missing, by reason.
    pub fn samples_degraded(&self) -> Result<BTreeMap<String, u64>> {
        let degraded = self
            .json
            .pointer("/samples/degraded")
            .and_then(Value::as_object)
            .context("the summary has no object `samples.degraded`")?;
        degraded
            .iter()
            .map(|(reason, n)| {
                let n = n
                    .as_u64()
                    .with_context(|| format!("`samples.degraded.{reason}` is not a count: {n}"))?;
                Ok((reason.clone(), n))
            })
            .collect()
    }

    /// `samples.profiled`: samples kept in the profile.
    pub fn samples_profiled(&self) -> Result<u64> {
        self.json
            .pointer("/samples/profiled")
            .and_then(Value::as_u64)
            .context("the summary has no number `samples.profiled`")
    }

    /// The `probes[]` row of `function`; `None` when the function was not attached.
    pub fn probe(&self, function: &str) -> Result<Option<CallStats>> {
        for row in self.array("probes")? {
            if row.get("function").and_then(Value::as_str) == Some(function) {
                return call_stats(row).map(Some);
            }
        }
        Ok(None)
    }

    /// `probes[].attached_share` of `function`: the share of the trace it was attached.
    pub fn attached_share(&self, function: &str) -> Result<f64> {
        self.probe_field(function, "attached_share")?
            .as_f64()
            .with_context(|| format!("`attached_share` of {function} is not a number"))
    }

    /// `probes[].measured_calls` of `function`: the calls seen while it was attached.
    pub fn measured_calls(&self, function: &str) -> Result<u64> {
        self.probe_field(function, "measured_calls")?
            .as_u64()
            .with_context(|| format!("`measured_calls` of {function} is not a number"))
    }

    /// `probe_ns_per_hit`: what one probed call costs, as pgscope calibrated it.
    pub fn probe_ns_per_hit(&self) -> Result<f64> {
        self.json
            .get("probe_ns_per_hit")
            .and_then(Value::as_f64)
            .context("the summary has no number `probe_ns_per_hit`")
    }

    /// `frequency_hz`: the on-CPU sampling frequency.
    pub fn frequency_hz(&self) -> Result<u64> {
        self.json
            .get("frequency_hz")
            .and_then(Value::as_u64)
            .context("the summary has no number `frequency_hz`")
    }

    /// `probes[].extrapolated` of `function`: whether its counts are estimates.
    pub fn extrapolated(&self, function: &str) -> Result<bool> {
        self.probe_field(function, "extrapolated")?
            .as_bool()
            .with_context(|| format!("`extrapolated` of {function} is not a boolean"))
    }

    fn probe_field(&self, function: &str, key: &str) -> Result<&Value> {
        self.array("probes")?
            .iter()
            .find(|row| row.get("function").and_then(Value::as_str) == Some(function))
            .and_then(|row| row.get(key))
            .with_context(|| format!("no `{key}` of {function} in probes[]"))
    }

    /// `probe_hits_outside_trace[function]`: traps taken by processes the trace did not
    /// follow that map the probed file; `None` when the function was not probed.
    pub fn probe_hits_outside_trace(&self, function: &str) -> Result<Option<u64>> {
        let hits = self
            .json
            .get("probe_hits_outside_trace")
            .and_then(Value::as_object)
            .context("the summary has no object `probe_hits_outside_trace`")?;
        hits.get(function)
            .map(|n| {
                n.as_u64()
                    .with_context(|| format!("hits of {function} are not a number"))
            })
            .transpose()
    }

    /// Every `probes[]` row as (function, stats).
    pub fn probes(&self) -> Result<Vec<(String, CallStats)>> {
        self.array("probes")?
            .iter()
            .map(|row| Ok((string_field(row, "function")?, call_stats(row)?)))
            .collect()
    }

    /// Every `probes_by_query[]` row as (queryid, function, stats).
    pub fn probes_by_query(&self) -> Result<Vec<(String, String, CallStats)>> {
        self.array("probes_by_query")?
            .iter()
            .map(|row| {
                Ok((
                    string_field(row, "queryid")?,
                    string_field(row, "function")?,
                    call_stats(row)?,
                ))
            })
            .collect()
    }

    /// The `probes_by_query[]` row of (`queryid`, `function`); `None` when that query never
    /// called it during the trace.
    pub fn probe_of_query(&self, queryid: &str, function: &str) -> Result<Option<CallStats>> {
        Ok(self
            .probes_by_query()?
            .into_iter()
            .find(|(q, f, _)| q == queryid && f == function)
            .map(|(_, _, stats)| stats))
    }

    /// The `relation_locks[]` rows of `queryid`.
    pub fn relation_locks(&self, queryid: &str) -> Result<Vec<RelationLock>> {
        let mut locks = Vec::new();
        for row in self.array("relation_locks")? {
            if string_field(row, "queryid")? != queryid {
                continue;
            }
            let relid = u64_field(row, "relid")?;
            locks.push(RelationLock {
                relid: u32::try_from(relid).with_context(|| format!("relid {relid} is not an Oid"))?,
                lockmode: string_field(row, "lockmode")?,
                calls: u64_field(row, "calls")?,
            });
        }
        Ok(locks)
    }

    /// Every `spin_sites[]` row.
    pub fn spin_sites(&self) -> Result<Vec<SpinSite>> {
        self.array("spin_sites")?
            .iter()
            .map(|row| {
                let line = u64_field(row, "line")?;
                Ok(SpinSite {
                    queryid: string_field(row, "queryid")?,
                    file: string_field(row, "file")?,
                    line: u32::try_from(line).with_context(|| format!("line {line} out of range"))?,
                    function: string_field(row, "function")?,
                    calls: u64_field(row, "calls")?,
                    total_ns: u64_field(row, "total_ns")?,
                })
            })
            .collect()
    }

    /// `off_cpu.by_wait[]`; an error when off-CPU time was not measured.
    pub fn off_cpu_by_wait(&self) -> Result<Vec<OffCpuWait>> {
        by_wait_rows(self.off_cpu_array("by_wait")?)
    }

    /// `off_cpu_exact.by_wait[]`: the context-switch tracer's rows under `--off-cpu=both`; an
    /// error when it did not run.
    pub fn off_cpu_exact_by_wait(&self) -> Result<Vec<OffCpuWait>> {
        self.both_modes_by_wait("off_cpu_exact")
    }

    /// `off_cpu_exact_at_runs.by_wait[]`: where the context-switch tracer had each thread at
    /// the off-CPU sampler's runs, weighted like its samples, under `--off-cpu=both`; an error
    /// when it is not there.
    pub fn off_cpu_exact_at_runs_by_wait(&self) -> Result<Vec<OffCpuWait>> {
        self.both_modes_by_wait("off_cpu_exact_at_runs")
    }

    /// `<table>.by_wait[]` of a table only `--off-cpu=both` writes.
    fn both_modes_by_wait(&self, table: &str) -> Result<Vec<OffCpuWait>> {
        let rows = self
            .json
            .pointer(&format!("/{table}/by_wait"))
            .and_then(Value::as_array)
            .with_context(|| format!("the summary has no array `{table}.by_wait` (not --off-cpu=both?)"))?;
        by_wait_rows(rows)
    }

    /// `top_functions[].name`, in the summary's order (most samples first, by self time).
    pub fn top_function_names(&self) -> Result<Vec<String>> {
        let rows = self
            .json
            .get("top_functions")
            .and_then(Value::as_array)
            .context("the summary has no array `top_functions`")?;
        rows.iter()
            .map(|row| {
                row.get("name")
                    .and_then(Value::as_str)
                    .map(str::to_owned)
                    .with_context(|| format!("a `top_functions` row has no string `name`: {row}"))
            })
            .collect()
    }

    /// `off_cpu.mode` (`sampled` or `exact`) and `off_cpu_exact.mode` (`exact` under
    /// `--off-cpu=both`, else `None`).
    pub fn off_cpu_modes(&self) -> Result<(String, Option<String>)> {
        let mode = |key: &str| {
            self.json
                .pointer(&format!("/{key}/mode"))
                .and_then(Value::as_str)
                .map(str::to_owned)
        };
        let sampled = mode("off_cpu").context("the summary has no string `off_cpu.mode`")?;
        Ok((sampled, mode("off_cpu_exact")))
    }

    /// `duration_seconds`: how long the trace collected.
    pub fn duration_seconds(&self) -> Result<f64> {
        self.json
            .get("duration_seconds")
            .and_then(Value::as_f64)
            .context("the summary has no number `duration_seconds`")
    }

    /// What the off-CPU sampler's runs cost, as `wait_sampler` gives it: "N runs of X µs, Y% of
    /// a CPU"; None when it did not run.
    pub fn wait_sampler_cost(&self) -> Result<Option<String>> {
        let Some(sampler) = self.json.get("wait_sampler").filter(|v| !v.is_null()) else {
            return Ok(None);
        };
        let field = |name: &str| {
            sampler
                .get(name)
                .and_then(Value::as_f64)
                .with_context(|| format!("`wait_sampler.{name}` is not a number: {sampler}"))
        };
        Ok(Some(format!(
            "{} runs of {:.0} µs, {:.2}% of a CPU",
            field("runs")?,
            field("mean_run_us")?,
            field("cpu_pct")?
        )))
    }

    /// `samples.lost` as given: reason → count, only reasons that occurred.
    pub fn samples_lost_by_reason(&self) -> Result<BTreeMap<String, u64>> {
        let lost = self
            .json
            .pointer("/samples/lost")
            .and_then(Value::as_object)
            .context("the summary has no object `samples.lost`")?;
        lost.iter()
            .map(|(reason, n)| {
                let n = n
                    .as_u64()
                    .with_context(|| format!("`samples.lost.{reason}` is not a count: {n}"))?;
                Ok((reason.clone(), n))
            })
            .collect()
    }

    /// `wall_clock[]`: each statement's time split into CPU and its waits.
    pub fn wall_clock(&self) -> Result<Vec<StatementWall>> {
        self.array("wall_clock")?
            .iter()
            .map(|row| {
                let parts = row
                    .get("parts")
                    .and_then(Value::as_array)
                    .with_context(|| format!("no array `parts` in {row}"))?
                    .iter()
                    .map(|part| {
                        Ok(WallPart {
                            name: string_field(part, "name")?,
                            ns: u64_field(part, "ns")?,
                            pct: part
                                .get("pct")
                                .and_then(Value::as_f64)
                                .with_context(|| format!("no number `pct` in {part}"))?,
                        })
                    })
                    .collect::<Result<_>>()?;
                Ok(StatementWall {
                    queryid: string_field(row, "queryid")?,
                    total_ns: u64_field(row, "total_ns")?,
                    parts,
                })
            })
            .collect()
    }

    /// Every wait of every query in `off_cpu.by_query[]`.
    pub fn off_cpu_by_query(&self) -> Result<Vec<OffCpuQueryWait>> {
        let mut waits = Vec::new();
        for query in self.off_cpu_array("by_query")? {
            let queryid = string_field(query, "queryid")?;
            let rows = query
                .get("waits")
                .and_then(Value::as_array)
                .with_context(|| format!("no array `waits` in {query}"))?;
            for row in rows {
                waits.push(OffCpuQueryWait {
                    queryid: queryid.clone(),
                    wait_event: string_field(row, "wait_event")?,
                    off_cpu: string_field(row, "off_cpu")?,
                    ns: u64_field(row, "ns")?,
                    stack: string_field(row, "stack")?,
                });
            }
        }
        Ok(waits)
    }

    fn off_cpu_array(&self, key: &str) -> Result<&Vec<Value>> {
        self.json
            .pointer(&format!("/off_cpu/{key}"))
            .and_then(Value::as_array)
            .with_context(|| format!("the summary has no array `off_cpu.{key}` (off-CPU not measured?)"))
    }

    fn array(&self, key: &str) -> Result<&Vec<Value>> {
        self.json
            .get(key)
            .and_then(Value::as_array)
            .with_context(|| format!("the summary has no array `{key}`"))
    }
}

fn by_wait_rows(rows: &[Value]) -> Result<Vec<OffCpuWait>> {
    rows.iter()
        .map(|row| {
            Ok(OffCpuWait {
                backend_type: string_field(row, "backend_type")?,
                wait_event: string_field(row, "wait_event")?,
                off_cpu: string_field(row, "off_cpu")?,
                ns: u64_field(row, "ns")?,
            })
        })
        .collect()
}

fn call_stats(row: &Value) -> Result<CallStats> {
    let histogram_log2_ns = row
        .get("histogram_log2_ns")
        .and_then(Value::as_array)
        .with_context(|| format!("no array `histogram_log2_ns` in {row}"))?
        .iter()
        .map(|v| {
            v.as_u64()
                .with_context(|| format!("histogram bucket `{v}` is not a count"))
        })
        .collect::<Result<_>>()?;
    Ok(CallStats {
        calls: u64_field(row, "calls")?,
        total_ns: u64_field(row, "total_ns")?,
        total_ns_with_nested_traps: u64_field(row, "total_ns_with_nested_traps")?,
        max_ns: u64_field(row, "max_ns")?,
        histogram_log2_ns,
    })
}

fn u64_field(row: &Value, key: &str) -> Result<u64> {
    row.get(key)
        .and_then(Value::as_u64)
        .with_context(|| format!("no unsigned number `{key}` in {row}"))
}

fn string_field(row: &Value, key: &str) -> Result<String> {
    row.get(key)
        .and_then(Value::as_str)
        .map(str::to_owned)
        .with_context(|| format!("no string `{key}` in {row}"))
}
