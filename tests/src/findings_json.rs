//! The `findings[]` of a `pgscope trace --json` summary, read back: what the pathology suite
//! asserts on (rule, severity, statements, figures) rather than the console's wording.

use std::path::Path;

use anyhow::{Context, Result};
use serde_json::Value;

use crate::pgscope::{Trace, TraceOutput};

/// One finding of the JSON summary.
#[derive(Debug, Clone)]
pub struct JsonFinding {
    /// The rule's stable name (`pgss_evictions`, `spin_site`, …).
    pub kind: String,
    /// `info`, `warning` or `critical`.
    pub severity: String,
    pub title: String,
    /// The statements it covers.
    pub queryids: Vec<String>,
    /// Its supporting figures, as (what, value).
    pub numbers: Vec<(String, String)>,
    /// The functions it names.
    pub functions: Vec<String>,
}

impl JsonFinding {
    /// Warning or critical: what a DBA is asked to act on.
    pub fn is_alarm(&self) -> bool {
        matches!(self.severity.as_str(), "warning" | "critical")
    }

    /// The value of the first figure whose description starts with `what`.
    pub fn number(&self, what: &str) -> Option<&str> {
        self.numbers
            .iter()
            .find(|(w, _)| w.starts_with(what))
            .map(|(_, v)| v.as_str())
    }

    /// The leading number of [`Self::number`]'s value (`5783 (723.0/s)` → 5783, `12.5%` → 12.5).
    pub fn leading_number(&self, what: &str) -> Result<f64> {
        let value = self
            .number(what)
            .with_context(|| format!("finding `{}` has no figure `{what}…`: {self:#?}", self.kind))?;
        let head: String = value
            .chars()
            .take_while(|c| c.is_ascii_digit() || *c == '.')
            .collect();
        head.parse().with_context(|| {
            format!(
                "figure `{what}` of finding `{}` is `{value}`, not a number",
                self.kind
            )
        })
    }

    /// Whether its title or functions name `function`.
    pub fn names_function(&self, function: &str) -> bool {
        self.title.contains(function) || self.functions.iter().any(|f| f.contains(function))
    }
}

/// `findings[]` of the summary at `path`.
pub fn read_findings(path: &Path) -> Result<Vec<JsonFinding>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read `{}`", path.display()))?;
    let summary: Value =
        serde_json::from_str(&text).with_context(|| format!("`{}` is not JSON", path.display()))?;
    let findings = summary["findings"]
        .as_array()
        .with_context(|| format!("no findings[] in `{}`", path.display()))?;
    findings.iter().map(parse).collect()
}

fn parse(finding: &Value) -> Result<JsonFinding> {
    let text = |field: &str| -> Result<String> {
        finding[field]
            .as_str()
            .map(str::to_owned)
            .with_context(|| format!("finding without a string `{field}`: {finding}"))
    };
    let strings = |field: &str| -> Result<Vec<String>> {
        finding[field]
            .as_array()
            .with_context(|| format!("finding without a list `{field}`: {finding}"))?
            .iter()
            .map(|v| {
                v.as_str()
                    .map(str::to_owned)
                    .with_context(|| format!("`{field}` holds `{v}`, not a string"))
            })
            .collect()
    };
    let numbers = finding["numbers"]
        .as_array()
        .with_context(|| format!("finding without numbers[]: {finding}"))?
        .iter()
        .map(|n| {
            let what = n["what"]
                .as_str()
                .with_context(|| format!("number without `what`: {n}"))?;
            let value = n["value"]
                .as_str()
                .with_context(|| format!("number without `value`: {n}"))?;
            Ok((what.to_owned(), value.to_owned()))
        })
        .collect::<Result<_>>()?;
    Ok(JsonFinding {
        kind: text("kind")?,
        severity: text("severity")?,
        title: text("title")?,
        queryids: strings("queryids")?,
        numbers,
        functions: strings("functions")?,
    })
}

/// What a trace run around a workload gave: its output, its findings and what the workload
/// measured meanwhile.
pub struct TracedWorkload<T> {
    pub output: TraceOutput,
    pub findings: Vec<JsonFinding>,
    pub measured: T,
}

/// Runs `trace` (with `--json` into a temporary file) while `workload` runs, then ends it.
pub fn findings_while<T>(trace: Trace, workload: impl FnOnce() -> Result<T>) -> Result<TracedWorkload<T>> {
    let dir = tempfile::tempdir().context("cannot create a directory for the summary")?;
    let json = dir.path().join("summary.json");
    let running = trace.duration_secs(600).json(&json).spawn()?;
    let measured = workload()?;
    let output = running.interrupt()?;
    Ok(TracedWorkload {
        output,
        findings: read_findings(&json)?,
        measured,
    })
}

/// One line per finding, for the test's log: severity, kind, statements and figures.
pub fn describe_findings(findings: &[JsonFinding]) -> String {
    findings
        .iter()
        .map(|f| {
            format!(
                "[{}] {} {:?}: {}\n    {:?}",
                f.severity, f.kind, f.queryids, f.title, f.numbers
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}
