//! Our profiles in Pyroscope's own UI, in a real browser (issue 22): the agent pushes a
//! pgbench run to a real Pyroscope built with its web UI (`scripts/pyroscope-server.sh`), and
//! headless Chromium opens the UI's flamegraph view with a `queryid` selector, as an operator
//! would from a slow statement's queryid. The page must show the flamegraph and, in its table,
//! a Postgres function that Pyroscope's own API puts among that statement's heaviest; then
//! Tag Explorer grouped by `queryid` must list the statement. The screenshot is kept in
//! `target/test-artifacts/pyroscope-ui.png` (the README's picture is one).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use serde_json::{json, Value};

use pgscope_tests::chromium;
use pgscope_tests::pyroscope_server::{now_ms, push_pgbench_run, PyroscopeServer};
use pgscope_tests::{require_root_and_bpf, wait_for, workspace_root, PgCluster, PgInstall};

const CPU: &str = "process_cpu:cpu:nanoseconds:cpu:nanoseconds";

/// Self time per function of a flamegraph answer (`levels` hold, per bar, the quadruple
/// offset, total, self, name index).
fn self_times(answer: &Value) -> BTreeMap<String, i64> {
    let names: Vec<&str> = answer["flamegraph"]["names"]
        .as_array()
        .map(|n| n.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let mut times = BTreeMap::new();
    for level in answer["flamegraph"]["levels"].as_array().into_iter().flatten() {
        let values: Vec<i64> = level["values"]
            .as_array()
            // Connect's JSON writes int64 as strings.
            .map(|v| {
                v.iter()
                    .filter_map(|x| x.as_i64().or_else(|| x.as_str()?.parse().ok()))
                    .collect()
            })
            .unwrap_or_default();
        for bar in values.chunks_exact(4) {
            if let Some(name) = usize::try_from(bar[3]).ok().and_then(|i| names.get(i)) {
                *times.entry(name.to_string()).or_insert(0) += bar[2];
            }
        }
    }
    times
}

/// Text of the page without its tags (table cells hold the function names).
fn page_text(dom: &str) -> String {
    let mut text = String::with_capacity(dom.len());
    let mut in_tag = false;
    for c in dom.chars() {
        match c {
            '<' => in_tag = true,
            '>' => {
                in_tag = false;
                text.push(' ');
            }
            _ if !in_tag => text.push(c),
            _ => {}
        }
    }
    text
}

#[test]
fn pyroscopes_ui_shows_a_statements_flamegraph_by_queryid() -> Result<()> {
    require_root_and_bpf();
    let pyroscope = PyroscopeServer::get()?;
    let install = PgInstall::no_frame_pointers()?;
    let debug_dir = install
        .debug_dir
        .clone()
        .context("the nofp build has debug files")?;
    let cluster = PgCluster::start_with_pg_stat_statements(&install, &[])?;
    cluster.pgbench(&["-i", "-s", "1", "-q"])?;
    let service = format!("pgscope-ui-{}-{}", std::process::id(), now_ms());
    let start = push_pgbench_run(&pyroscope, &cluster, &debug_dir, &service, "")?;
    let queryid = cluster.pgbench_select_queryid()?;
    let selector = format!("{{service_name=\"{service}\",queryid=\"{queryid}\"}}");

    // What Pyroscope's API says the statement's heaviest functions are.
    let heaviest = wait_for(
        "the statement's flamegraph in Pyroscope",
        Duration::from_secs(60),
        || {
            let answer = pyroscope.call(
            "SelectMergeStacktraces",
            json!({"profileTypeID": CPU, "labelSelector": selector, "start": start, "end": now_ms() + 1000}),
        )?;
            let mut times: Vec<(String, i64)> = self_times(&answer).into_iter().collect();
            times.sort_by_key(|(_, time)| -time);
            Ok((times.len() >= 10).then_some(times))
        },
    )?;

    let query = format!("{CPU}{selector}");
    let url = format!(
        "{}/?query={}&from=now-15m&until=now",
        pyroscope.url(),
        urlencode(&query)
    );
    let profile_dir = tempfile::tempdir()?;
    // The table beside the flamegraph lists functions by self time, one per cell; the heaviest
    // rows are in the DOM (it is virtualised: only visible rows are). The page is rendered again
    // until they are: on a busy machine the UI's queries may not have been answered within one
    // rendering's virtual time (seen beside two CPU hogs: a page without the table's rows).
    let mut dom = String::new();
    let rendered = wait_for(
        "Pyroscope's UI to show the statement's heaviest functions",
        Duration::from_secs(120),
        || {
            dom = String::from_utf8(
                chromium::headless(
                    &url,
                    profile_dir.path(),
                    15_000,
                    &["--window-size=1600,1000", "--dump-dom"],
                )?
                .stdout,
            )?;
            let shown: Vec<String> = heaviest
                .iter()
                .take(10)
                .map(|(name, _)| name.clone())
                .filter(|name| dom.contains(&format!(">{}<", escape(name))))
                .collect();
            Ok((!shown.is_empty()).then_some(shown))
        },
    );
    let text = page_text(&dom);
    ensure!(
        dom.contains("<canvas"),
        "no flamegraph canvas on the page (the UI did not render?):\n{}",
        &text[..text.len().min(2000)]
    );
    let shown = rendered.with_context(|| {
        format!(
            "the page's table never showed one of the statement's ten heaviest functions:\n{}",
            &text[..text.len().min(2000)]
        )
    })?;
    let postgres = postgres_functions(&debug_dir)?;
    let function = shown
        .iter()
        .find(|name| postgres.contains(name.as_str()))
        .with_context(|| {
            format!(
                "of the statement's ten heaviest functions ({:?}) the page shows {shown:?}, none a \
                 Postgres function",
                heaviest.iter().take(10).map(|(n, _)| n).collect::<Vec<_>>()
            )
        })?;

    let artifacts = workspace_root().join("target/test-artifacts");
    std::fs::create_dir_all(&artifacts)?;
    let screenshot = artifacts.join("pyroscope-ui.png");
    let _ = std::fs::remove_file(&screenshot);
    chromium::headless(
        &url,
        profile_dir.path(),
        15_000,
        &[
            &format!("--screenshot={}", screenshot.display()),
            "--window-size=1600,1000",
        ],
    )?;
    let bytes = chromium::check_screenshot(&screenshot)?;

    // Tag Explorer grouped by queryid: the statement has its row.
    let explore = format!(
        "{}/explore?query={}&groupBy=queryid&from=now-15m&until=now",
        pyroscope.url(),
        urlencode(&format!("{CPU}{{service_name=\"{service}\"}}"))
    );
    let explored = String::from_utf8(
        chromium::headless(
            &explore,
            profile_dir.path(),
            15_000,
            &["--window-size=1600,1000", "--dump-dom"],
        )?
        .stdout,
    )?;
    ensure!(
        page_text(&explored).contains(&queryid),
        "Tag Explorer grouped by queryid does not list the statement's queryid {queryid}"
    );
    eprintln!(
        "Pyroscope UI: flamegraph of queryid {queryid} shows {function} (on the page: {shown:?}); \
         Tag Explorer lists the queryid; screenshot {} ({bytes} bytes)",
        screenshot.display()
    );
    eprintln!("pyroscope-ui: flamegraph=ok function={function}");
    Ok(())
}

/// The functions the Postgres build defines (server and modules), from its debug files.
fn postgres_functions(debug_dir: &Path) -> Result<BTreeSet<String>> {
    let mut functions = BTreeSet::new();
    let output = Command::new("find")
        .arg(debug_dir)
        .args(["-name", "*.debug", "-type", "f"])
        .output()?;
    for file in String::from_utf8_lossy(&output.stdout).lines() {
        let symbols = Command::new("nm").args(["--defined-only", file]).output()?;
        ensure!(symbols.status.success(), "nm {file} failed");
        functions.extend(
            String::from_utf8_lossy(&symbols.stdout)
                .lines()
                .filter_map(|line| match line.split_whitespace().collect::<Vec<_>>()[..] {
                    [_, "T" | "t", name] => Some(name.to_string()),
                    _ => None,
                }),
        );
    }
    ensure!(
        functions.len() > 1000,
        "only {} functions in {}",
        functions.len(),
        debug_dir.display()
    );
    Ok(functions)
}

/// `name` as HTML text.
fn escape(name: &str) -> String {
    name.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// Percent-encodes a URL query value.
fn urlencode(value: &str) -> String {
    value
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' | b':' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}
