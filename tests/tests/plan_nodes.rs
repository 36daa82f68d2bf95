//! The executor's per-node functions named on the stripped distro build, and each statement's
//! CPU by plan node type. The distro `postgres` has no symbol for `ExecHashJoin`, `ExecSort`,
//! `ExecAgg`, …; pgscope names them from the exported `ExecInit*` functions that install them.
//! A backend runs a hash join under an aggregate under a sort in a loop while traced: its
//! stacks must name the node functions, no `postgres+0x…` frame may be one of them (found here
//! independently with `objdump`), and the plan node types the `--json` summary reports for the
//! statement must be exactly those its EXPLAIN shows, each heavy one with samples, and the HTML
//! report's plan-node table must show the same heavy node types for it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;

use anyhow::{ensure, Context, Result};
use object::{Object, ObjectSymbol};
use pgscope_tests::install::UPSTREAM_MAJORS;
use pgscope_tests::plan_json::{explain_node_types, plan_node_samples};
use pgscope_tests::{require_root_and_bpf, PgCluster, PgInstall, Profile, Trace};
use symbolizer::fuzzing::exec_node_names;

/// Rows of the probe side; the build side has a tenth of them, the aggregate one group per
/// build row, so the join, the aggregation and the sort each take a visible share.
const ROWS: u64 = 300_000;
/// Executions of the statement while traced.
const EXECUTIONS: u64 = 25;

const QUERY: &str = "SELECT b.t, count(*), sum(a.v) FROM plan_a a JOIN plan_b b ON a.k = b.k \
                     GROUP BY b.t ORDER BY sum(a.v) DESC, b.t";

/// Plan node types that must have samples: the ones doing the statement's work.
const HEAVY: &[&str] = &["SeqScan", "HashJoin", "Agg", "Sort"];

#[test]
fn stacks_name_the_node_functions_and_cpu_splits_by_plan_node() -> Result<()> {
    require_root_and_bpf();
    let install = PgInstall::distro()?;
    let named = node_functions_by_objdump(&install.bin("postgres"))?;
    ensure!(
        ["ExecHashJoin", "ExecSort", "ExecAgg", "ExecSeqScan", "SeqNext"]
            .iter()
            .all(|f| named.values().any(|n| n == f)),
        "objdump found too few node functions: {named:x?}"
    );
    // One backend, no parallel workers: its own stacks hold every node of the plan.
    let cluster = PgCluster::start_with_pg_stat_statements(
        &install,
        &[("max_parallel_workers_per_gather", "0"), ("jit", "off")],
    )?;
    cluster.psql(&format!(
        "CREATE TABLE plan_a AS SELECT g AS v, g % {build} AS k FROM generate_series(1, {ROWS}) g; \
         CREATE TABLE plan_b AS SELECT g AS k, md5(g::text) AS t FROM generate_series(0, {build}) g; \
         ANALYZE plan_a; ANALYZE plan_b",
        build = ROWS / 10
    ))?;
    let mut connection = cluster.connect()?;
    let plan = connection.query(&format!("EXPLAIN (FORMAT JSON) {QUERY}"))?;
    let explained = explain_node_types(&plan)?;
    eprintln!("EXPLAIN: {explained:?}");
    for heavy in HEAVY {
        ensure!(explained.contains(*heavy), "the plan has no {heavy}:\n{plan}");
    }

    let dir = tempfile::tempdir()?;
    let (json, folded, report) = (
        dir.path().join("summary.json"),
        dir.path().join("stacks.folded"),
        dir.path().join("report.html"),
    );
    let trace = Trace::pid(connection.pid())
        .duration_secs(600)
        .frequency(499)
        .json(&json)
        .folded(&folded)
        .report(&report)
        .spawn()?;
    for _ in 0..EXECUTIONS {
        connection.query(QUERY)?;
    }
    let output = trace.interrupt()?;
    let queryid = connection
        .query("SELECT queryid FROM pg_stat_statements WHERE query LIKE 'SELECT b.t, count(*)%plan_a%'")?;
    ensure!(!queryid.is_empty(), "the statement is not in pg_stat_statements");

    let profile = Profile::read_folded(&folded)?;
    let frames: BTreeSet<&str> = profile
        .stacks
        .iter()
        .flat_map(|s| s.frames.iter().map(String::as_str))
        .collect();
    // `ExecSeqScan` tail-calls `ExecScan`: its own frame is seldom on a stack, its access
    // method `SeqNext` is under every scan.
    for function in ["ExecHashJoin", "ExecSort", "ExecAgg", "SeqNext"] {
        ensure!(frames.contains(function), "no frame names {function}");
    }
    let unnamed: Vec<&str> = frames
        .iter()
        .copied()
        .filter(|frame| {
            frame
                .strip_prefix("postgres+0x")
                .and_then(|hex| u64::from_str_radix(hex, 16).ok())
                .is_some_and(|addr| named.contains_key(&addr))
        })
        .collect();
    ensure!(unnamed.is_empty(), "node functions left unnamed: {unnamed:?}");

    let by_node = plan_node_samples(&json, &queryid)?;
    eprintln!("pgscope, queryid {queryid}: {by_node:?}");
    let reported: BTreeSet<&str> = by_node.keys().map(String::as_str).collect();
    let expected: BTreeSet<&str> = explained.iter().map(String::as_str).collect();
    ensure!(
        reported.is_subset(&expected),
        "pgscope reports node types EXPLAIN does not show: {:?}",
        reported.difference(&expected).collect::<Vec<_>>()
    );
    for heavy in HEAVY {
        ensure!(
            by_node.get(*heavy).is_some_and(|&n| n > 0),
            "no samples for {heavy}: {by_node:?}"
        );
    }
    ensure!(
        output
            .stdout
            .contains("by plan node (innermost executor node on the stack"),
        "the summary has no plan node section:\n{}",
        output.stdout
    );
    let in_report = report_plan_nodes(&report, &queryid)?;
    eprintln!("report, queryid {queryid}: {in_report:?}");
    for heavy in HEAVY {
        ensure!(
            in_report.contains(*heavy),
            "the report's plan-node row of queryid {queryid} lacks {heavy}: {in_report:?}"
        );
    }
    Ok(())
}

/// Rows of the filtered scan's table; the filter keeps one in a thousand.
const FILTERED_ROWS: u64 = 1_000_000;
const FILTERED_QUERY: &str = "SELECT count(*) FROM plan_filtered WHERE (v * 7919) % 1000 = 3";
/// The least share of the filtered scan's samples its SeqScan node must get (issue 35's bar):
/// evaluating the filter is the scan's work.
const MIN_SEQSCAN_PCT: f64 = 90.0;

/// A sequential scan with a filter spends its time evaluating the filter in `ExecScan`, where
/// neither the scan's own function (a tail call) nor its access method (`SeqNext`, done with the
/// tuple by then) is on the stack: that time is the SeqScan's all the same. The evaluator,
/// `ExecInterpExpr`, is named on the stripped build.
#[test]
fn a_filtered_scans_qual_counts_for_its_scan_node() -> Result<()> {
    require_root_and_bpf();
    let cluster = PgCluster::start_with_pg_stat_statements(
        &PgInstall::distro()?,
        &[("max_parallel_workers_per_gather", "0"), ("jit", "off")],
    )?;
    cluster.psql(&format!(
        "CREATE TABLE plan_filtered AS SELECT g::bigint AS v FROM generate_series(1, {FILTERED_ROWS}) g; \
         ANALYZE plan_filtered"
    ))?;
    let mut connection = cluster.connect()?;
    let dir = tempfile::tempdir()?;
    let json = dir.path().join("summary.json");
    let trace = Trace::pid(connection.pid())
        .duration_secs(600)
        .frequency(499)
        .json(&json)
        .spawn()?;
    for _ in 0..EXECUTIONS {
        connection.query(FILTERED_QUERY)?;
    }
    trace.interrupt()?;
    let queryid = connection.query(
        "SELECT queryid FROM pg_stat_statements WHERE query LIKE 'SELECT count(*) FROM plan_filtered%'",
    )?;
    ensure!(!queryid.is_empty(), "the statement is not in pg_stat_statements");
    let summary = pgscope_tests::TraceSummary::read(&json)?;
    let samples: u64 = summary.phases_of_query(&queryid)?.values().sum();
    let by_node = plan_node_samples(&json, &queryid)?;
    let seq_scan = by_node.get("SeqScan").copied().unwrap_or(0);
    let pct = 100.0 * seq_scan as f64 / samples.max(1) as f64;
    eprintln!("filtered scan {queryid}: {samples} samples, by node {by_node:?}: SeqScan {pct:.1}%");
    ensure!(
        pct >= MIN_SEQSCAN_PCT,
        "the filtered scan's SeqScan node has {pct:.1}% of its {samples} samples (at least \
         {MIN_SEQSCAN_PCT}%): {by_node:?}"
    );
    // The filter is evaluated by the expression interpreter, a static function of the stripped
    // build: named, not `postgres+0x<start>`.
    let functions = summary.top_function_names()?;
    ensure!(
        functions.iter().any(|name| name == "ExecInterpExpr"),
        "the filtered scan's top functions do not name ExecInterpExpr: {functions:?}"
    );
    Ok(())
}

/// The node types the HTML report's plan-node table lists for `queryid`: the `<code>` names
/// of its row (`<tr id="n{queryid}">`) other than the queryid itself.
fn report_plan_nodes(path: &Path, queryid: &str) -> Result<BTreeSet<String>> {
    let page = std::fs::read_to_string(path)?;
    let section = page
        .split("<section id=\"plan-nodes\">")
        .nth(1)
        .and_then(|rest| rest.split("</section>").next())
        .context("the report has no plan-node section")?;
    let row = section
        .split(&format!("<tr id=\"n{queryid}\">"))
        .nth(1)
        .and_then(|rest| rest.split("</tr>").next())
        .with_context(|| {
            format!("the report's plan-node table has no row for queryid {queryid}:\n{section}")
        })?;
    Ok(row
        .split("<code>")
        .skip(1)
        .filter_map(|cell| cell.split("</code>").next())
        .filter(|name| *name != queryid)
        .map(str::to_string)
        .collect())
}

/// Fewest node functions a major's stripped build must get names for: each has 40 or so
/// `ExecInit<Node>` installing one function each.
const MIN_NAMED_PER_MAJOR: usize = 30;

/// The upstream builds have `.symtab`: stripped of it, the names pgscope derives from their
/// machine code must be the ones their symbol table gives at the same addresses, in every
/// major (13 to 18; 18 installs one of several `ExecSeqScan*` per case, which stays unnamed),
/// the expression interpreter `ExecInterpExpr` among them.
#[test]
fn names_derived_from_stripped_upstream_builds_match_their_symbols() -> Result<()> {
    for &(major, _) in UPSTREAM_MAJORS {
        let install = PgInstall::upstream(major)?;
        let postgres = install.bin("postgres");
        let dir = tempfile::tempdir()?;
        let stripped = dir.path().join("postgres");
        let status = Command::new("objcopy")
            .arg("--strip-all")
            .arg(&postgres)
            .arg(&stripped)
            .status()
            .context("objcopy is needed (binutils)")?;
        ensure!(
            status.success(),
            "objcopy --strip-all {} failed",
            postgres.display()
        );
        let derived = exec_node_names(stripped.clone(), std::fs::read(&stripped)?)?;
        let bytes = std::fs::read(&postgres)?;
        let file = object::File::parse(&*bytes)?;
        let mut truth: BTreeMap<u64, Vec<&str>> = BTreeMap::new();
        for symbol in file.symbols() {
            if let Ok(name) = symbol.name() {
                truth.entry(symbol.address()).or_default().push(name);
            }
        }
        let wrong: Vec<String> = derived
            .iter()
            .filter(|(addr, name)| {
                !truth
                    .get(addr)
                    .is_some_and(|names| names.contains(&name.as_str()))
            })
            .map(|(addr, name)| format!("{name} at {addr:#x} is {:?}", truth.get(addr)))
            .collect();
        eprintln!(
            "{major}: {} node functions named in the stripped copy",
            derived.len()
        );
        ensure!(wrong.is_empty(), "{major}: wrong names: {wrong:?}");
        // The expression interpreter, named from `ExecReadyInterpretedExpr` (checked against
        // the symbol table with the rest, above).
        ensure!(
            derived.iter().any(|(_, name)| name == "ExecInterpExpr"),
            "{major}: ExecInterpExpr not named in the stripped copy"
        );
        ensure!(
            derived.len() >= MIN_NAMED_PER_MAJOR,
            "{major}: only {} named: {derived:?}",
            derived.len()
        );
    }
    Ok(())
}

/// The functions each exported `ExecInit<Node>` of `postgres` stores into
/// `PlanState.ExecProcNode` (offset 0x18): `lea X(%rip),%reg` then `mov %reg,0x18(%base)`, read
/// from `objdump`'s disassembly, independently of pgscope's decoder. Only the `ExecInit*` that
/// store one single function; `ExecInitNode` (the dispatcher) is left out.
fn node_functions_by_objdump(postgres: &Path) -> Result<BTreeMap<u64, String>> {
    let symbols = Command::new("nm")
        .args(["-D", "--defined-only", "-S"])
        .arg(postgres)
        .output()
        .context("nm is needed (binutils)")?;
    let mut named = BTreeMap::new();
    for line in String::from_utf8_lossy(&symbols.stdout).lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let [addr, size, _, name] = fields.as_slice() else {
            continue;
        };
        let Some(node) = name.strip_prefix("ExecInit") else {
            continue;
        };
        if node == "Node" {
            continue;
        }
        let (start, size) = (u64::from_str_radix(addr, 16)?, u64::from_str_radix(size, 16)?);
        let disassembly = Command::new("objdump")
            .args(["-d", "--no-show-raw-insn"])
            .arg(format!("--start-address={start:#x}"))
            .arg(format!("--stop-address={:#x}", start + size))
            .arg(postgres)
            .output()
            .context("objdump is needed (binutils)")?;
        let stored = stores_at_exec_proc_node(&String::from_utf8_lossy(&disassembly.stdout));
        if let [target] = stored.iter().collect::<Vec<_>>().as_slice() {
            named.insert(**target, format!("Exec{node}"));
        }
    }
    // `ExecSeqScan` is `return ExecScan(&node->ss, SeqNext, SeqRecheck)`: SeqNext is the
    // `lea …(%rip),%rsi` before the jump to ExecScan.
    let seq_scan = named
        .iter()
        .find(|(_, name)| *name == "ExecSeqScan")
        .map(|(addr, _)| *addr)
        .context("no ExecSeqScan")?;
    let disassembly = Command::new("objdump")
        .args(["-d", "--no-show-raw-insn"])
        .arg(format!("--start-address={seq_scan:#x}"))
        .arg(format!("--stop-address={:#x}", seq_scan + 0x20))
        .arg(postgres)
        .output()?;
    let text = String::from_utf8_lossy(&disassembly.stdout);
    let seq_next = text
        .lines()
        .take_while(|line| !line.contains("<ExecScan@@Base>"))
        .filter(|line| line.contains("(%rip),%rsi"))
        .filter_map(|line| line.split('#').nth(1)?.split_whitespace().next())
        .filter_map(|hex| u64::from_str_radix(hex, 16).ok())
        .last()
        .with_context(|| format!("no access method passed to ExecScan:\n{text}"))?;
    named.insert(seq_next, "SeqNext".to_string());
    Ok(named)
}

/// Targets of `lea X(%rip),%reg` later stored by `mov %reg,0x18(%base)` in AT&T disassembly.
fn stores_at_exec_proc_node(disassembly: &str) -> BTreeSet<u64> {
    let mut loaded: BTreeMap<String, u64> = BTreeMap::new();
    let mut stored = BTreeSet::new();
    for line in disassembly.lines() {
        // `  3347ac:\tlea    -0x123(%rip),%rax        # 334690 <…>`
        let Some((_, instruction)) = line.split_once('\t') else {
            continue;
        };
        let Some((mnemonic, operands)) = instruction.trim().split_once(char::is_whitespace) else {
            continue;
        };
        let operands = operands.trim();
        if mnemonic == "lea" && operands.contains("(%rip)") {
            let register = operands
                .split(',')
                .nth(1)
                .map(|r| r.split_whitespace().next().unwrap_or(""));
            let target = operands
                .split('#')
                .nth(1)
                .and_then(|t| t.split_whitespace().next())
                .and_then(|t| u64::from_str_radix(t, 16).ok());
            if let (Some(register), Some(target)) = (register, target) {
                loaded.insert(register.to_string(), target);
            }
        } else if mnemonic == "mov" {
            if let Some((source, destination)) = operands.split_once(',') {
                if destination.starts_with("0x18(%") {
                    if let Some(&target) = loaded.get(source) {
                        stored.insert(target);
                    }
                }
            }
        }
    }
    stored
}
