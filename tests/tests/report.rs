//! The HTML report in a real browser. A trace of a generic plan over a partitioned table (a
//! warning finding, probes, on-CPU and off-CPU time) writes the report and a recording; the
//! report written later from the recording must be the same page; headless Chromium loads it,
//! the findings, both flamegraphs and the plan-node table must be in what it rendered, and its
//! screenshot is kept in `target/test-artifacts/report.png`.

use std::path::Path;
use std::process::Output;

use anyhow::{ensure, Context, Result};
use pgscope_tests::{
    chromium, require_root_and_bpf, run_pgscope, workspace_root, PgCluster, PgInstall, Trace,
};

const PARTITIONS: u32 = 32;

/// Headless Chromium on the report at `page`; five seconds of virtual time, so that the
/// page's load handler has run when it dumps.
fn headless(page: &Path, profile_dir: &Path, args: &[&str]) -> Result<Output> {
    chromium::headless(&format!("file://{}", page.display()), profile_dir, 5000, args)
}

/// The `data-frames` count the page's script set on the flamegraph frame titled `title`.
fn rendered_frames(dom: &str, title: &str) -> Result<u64> {
    let tag_start = dom
        .find(&format!("title=\"{title}\""))
        .and_then(|at| dom[..at].rfind("<iframe"))
        .with_context(|| format!("no `{title}` frame in the rendered page"))?;
    let tag = &dom[tag_start..];
    let tag = &tag[..tag.find('>').unwrap_or(tag.len())];
    tag.split("data-frames=\"")
        .nth(1)
        .and_then(|rest| rest.split('"').next())
        .and_then(|n| n.parse().ok())
        .with_context(|| format!("the `{title}` frame has no data-frames: its SVG did not render ({tag})"))
}

#[test]
fn the_report_renders_findings_and_both_flamegraphs_in_chromium() -> Result<()> {
    require_root_and_bpf();
    let browser = chromium::chromium()?;
    let cluster = PgCluster::start_with_pg_stat_statements(&PgInstall::distro()?, &[])?;
    cluster.pgbench(&["-i", "-q", "-s", "1", &format!("--partitions={PARTITIONS}")])?;
    cluster.psql("ALTER SYSTEM SET plan_cache_mode = 'force_generic_plan'")?;
    cluster.psql("SELECT pg_reload_conf()")?;

    let dir = tempfile::tempdir()?;
    let (page, recording, again) = (
        dir.path().join("report.html"),
        dir.path().join("trace.json"),
        dir.path().join("again.html"),
    );
    let trace = Trace::instance(cluster.data_dir())
        .probes("GetCachedPlan,LockRelationOid")
        .probe_budget("none")
        .off_cpu()
        .record(&recording)
        .report(&page)
        .duration_secs(600)
        .spawn()?;
    cluster.pgbench(&["-n", "-S", "-M", "prepared", "-c", "2", "-j", "2", "-T", "4"])?;
    let output = trace.interrupt()?;
    ensure!(output.stdout.contains("wrote the report to"), "{}", output.stdout);
    let queryid = cluster
        .psql("SELECT queryid FROM pg_stat_statements WHERE toplevel AND query LIKE 'SELECT abalance%'")?
        .trim()
        .to_string();
    ensure!(!queryid.is_empty(), "no pg_stat_statements entry for the select");

    let later = run_pgscope([
        "report".as_ref(),
        "--from".as_ref(),
        recording.as_os_str(),
        "--out".as_ref(),
        again.as_os_str(),
    ])?;
    ensure!(
        later.status.success(),
        "pgscope report failed: {}",
        String::from_utf8_lossy(&later.stderr)
    );
    ensure!(
        std::fs::read(&page)? == std::fs::read(&again)?,
        "the report written from the recording differs from the trace's own"
    );

    let profile_dir = dir.path().join("chromium");
    let dom = String::from_utf8(headless(&page, &profile_dir, &["--dump-dom"])?.stdout)?;
    // The samples' `generic_plan_locking` or, where it did not fire, the probes'
    // `generic_plan_locks`: one finding for the cause (findings/causes.rs).
    ensure!(
        dom.contains("data-kind=\"generic_plan_lock") && dom.contains(&format!("<code>{queryid}</code>")),
        "the generic plan's locking finding for queryid {queryid} is not in the rendered page"
    );
    let findings_at = dom.find("id=\"findings\"").context("no findings section")?;
    let flamegraph_at = dom.find("<iframe").context("no flamegraph")?;
    ensure!(findings_at < flamegraph_at, "findings must come first");
    ensure!(
        dom.contains(&format!("id=\"q{queryid}\"")),
        "the select has no row in the queries table"
    );
    // The plan-node table is checked in depth on a hash join (plan_nodes.rs); here, that the
    // browser renders it, after the queries table.
    let plan_nodes_at = dom.find("id=\"plan-nodes\"").context("no plan-node section")?;
    ensure!(
        plan_nodes_at > dom.find("id=\"queries\"").context("no queries section")?,
        "the plan-node section must follow the queries table"
    );
    eprintln!(
        "plan-node row of the select: {}",
        dom.contains(&format!("id=\"n{queryid}\""))
    );
    let on_cpu = rendered_frames(&dom, "On-CPU flamegraph")?;
    let off_cpu = rendered_frames(&dom, "Off-CPU flamegraph")?;
    eprintln!("rendered flamegraph frames: on-CPU {on_cpu}, off-CPU {off_cpu}");
    ensure!(
        on_cpu >= 10 && off_cpu >= 3,
        "flamegraphs rendered too few frames: on-CPU {on_cpu}, off-CPU {off_cpu}"
    );

    let artifacts = workspace_root().join("target/test-artifacts");
    std::fs::create_dir_all(&artifacts)?;
    let screenshot = artifacts.join("report.png");
    let _ = std::fs::remove_file(&screenshot);
    headless(
        &page,
        &profile_dir,
        &[
            &format!("--screenshot={}", screenshot.display()),
            "--window-size=1400,3200",
        ],
    )?;
    chromium::check_screenshot(&screenshot)?;
    std::fs::copy(&page, artifacts.join("report.html"))?;
    eprintln!(
        "report rendered by {}; screenshot: {}",
        browser.display(),
        screenshot.display()
    );
    Ok(())
}

#[test]
fn a_file_that_is_not_a_recording_is_refused_with_what_to_do() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let summary = dir.path().join("summary.json");
    std::fs::write(&summary, r#"{"schema":"pgscope.trace.summary/v1"}"#)?;
    let out = dir.path().join("report.html");
    let output = run_pgscope([
        "report".as_ref(),
        "--from".as_ref(),
        summary.as_os_str(),
        "--out".as_ref(),
        out.as_os_str(),
    ])?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    ensure!(
        !output.status.success() && stderr.contains("--record"),
        "a --json summary given as a recording must fail and say to use --record: {stderr}"
    );
    ensure!(!out.exists(), "no page may be written from a bad recording");
    Ok(())
}
