//! The report as one self-contained HTML page: findings first, then the on-CPU and off-CPU
//! flamegraphs, then a table per queryid and each query's CPU by plan node. No external resource: the page opens from a mail
//! attachment or a ticket as well as from disk.

use std::fmt::Write as _;
use std::time::{Duration, UNIX_EPOCH};

use anyhow::{Context, Result};
use exporters::{Profile, SvgOptions};

use super::queries::{query_rows, QueryRow};
use super::recording::Recording;
use crate::findings::Finding;
use crate::model::hot_paths::path_text;
use crate::model::{shorten, Analysis};
use crate::postgres::phase::Phase;

/// Inferno's flamegraph scripts look their elements up by id in their own document, so each
/// flamegraph gets a document of its own: an iframe whose `srcdoc` is the SVG. `srcdoc`
/// frames share the page's origin, which lets the page size each frame to its graph.
const SIZE_FRAMES: &str = r#"
window.addEventListener('load', () => {
  for (const frame of document.querySelectorAll('iframe.flamegraph')) {
    const doc = frame.contentDocument;
    const svg = doc && doc.querySelector('svg');
    if (!svg) continue;
    frame.style.height = Math.ceil(svg.getBoundingClientRect().height) + 8 + 'px';
    const frames = doc.querySelectorAll('#frames > g').length;
    frame.dataset.frames = frames;
    const caption = document.getElementById(frame.dataset.caption);
    if (caption) caption.textContent = frames + ' frames · click a frame to zoom, Ctrl-F to search';
  }
});
"#;

/// The head of each flamegraph's document.
const FRAME_HEAD: &str = "<!DOCTYPE html><meta charset=\"utf-8\">\
    <style>html, body { margin: 0 } svg { display: block; width: 100%; height: auto }</style>";

const STYLE: &str = r#"
body { font: 14px/1.45 system-ui, sans-serif; margin: 0 auto; max-width: 1260px; padding: 0 16px 48px; color: #1d1d1f; }
h1 { margin: 24px 0 4px; } h2 { margin-top: 36px; border-bottom: 1px solid #ddd; }
.meta { color: #555; margin: 0; } nav a { margin-right: 12px; }
.finding { border-left: 6px solid #888; background: #f7f7f7; padding: 8px 14px; margin: 12px 0; }
.finding.critical { border-color: #c62828; background: #fdecea; }
.finding.warning { border-color: #ef8f00; background: #fff4e0; }
.finding.info { border-color: #1e6fd9; background: #eef4fd; }
.finding h3 { margin: 4px 0 6px; font-size: 15px; }
.severity { text-transform: uppercase; font-size: 11px; letter-spacing: .05em; margin-right: 8px; }
.finding table { border-collapse: collapse; margin: 4px 0; }
.finding th { text-align: left; font-weight: normal; color: #555; padding-right: 16px; }
.action { font-weight: 600; }
iframe.flamegraph { width: 100%; height: 640px; border: 1px solid #ddd; }
.caption { color: #555; font-size: 12px; }
.wide { overflow-x: auto; }
table.queries { border-collapse: collapse; width: 100%; font-size: 13px; }
table.queries th, table.queries td { border-bottom: 1px solid #e4e4e4; padding: 4px 6px; vertical-align: top; text-align: right; }
table.queries th { background: #f2f2f2; position: sticky; top: 0; }
table.queries td.text, table.queries td.left { text-align: left; }
td.text { min-width: 260px; max-width: 420px; overflow-wrap: anywhere; font-family: ui-monospace, monospace; font-size: 12px; }
code { font-family: ui-monospace, monospace; font-size: 12px; }
"#;

/// The page for `recording`, its analysis and its findings.
pub fn render(recording: &Recording, analysis: &Analysis, findings: &[Finding]) -> Result<String> {
    let mut page = String::new();
    let title = format!("pgscope report: {}", recording.target);
    let _ = write!(
        page,
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n\
         <title>{}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n",
        escape(&title)
    );
    let _ = writeln!(
        page,
        "<header>\n<h1>pgscope report</h1>\n<p class=\"meta\">{}</p>\n\
         <nav><a href=\"#findings\">Findings</a><a href=\"#on-cpu\">On-CPU</a>\
         <a href=\"#off-cpu\">Off-CPU</a><a href=\"#queries\">Queries</a>\
         <a href=\"#plan-nodes\">Plan nodes</a></nav>\n</header>",
        escape(&overview(recording))
    );
    findings_section(&mut page, recording, findings);
    let on_cpu_subtitle = format!(
        "on-CPU · {} Hz · {:.0} s · {} samples",
        recording.frequency_hz,
        recording.duration_seconds,
        recording.on_cpu.total_count()
    );
    flamegraph_section(
        &mut page,
        "on-cpu",
        "On-CPU flamegraph",
        Some((&recording.on_cpu, on_cpu_subtitle)),
        &recording.target,
    )?;
    let off_cpu = recording
        .off_cpu
        .as_ref()
        .map(crate::collect::off_cpu::without_idle);
    let off_cpu_graph = off_cpu.as_ref().map(|profile| {
        let subtitle = format!(
            "off-CPU · widths are blocked time · {:.1} ms in {:.0} s · idle client waits left out",
            profile.total_count() as f64 / 1e6,
            recording.duration_seconds
        );
        (profile, subtitle)
    });
    flamegraph_section(
        &mut page,
        "off-cpu",
        "Off-CPU flamegraph",
        off_cpu_graph,
        &recording.target,
    )?;
    queries_section(&mut page, recording, analysis);
    super::plan_nodes::section(&mut page, &analysis.plan_nodes, |q| recording.query_text(q));
    let _ = write!(page, "<script>{SIZE_FRAMES}</script>\n</body>\n</html>\n");
    Ok(page)
}

/// `backend 1234 · PostgreSQL 15 · 2026-11-22T15:00:00Z · 30.0 s at 99 Hz · 2970 samples`.
fn overview(recording: &Recording) -> String {
    let mut parts = vec![recording.target.clone()];
    if let Some(major) = recording.postgres_major {
        parts.push(format!("PostgreSQL {major}"));
    }
    let start = UNIX_EPOCH + Duration::from_nanos(recording.on_cpu.meta.start_unix_nanos);
    parts.push(format!("started {}", humantime::format_rfc3339_seconds(start)));
    parts.push(format!(
        "{:.1} s at {} Hz",
        recording.duration_seconds, recording.frequency_hz
    ));
    parts.push(format!("{} on-CPU samples", recording.on_cpu.total_count()));
    if let Some(off_cpu) = &recording.off_cpu {
        parts.push(format!(
            "{:.1} ms off CPU (idle included)",
            off_cpu.total_count() as f64 / 1e6
        ));
    }
    parts.join(" · ")
}

fn findings_section(page: &mut String, recording: &Recording, findings: &[Finding]) {
    let _ = writeln!(
        page,
        "<section id=\"findings\">\n<h2>Findings ({})</h2>",
        findings.len()
    );
    if findings.is_empty() {
        page.push_str("<p>No finding: nothing measured stood out.</p>\n");
    }
    for finding in findings {
        let severity = finding.severity.name();
        let _ = writeln!(
            page,
            "<article class=\"finding {severity}\" data-kind=\"{}\">\n\
             <h3><span class=\"severity\">{severity}</span>{}</h3>",
            escape(finding.kind),
            escape(&finding.title)
        );
        if !finding.numbers.is_empty() {
            page.push_str("<table>");
            for (what, value) in &finding.numbers {
                let _ = write!(
                    page,
                    "<tr><th>{}</th><td>{}</td></tr>",
                    escape(what),
                    escape(value)
                );
            }
            page.push_str("</table>\n");
        }
        let figures = finding.cause.as_ref().map(|c| c.figures.as_slice());
        for (i, &query_id) in finding.query_ids.iter().enumerate() {
            let text = recording.query_text(query_id).unwrap_or("");
            let figure = figures
                .and_then(|f| f.get(i))
                .filter(|f| finding.query_ids.len() > 1 && !f.is_empty())
                .map(|f| format!(" ({})", escape(f)))
                .unwrap_or_default();
            let _ = writeln!(
                page,
                "<p>queryid <a href=\"#q{query_id}\"><code>{query_id}</code></a>{figure} <code>{}</code></p>",
                escape(&shorten(text, 160))
            );
        }
        if !finding.frames.is_empty() {
            let frames: Vec<String> = finding
                .frames
                .iter()
                .map(|f| format!("<code>{}</code>", escape(f)))
                .collect();
            let _ = writeln!(page, "<p>frames: {}</p>", frames.join(", "));
        }
        let _ = writeln!(
            page,
            "<p class=\"action\">→ {}</p>\n</article>",
            escape(&finding.action)
        );
    }
    page.push_str("</section>\n");
}

fn flamegraph_section(
    page: &mut String,
    id: &str,
    heading: &str,
    profile: Option<(&Profile, String)>,
    target: &str,
) -> Result<()> {
    let _ = writeln!(page, "<section id=\"{id}\">\n<h2>{heading}</h2>");
    let Some((profile, subtitle)) = profile else {
        page.push_str(
            "<p>Not measured (the trace ran without --off-cpu, or the kernel refused it).</p>\n</section>\n",
        );
        return Ok(());
    };
    let mut svg = Vec::new();
    let options = SvgOptions {
        title: format!("pgscope: {target}"),
        subtitle: Some(subtitle),
        root_labels: Vec::new(),
    };
    exporters::write_svg(profile, &options, &mut svg)
        .with_context(|| format!("cannot draw the {heading}"))?;
    let svg = String::from_utf8_lossy(&svg);
    // The frame's document is HTML: without the XML prolog (whose doctype would put it in
    // quirks mode), and with the graph as wide as the frame, as it is in a window of its own.
    let graph = svg.find("<svg").map_or(&*svg, |at| &svg[at..]);
    let document = format!("{FRAME_HEAD}{graph}");
    let _ = writeln!(
        page,
        "<p class=\"caption\" id=\"{id}-caption\"></p>\n\
         <iframe class=\"flamegraph\" title=\"{heading}\" data-caption=\"{id}-caption\" srcdoc=\"{}\"></iframe>\n</section>",
        escape(&document)
    );
    Ok(())
}

fn queries_section(page: &mut String, recording: &Recording, analysis: &Analysis) {
    let rows = query_rows(recording, analysis);
    let _ = writeln!(
        page,
        "<section id=\"queries\">\n<h2>Queries ({})</h2>\n\
         <p class=\"caption\">Phases in % of the query's on-CPU samples; off-CPU time without idle \
         client waits; where its time went: its time on and off CPU (the client's left out), split \
         into CPU and each wait; probe counts are estimates where the probes were duty-cycled.</p>",
        rows.len()
    );
    if rows.is_empty() {
        page.push_str("<p>No sample carried a queryid.</p>\n</section>\n");
        return;
    }
    page.push_str(
        "<div class=\"wide\"><table class=\"queries\">\n<tr><th>queryid</th><th>query</th><th>on-CPU samples</th><th>share</th>",
    );
    for phase in Phase::ALL {
        let _ = write!(page, "<th>{}</th>", phase.label());
    }
    page.push_str("<th>other</th><th>hottest function</th><th>hot paths</th><th>off-CPU ms</th><th>longest wait</th><th>where its time went</th><th>probes</th></tr>\n");
    let total = recording.on_cpu.total_count().max(1) as f64;
    for row in &rows {
        query_row(page, row, total);
    }
    page.push_str("</table></div>\n</section>\n");
}

fn query_row(page: &mut String, row: &QueryRow, total: f64) {
    let samples = row.cpu.as_ref().map_or(0, |q| q.samples);
    let _ = write!(
        page,
        "<tr id=\"q{id}\"><td><code>{id}</code></td><td class=\"text\">{}</td><td>{samples}</td><td>{:.1}%</td>",
        escape(&shorten(row.text.as_deref().unwrap_or(""), 240)),
        100.0 * samples as f64 / total,
        id = row.query_id,
    );
    let of_query = |n: u64| {
        if samples == 0 {
            String::new()
        } else {
            format!("{:.0}", 100.0 * n as f64 / samples as f64)
        }
    };
    for index in 0..Phase::ALL.len() {
        let n = row.cpu.as_ref().map_or(0, |q| q.by_phase[index]);
        let _ = write!(page, "<td>{}</td>", of_query(n));
    }
    let other = row.cpu.as_ref().map_or(0, |q| q.other());
    let hottest = row
        .cpu
        .as_ref()
        .and_then(|q| q.hottest_function.as_deref())
        .unwrap_or("");
    // Its hot paths, as the printed summary shows them (each with its share of the query's
    // samples), at most three.
    let hot_paths: String = row
        .cpu
        .as_ref()
        .map(|q| {
            q.hot_paths
                .iter()
                .take(3)
                .map(|path| {
                    format!(
                        "{}% <code>{}</code><br>",
                        of_query(path.count),
                        escape(&path_text(path, q.samples))
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    let _ = write!(
        page,
        "<td>{}</td><td class=\"left\"><code>{}</code></td><td class=\"left\">{hot_paths}</td><td>{:.1}</td><td class=\"left\">{}</td><td class=\"left\">{}</td><td class=\"left\">",
        of_query(other),
        escape(hottest),
        row.off_cpu_ns as f64 / 1e6,
        escape(row.longest_wait.as_deref().unwrap_or("")),
        escape(row.time_split.as_deref().unwrap_or(""))
    );
    for probe in &row.probes {
        let average_us = probe.total_ns as f64 / probe.calls.max(1) as f64 / 1e3;
        let _ = write!(
            page,
            "<code>{}</code> {} calls, {average_us:.1} µs avg<br>",
            escape(probe.function.name()),
            probe.calls
        );
    }
    page.push_str("</td></tr>\n");
}

/// Text for HTML content and double-quoted attribute values.
pub(super) fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markup_in_query_texts_and_frames_is_escaped() {
        assert_eq!(
            escape(r#"<script>"a" & 'b'</script>"#),
            "&lt;script&gt;&quot;a&quot; &amp; &#39;b&#39;&lt;/script&gt;"
        );
    }

    /// A recording of one hash join whose node functions the symbolizer named.
    fn hash_join_recording() -> Recording {
        use crate::model::fixtures::{profile, sample};
        let stack = ["PortalRun", "ExecHashJoin", "ExecScanHashBucket"];
        Recording {
            schema: super::super::recording::SCHEMA.into(),
            target: "backend 1".into(),
            postgres_major: Some(15),
            frequency_hz: 99,
            duration_seconds: 1.0,
            on_cpu: profile(vec![
                sample(7, "run", &stack, 30),
                sample(7, "run", &["PortalRun", "ExecHashJoin", "ExecSeqScan"], 10),
                sample(7, "plan", &["PortalStart", "standard_planner"], 10),
            ]),
            off_cpu: None,
            probes: Vec::new(),
            pgss: None,
            instance: None,
            blockers: None,
            spin_sites: Vec::new(),
            query_texts: [("7".to_string(), "SELECT <join>".to_string())].into(),
            plan_node_functions: [("ExecHashJoin", "HashJoin"), ("ExecSeqScan", "SeqScan")]
                .into_iter()
                .map(|(f, n)| (f.into(), n.into()))
                .collect(),
        }
    }

    #[test]
    fn the_page_shows_each_statements_cpu_by_plan_node_from_the_model() {
        let recording = hash_join_recording();
        let page = recording
            .with_analysis(|analysis| render(&recording, analysis, &[]))
            .expect("page");
        let section = page
            .split("<section id=\"plan-nodes\">")
            .nth(1)
            .expect("a plan-node section");
        let row = section.split("<tr id=\"n7\">").nth(1).expect("the join's row");
        assert!(row.contains("<code>HashJoin</code> 60.0%"), "{row}");
        assert!(row.contains("<code>SeqScan</code> 20.0%"), "{row}");
        assert!(row.contains("SELECT &lt;join&gt;"), "{row}");
        assert!(page.contains("<a href=\"#plan-nodes\">"), "nav links the section");
    }

    #[test]
    fn a_recording_without_node_functions_shows_no_plan_nodes() {
        let mut recording = hash_join_recording();
        recording.plan_node_functions.clear();
        let page = recording
            .with_analysis(|analysis| render(&recording, analysis, &[]))
            .expect("page");
        assert!(page.contains("CPU by plan node (0)") && !page.contains("id=\"n7\""));
    }

    #[test]
    fn each_querys_row_says_where_its_time_went_on_and_off_cpu() {
        use crate::model::fixtures::{labelled, off_cpu};
        let mut recording = hash_join_recording();
        let period = recording.on_cpu.meta.period;
        let lock = [
            ("off_cpu", "latch"),
            ("queryid", "7"),
            ("wait_event", "Lock:transactionid"),
        ];
        recording.off_cpu = Some(off_cpu(vec![labelled(&["ProcSleep"], &lock, 50 * period)]));
        let page = recording
            .with_analysis(|analysis| render(&recording, analysis, &[]))
            .expect("page");
        let row = page.split("<tr id=\"q7\">").nth(1).expect("the query's row");
        assert!(
            row.contains("<td class=\"left\">CPU 50% · Lock:transactionid 50%</td>"),
            "{row}"
        );
    }

    #[test]
    fn long_texts_are_cut_and_flattened() {
        assert_eq!(shorten("SELECT  1\n FROM t", 100), "SELECT 1 FROM t");
        assert_eq!(shorten("abcdef", 3), "abc…");
    }
}
