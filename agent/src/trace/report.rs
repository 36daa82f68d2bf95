//! The end of a trace: the summary, the top functions, and the requested output files.

use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result};
use exporters::{FoldedOptions, Profile, ProfileMeta, SvgOptions};
use symbolizer::KernelSymbols;

use super::{Session, TraceOptions};
use crate::bpf::abi::Counter;
use crate::bpf::{Counters, WaitSamplerTally};
use crate::collect::off_cpu::OffCpuMode;
use crate::model::{
    shorten, Analysis, Measurements, PgssEvidence, ProbeRow, QueryId, SpinSiteRow, StatementCpu, WaitTables,
};
use crate::output_file::{self, OutputMode};
use crate::postgres::attribution::LabelNames;
use crate::report::{RecordedProbe, Recording};
use crate::target::Target;

/// What a trace measured besides its samples, read before the probes were detached.
pub(super) struct Measured {
    pub counters: Counters,
    pub probe_results: super::probes::ProbeResults,
    pub kernel: Option<KernelSymbols>,
    pub start_unix_nanos: u64,
    pub elapsed: Duration,
    /// Query texts and database names, when the instance could be reached.
    pub sql_facts: super::sql_facts::SqlFacts,
    /// pg_stat_statements' counters when the trace started.
    pub pgss_start: Option<crate::postgres::sql::PgssInfo>,
    /// The sessions that held others' locks while the samples were taken.
    pub blockers: Option<crate::postgres::blockers::BlockerEvidence>,
}

pub(super) fn finish(
    options: &TraceOptions,
    target: &Target,
    mut session: Session,
    measured: Measured,
) -> Result<()> {
    let Measured {
        counters,
        probe_results,
        kernel,
        start_unix_nanos,
        elapsed,
        sql_facts,
        pgss_start,
        blockers,
    } = measured;
    let super::sql_facts::SqlFacts {
        query_texts,
        database_names,
        trigger_names,
        pgss_end,
        instance,
    } = sql_facts;
    let names = LabelNames {
        databases: &database_names,
        triggers: &trigger_names,
    };
    let meta = ProfileMeta::cpu(options.frequency_hz, start_unix_nanos, elapsed.as_nanos() as u64);
    let profile = session.profile(false, kernel.as_ref(), meta, names);
    let stats = session.on_cpu().map(|stacks| stacks.stats()).unwrap_or_default();
    let root_labels = match target {
        Target::Backend(_) => Vec::new(),
        Target::Instance { .. } => vec![crate::model::labels::PID.to_string()],
    };

    out!(
        "{} · {:.1} s · {} samples · user stacks complete {:.1}%",
        target.describe(),
        elapsed.as_secs_f64(),
        stats.samples,
        stats.complete_pct()
    );
    print_losses(&counters, &session);
    if let Some(line) = sampler_cost_line(&session.wait_sampler, elapsed.as_nanos() as u64) {
        out!("{line}");
    }
    print_missing_symbols(&session);
    let off_cpu_profile = session.off_cpu_measured().then(|| {
        let meta = ProfileMeta::off_cpu(start_unix_nanos, elapsed.as_nanos() as u64);
        session.profile(true, kernel.as_ref(), meta, names)
    });
    // `--off-cpu=both`: the tracer's waits, to set beside the sampled ones.
    let session_off_cpu = session.off_cpu;
    let exact_waits = (session.off_cpu == OffCpuMode::Both).then(|| {
        let meta = ProfileMeta::off_cpu(start_unix_nanos, elapsed.as_nanos() as u64);
        WaitTables::from_profile(&session.exact_off_cpu_profile(kernel.as_ref(), meta, names))
    });
    let exact_at_runs_waits = (session.off_cpu == OffCpuMode::Both).then(|| {
        let meta = ProfileMeta::off_cpu(start_unix_nanos, elapsed.as_nanos() as u64);
        WaitTables::from_profile(&session.exact_at_runs_off_cpu_profile(kernel.as_ref(), meta, names))
    });
    let probe_rows: Vec<ProbeRow> = probe_results
        .by_query()
        .into_iter()
        .map(|((query_id, call), figures)| ProbeRow {
            query_id: QueryId(query_id),
            function: call.function,
            calls: figures.stats.calls,
            // The function's own time: the findings' shares must not count nested traps.
            total_ns: figures.total_ns,
            detail: call.detail,
        })
        .collect();
    let pgss = pgss_start.zip(pgss_end).map(|(start, end)| PgssEvidence {
        evictions: end.dealloc - start.dealloc,
        max: end.max,
        seconds: elapsed.as_secs_f64(),
    });
    let spin_sites: Vec<SpinSiteRow> = probe_results
        .spin_sites
        .iter()
        .map(|site| SpinSiteRow {
            query_id: QueryId(site.query_id),
            file: site.file.clone(),
            line: site.line,
            function: site.function.clone(),
            calls: site.stats.calls,
            total_ns: site.stats.total_ns,
        })
        .collect();
    let plan_node_functions = session.symbolizer.plan_node_functions();
    let analysis = Analysis::new(Measurements {
        on_cpu: &profile,
        off_cpu: off_cpu_profile.as_ref(),
        probes: &probe_rows,
        spin_sites: &spin_sites,
        pgss,
        instance: instance.as_ref(),
        blockers: blockers.as_ref(),
        postgres_major: session.postgres_major(),
    })
    .with_plan_nodes(&plan_node_functions);
    let total = analysis.cpu_samples();
    let shares = exporters::top_functions(&profile, options.top);
    let queries = &analysis.statements;
    if total == 0 && session.filtered_out > 0 {
        out!("no samples of that queryid: every sample taken was of another query (--queryid)");
    } else if total == 0 {
        out!("no samples: the target was idle (off CPU) for the whole trace");
    } else {
        out!("{}", exporters::render_top_table(&shares, total));
        out!("by module (self: the sample's leaf is in it; total: any frame of the stack is):");
        out!(
            "{}",
            super::hot_paths::render_modules(&exporters::module_totals(&profile), options.top)
        );
        if !queries.is_empty() {
            out!("by query (phases in % of the query's samples):");
            out!("{}", super::queries::render(queries, total, options.top));
            print_query_texts(queries, &query_texts, options.top);
            let hot_paths = super::hot_paths::render_statements(queries, total, options.top);
            if !hot_paths.is_empty() {
                out!(
                    "hot paths of each query (% of its samples under the path's last frame, down to \
                     where they spread out; the frames every sample runs under left out):"
                );
                out!("{}", hot_paths.trim_end_matches('\n'));
            }
            let traps = analysis.probe_trap_samples();
            if traps > 0 {
                out!(
                    "note: {traps} samples ({:.1}%) were taken inside pgscope's own probe traps: left out \
                     of the queries' figures and the findings",
                    100.0 * traps as f64 / total as f64
                );
            }
            if !analysis.walls.is_empty() {
                out!(
                    "where each query's time went (on CPU and off CPU, samples of one weight; the client's time left out):"
                );
                out!("{}", super::wall_clock::render(&analysis.walls, options.top));
            }
            if !analysis.plan_nodes.is_empty() {
                out!("by plan node (innermost executor node on the stack, % of the query's samples):");
                out!("{}", super::plan_nodes::render(&analysis.plan_nodes, options.top));
            }
            if queries.iter().all(|q| !q.query_id.is_statement()) {
                out!(
                    "note: every queryid is 0: queryids are not computed; set compute_query_id = on \
                     (or load pg_stat_statements, which turns `auto` on)"
                );
            }
        }
    }
    if !probe_results.attached.is_empty() {
        out!(
            "function probes (\"attached\": share of the trace; \"est.\": counts scaled up from \
             it; \"measured\": calls seen while attached, what an estimate rests on):"
        );
        out!(
            "{}",
            super::probes::render(&probe_results, elapsed.as_secs_f64(), options.top)
        );
    }
    if let Some(waits) = &analysis.waits {
        out!(
            "{}",
            super::off_cpu::render(
                waits,
                match session_off_cpu {
                    OffCpuMode::Exact => super::off_cpu::Measured::Exact {
                        min_stack: options.off_cpu_min_stack,
                    },
                    _ => super::off_cpu::Measured::Sampled {
                        frequency_hz: options.frequency_hz,
                    },
                },
                options.top,
                options.off_cpu_idle,
            )
        );
    }
    // What the off-CPU files show: idle client waits only on request.
    let off_cpu_output = off_cpu_profile.as_ref().map(|profile| {
        if options.off_cpu_idle {
            profile.clone()
        } else {
            crate::collect::off_cpu::without_idle(profile)
        }
    });
    if let Some(facts) = &instance {
        let counters = super::stat_views::render(&facts.database_deltas, &facts.io_deltas);
        if !counters.is_empty() {
            out!("Postgres' own counters over the trace (pgscope's few reads included):");
            out!("{}", counters.trim_end_matches('\n'));
        }
    }
    let findings = crate::findings::evaluate(&analysis);
    if !findings.is_empty() {
        out!("findings:");
        let rendered = crate::findings::render(&findings, |q| query_texts.get(&q.0).map(String::as_str));
        out!("{}", rendered.trim_end_matches('\n'));
    }
    // Each file is attempted even when one before it failed: nothing else is lost with it.
    let mut writes = Writes::default();
    let mode = options.output_mode;
    if options.record.is_some() || options.report.is_some() {
        let recording = Recording {
            schema: crate::report::recording::SCHEMA.to_string(),
            target: target.describe(),
            postgres_major: session.postgres_major(),
            frequency_hz: options.frequency_hz,
            duration_seconds: elapsed.as_secs_f64(),
            on_cpu: profile.clone(),
            off_cpu: off_cpu_profile.clone(),
            probes: probe_rows.iter().map(RecordedProbe::new).collect(),
            pgss,
            instance: instance.clone(),
            blockers: blockers.clone(),
            spin_sites: spin_sites.clone(),
            query_texts: query_texts
                .iter()
                .map(|(id, text)| (id.to_string(), text.clone()))
                .collect(),
            plan_node_functions: plan_node_functions.clone(),
        };
        if let Some(path) = &options.record {
            writes.attempt(path, recording.save(path, mode), || {
                out!(
                    "wrote the recording to {} (pgscope report --from it)",
                    path.display()
                )
            });
        }
        if let Some(path) = &options.report {
            let written = crate::report::write(&recording, &analysis, &findings, path, mode);
            writes.attempt(path, written, || out!("wrote the report to {}", path.display()));
        }
    }
    if session.filtered_out > 0 || session.filtered_out_waits > 0 {
        out!(
            "{} samples of other queries left out (--queryid), and {} off-CPU records",
            session.filtered_out,
            session.filtered_out_waits
        );
    }

    if let Some(path) = &options.folded {
        let written = output_file::write_with(path, mode, |w| {
            exporters::write_folded(
                &profile,
                &FoldedOptions {
                    root_labels: root_labels.clone(),
                },
                w,
            )
        });
        writes.attempt(path, written, || {
            out!("wrote folded stacks to {}", path.display())
        });
        if let Some(off_cpu) = &off_cpu_output {
            let path = super::off_cpu::beside(path);
            let written = output_file::write_with(&path, mode, |w| {
                exporters::write_folded(
                    off_cpu,
                    &FoldedOptions {
                        root_labels: root_labels.clone(),
                    },
                    w,
                )
            });
            writes.attempt(&path, written, || {
                out!("wrote off-CPU folded stacks (nanoseconds) to {}", path.display())
            });
        }
    }
    if let Some(path) = &options.svg {
        let svg_options = SvgOptions {
            title: format!("pgscope: {}", target.describe()),
            subtitle: Some(format!(
                "on-CPU · {} Hz · {:.0} s · {} samples",
                options.frequency_hz,
                elapsed.as_secs_f64(),
                total
            )),
            root_labels: root_labels.clone(),
        };
        let written =
            output_file::write_with(path, mode, |w| exporters::write_svg(&profile, &svg_options, w));
        writes.attempt(path, written, || out!("wrote flamegraph to {}", path.display()));
        if let Some(off_cpu) = &off_cpu_output {
            let path = super::off_cpu::beside(path);
            let total_ns: u64 = off_cpu.samples.iter().map(|s| s.count).sum();
            let svg_options = SvgOptions {
                title: format!("pgscope: {} (off-CPU)", target.describe()),
                subtitle: Some(format!(
                    "off-CPU · widths are blocked time · {:.1} ms in {:.0} s{}",
                    total_ns as f64 / 1e6,
                    elapsed.as_secs_f64(),
                    if options.off_cpu_idle {
                        ""
                    } else {
                        " · idle client waits left out"
                    }
                )),
                root_labels: root_labels.clone(),
            };
            let written =
                output_file::write_with(&path, mode, |w| exporters::write_svg(off_cpu, &svg_options, w));
            writes.attempt(&path, written, || {
                out!("wrote off-CPU flamegraph to {}", path.display())
            });
        }
    }
    if let Some(path) = &options.json {
        let summary = super::json::build(&super::json::SummaryInputs {
            target,
            postgres_major: session.postgres_major(),
            frequency_hz: options.frequency_hz,
            duration_seconds: elapsed.as_secs_f64(),
            counters: &counters,
            stats: &stats,
            filtered_out: session.filtered_out,
            profile: &profile,
            functions: &shares,
            functions_by_total: &exporters::top_functions_by_total(&profile, options.top),
            queries,
            plan_nodes: &analysis.plan_nodes,
            probes: &probe_results,
            query_texts: &query_texts,
            off_cpu: analysis.waits.as_ref().map(|waits| {
                (
                    waits,
                    session_off_cpu,
                    options.off_cpu_min_stack.as_nanos() as u64,
                )
            }),
            off_cpu_exact: exact_waits.as_ref(),
            off_cpu_exact_at_runs: exact_at_runs_waits.as_ref(),
            wait_sampler: &session.wait_sampler,
            walls: &analysis.walls,
            blockers: blockers.as_ref(),
            pgss_deltas: instance.as_ref().map(|facts| &facts.pgss_deltas_by_query),
            stat_views: instance
                .as_ref()
                .map(|facts| (&facts.database_deltas, &facts.io_deltas)),
            findings: &findings,
        });
        let written = output_file::write_with(path, mode, |w| serde_json::to_writer_pretty(w, &summary));
        writes.attempt(path, written, || {
            out!("wrote the JSON summary to {}", path.display())
        });
    }
    if let Some(path) = &options.pprof {
        writes.attempt(path, write_pprof(path, mode, &profile), || {
            out!("wrote pprof profile to {}", path.display())
        });
        if let Some(off_cpu) = &off_cpu_output {
            let path = super::off_cpu::beside(path);
            writes.attempt(&path, write_pprof(&path, mode, off_cpu), || {
                out!("wrote off-CPU pprof profile (nanoseconds) to {}", path.display())
            });
        }
    }
    writes.finish()
}

/// The output files of a trace: each one is attempted, a failure is said at once, and the
/// trace fails at the end if any was not written.
#[derive(Default)]
struct Writes {
    failed: Vec<String>,
}

impl Writes {
    fn attempt(&mut self, path: &Path, result: Result<()>, wrote: impl FnOnce()) {
        match result {
            Ok(()) => wrote(),
            Err(error) => {
                note!("pgscope: {error:#}");
                self.failed.push(path.display().to_string());
            }
        }
    }

    fn finish(self) -> Result<()> {
        if self.failed.is_empty() {
            return Ok(());
        }
        anyhow::bail!(
            "not written: {} (the errors are above; every other output was written)",
            self.failed.join(", ")
        )
    }
}

/// The normalized text of each query in the table, one line each, cut to fit a terminal.
fn print_query_texts(queries: &[StatementCpu], texts: &HashMap<i64, String>, limit: usize) {
    let named: Vec<_> = queries
        .iter()
        .take(limit)
        .filter_map(|q| texts.get(&q.query_id.0).map(|t| (q.query_id, t)))
        .collect();
    if named.is_empty() {
        return;
    }
    out!("query texts (pg_stat_statements, normalized):");
    for (query_id, text) in named {
        out!("{query_id:>21}  {}", shorten(text, 100));
    }
    out!();
}

fn print_losses(counters: &Counters, session: &Session) {
    for line in loss_lines(
        counters,
        session.malformed,
        session.orphan_repeats,
        session.wait_sampler.unsampled_ns,
    ) {
        out!("{line}");
    }
}

/// What the off-CPU sampler's runs cost: each takes its CPU from the backend there (one
/// holding a lock makes the others wait as long). None when it did not run.
fn sampler_cost_line(tally: &WaitSamplerTally, elapsed_ns: u64) -> Option<String> {
    (tally.runs > 0).then(|| {
        format!(
            "off-CPU sampler: {} runs of {:.0} µs on average, {:.2}% of a CPU at real-time priority",
            tally.runs,
            tally.mean_run_us(),
            tally.cpu_pct(elapsed_ns)
        )
    })
}

/// What was lost, and apart from it what was kept with part of its stack missing (its time is
/// counted: under a partial stack, or the placeholder frame of waits without a stack), each
/// against what it is a part of. One line each, when there is anything to say.
fn loss_lines(
    counters: &Counters,
    malformed: u64,
    orphan_repeats: u64,
    unsampled_off_cpu_ns: u64,
) -> Vec<String> {
    let named = |pairs: Vec<(Counter, u64)>| -> Vec<String> {
        pairs
            .into_iter()
            .map(|(counter, n)| format!("{} {n}", counter.name()))
            .collect()
    };
    let mut lost = named(counters.losses());
    if malformed > 0 {
        lost.push(format!("malformed {malformed}"));
    }
    // Repeats of a wait sample that never arrived: each one a tick of off-CPU time lost.
    if orphan_repeats > 0 {
        lost.push(format!("off_cpu_repeats_without_sample {orphan_repeats}"));
    }
    if unsampled_off_cpu_ns > 0 {
        lost.push(format!(
            "off_cpu_ms_unsampled {:.1} (the sampler's thread was held up)",
            unsampled_off_cpu_ns as f64 / 1e6
        ));
    }
    let on_cpu = counters.get(Counter::Samples);
    let off_cpu = counters.off_cpu_stack_seekers();
    let mut lines = Vec::new();
    if !lost.is_empty() {
        lines.push(format!(
            "sample losses: {} (of {on_cpu} on-CPU samples taken in the kernel)",
            lost.join(", ")
        ));
    }
    let degraded = named(counters.degradations());
    if !degraded.is_empty() {
        lines.push(format!(
            "kept with part of their stack missing, their time counted: {} (of {on_cpu} on-CPU \
             samples and {off_cpu} off-CPU samples that sought a stack)",
            degraded.join(", ")
        ));
    }
    let late = named(counters.late_stacks());
    if !late.is_empty() {
        lines.push(format!(
            "off-CPU stacks copied after the thread ran, back in the same wait of the same \
             statement: {}",
            late.join(", ")
        ));
    }
    lines
}

/// Names the sampled files that have neither a symbol table nor a debug file, once: their static
/// functions are shown as `file+0x…`, and the user can fix that.
fn print_missing_symbols(session: &Session) {
    let mut stripped: Vec<String> = session
        .on_cpu()
        .map(|stacks| stacks.modules())
        .unwrap_or_default()
        .iter()
        .filter_map(|module| session.symbolizer.module_info(module))
        .filter(|info| !info.has_symtab && info.debug_file.is_none())
        // [vdso] and friends are named from their own dynamic symbols; nothing to install.
        .filter(|info| !info.path.to_string_lossy().starts_with('['))
        .map(|info| info.path.display().to_string())
        .collect();
    if stripped.is_empty() {
        return;
    }
    stripped.sort();
    stripped.dedup();
    out!(
        "note: no symbol table or debug file for {}: their static functions are shown as \
         `file+0x<start>`; install the debug packages (e.g. postgresql-15-dbgsym) or pass \
         --debug-dir with a .build-id tree to name them",
        stripped.join(", ")
    );
}

fn write_pprof(path: &Path, mode: OutputMode, profile: &Profile) -> Result<()> {
    let bytes = exporters::encode_pprof_gzip(profile).context("encoding the pprof profile")?;
    output_file::write(path, mode, &bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sampler_cost_line_gives_mean_run_and_cpu_share() {
        let tally = WaitSamplerTally {
            runs: 5946,
            run_ns: 5946 * 87_000,
            unsampled_ns: 0,
        };
        assert_eq!(
            sampler_cost_line(&tally, 60_000_000_000).as_deref(),
            Some("off-CPU sampler: 5946 runs of 87 µs on average, 0.86% of a CPU at real-time priority")
        );
        assert_eq!(
            sampler_cost_line(&WaitSamplerTally::default(), 60_000_000_000),
            None
        );
    }

    #[test]
    fn waits_left_without_a_stack_are_not_called_losses() {
        let counters = Counters::with(&[
            (Counter::Samples, 1290),
            (Counter::WaitSamples, 1107),
            (Counter::WaitRanBeforeStack, 457),
        ]);
        assert_eq!(
            loss_lines(&counters, 0, 0, 0),
            ["kept with part of their stack missing, their time counted: \
              wait_sample_ran_before_stack 457 (of 1290 on-CPU samples and 1564 off-CPU samples \
              that sought a stack)"]
        );
    }

    #[test]
    fn stacks_copied_after_a_run_are_said_apart_from_the_ones_missing() {
        let counters = Counters::with(&[
            (Counter::Samples, 33),
            (Counter::WaitSamples, 925),
            (Counter::WaitRanBeforeStack, 5),
            (Counter::WaitStackAfterRun, 2),
        ]);
        assert_eq!(
            loss_lines(&counters, 0, 0, 0),
            [
                "kept with part of their stack missing, their time counted: \
                 wait_sample_ran_before_stack 5 (of 33 on-CPU samples and 930 off-CPU samples \
                 that sought a stack)",
                "off-CPU stacks copied after the thread ran, back in the same wait of the same \
                 statement: wait_sample_stack_after_run 2",
            ]
        );
    }

    #[test]
    fn losses_and_degradations_get_a_line_each() {
        let counters = Counters::with(&[
            (Counter::Samples, 100),
            (Counter::RingbufFull, 3),
            (Counter::UserStackFault, 2),
        ]);
        let lines = loss_lines(&counters, 1, 0, 2_500_000);
        assert_eq!(
            lines,
            [
                "sample losses: lost_ringbuf_full 3, malformed 1, off_cpu_ms_unsampled 2.5 (the \
                 sampler's thread was held up) (of 100 on-CPU samples taken in the kernel)",
                "kept with part of their stack missing, their time counted: user_stack_partial 2 \
                 (of 100 on-CPU samples and 0 off-CPU samples that sought a stack)",
            ]
        );
    }

    #[test]
    fn nothing_lost_nothing_said() {
        assert!(loss_lines(&Counters::with(&[(Counter::Samples, 10)]), 0, 0, 0).is_empty());
    }
}
