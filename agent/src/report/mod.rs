//! `pgscope report`: one self-contained HTML page from a trace — findings first, then the
//! on-CPU and off-CPU flamegraphs and a table per queryid. Written at the end of a trace
//! (`pgscope trace --report FILE`) or later from a saved recording (`pgscope trace --record
//! FILE`, then `pgscope report --from FILE`); both go through [`write`], so they are the same
//! page.

mod html;
mod queries;
pub mod recording;

use std::path::Path;

use anyhow::{Context, Result};

use crate::findings::Finding;
pub use recording::{RecordedProbe, Recording};

/// Writes the report of `recording` with its `findings` to `out`.
pub fn write(recording: &Recording, findings: &[Finding], out: &Path) -> Result<()> {
    let page = html::render(recording, findings)?;
    std::fs::write(out, page).with_context(|| format!("cannot write the report to `{}`", out.display()))
}

/// `pgscope report --from RECORDING --out FILE`: the findings printed, the page written.
pub fn run(from: &Path, out: &Path) -> Result<()> {
    let recording = Recording::load(from)?;
    let findings = recording.findings();
    println!("{} · {:.1} s", recording.target, recording.duration_seconds);
    if findings.is_empty() {
        println!("findings: none");
    } else {
        println!("findings:");
        print!("{}", crate::findings::render(&findings));
    }
    write(&recording, &findings, out)?;
    println!("wrote the report to {}", out.display());
    Ok(())
}
