//! `pgscope report`: one self-contained HTML page from a trace — findings first, then the
//! on-CPU and off-CPU flamegraphs, a table per queryid and each query's CPU by plan node.
//! Written at the end of a trace (`pgscope trace --report FILE`) or later from a saved
//! recording (`pgscope trace --record FILE`, then `pgscope report --from FILE`); both go
//! through [`write`], so they are the same page.

mod html;
mod plan_nodes;
mod queries;
pub mod recording;

use std::path::Path;

use anyhow::{Context, Result};

use crate::findings::Finding;
use crate::model::Analysis;
use crate::output_file::{self, OutputMode, Planned};
pub use recording::{RecordedProbe, Recording};

/// Writes the report of `recording`, its `analysis` and `findings`, to `out`.
pub fn write(
    recording: &Recording,
    analysis: &Analysis,
    findings: &[Finding],
    out: &Path,
    mode: OutputMode,
) -> Result<()> {
    let page = html::render(recording, analysis, findings)?;
    output_file::write(out, mode, page.as_bytes())
        .with_context(|| format!("cannot write the report to `{}`", out.display()))
}

/// `pgscope report --from RECORDING --out FILE`: the findings printed, the page written.
pub fn run(from: &Path, out: &Path, mode: OutputMode) -> Result<()> {
    output_file::check_all(&[Planned::new("--out", out)])?;
    let recording = Recording::load(from)?;
    recording.with_analysis(|analysis| {
        let findings = crate::findings::evaluate(analysis);
        out!("{} · {:.1} s", recording.target, recording.duration_seconds);
        if findings.is_empty() {
            out!("findings: none");
        } else {
            out!("findings:");
            let rendered = crate::findings::render(&findings, |q| recording.query_text(q));
            out!("{}", rendered.trim_end_matches('\n'));
        }
        write(&recording, analysis, &findings, out, mode)
    })?;
    out!("wrote the report to {}", out.display());
    Ok(())
}
