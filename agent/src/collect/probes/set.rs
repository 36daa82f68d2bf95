//! The probed functions of a trace: found with the symbolizer, attached, and switched on and off
//! by the shared duty cycle under `--probe-budget`. Counts of duty-cycled probes are scaled by
//! the statements the instance ran while they were attached (see `statement_clock`).

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use symbolizer::{FindFunctionError, FunctionLocation, Symbolizer};
use tracing::warn;

use super::duty::{plan_shared_duty, DutyCycle};
use super::statement_clock::{CounterLayout, StatementClock};
use super::{ExplicitProbe, Extrapolation};
use crate::bpf::abi::{Function, ProbeArgs, FUNCTION_IDS};
use crate::bpf::{FunctionLinks, OnCpuProbes};
use crate::postgres::{pgss_hooks, VersionTable};

/// The file a function lives in: pg_stat_statements' functions in its library, the others in
/// the postgres executable.
fn module_of(function: Function, executable: &str) -> String {
    match function {
        Function::PgssStore => "pg_stat_statements.so".to_string(),
        _ => executable.to_string(),
    }
}

/// What to do when a function cannot be found in an instance of major `major`, in one sentence.
fn explain(function: Function, major: u32, error: &FindFunctionError) -> String {
    match (function, error) {
        (Function::PgssStore, FindFunctionError::ModuleNotMapped { .. }) => {
            "pg_stat_statements is not loaded in this instance (add it to shared_preload_libraries)".into()
        }
        (Function::PgssStore, FindFunctionError::NoSymbol { path, .. }) => format!(
            "pgss_store is a static function of `{}`, which is stripped, and no debug file was found: \
             install the debug package (postgresql-{major}-dbgsym from the debian-debug archive) or \
             pass --debug-dir with a .build-id tree that holds it",
            path.display()
        ),
        (_, error) => error.to_string(),
    }
}

/// A location given with `--probe`: the file must exist, hold the offset, and be mapped by the
/// traced process (a uprobe on a file it does not map would never fire).
fn explicit_location(explicit: &ExplicitProbe, pid: u32) -> Result<FunctionLocation, String> {
    let path = &explicit.path;
    let size = std::fs::metadata(path)
        .map_err(|error| format!("--probe names `{}`: {error}", path.display()))?
        .len();
    if explicit.file_offset >= size {
        return Err(format!(
            "--probe offset {:#x} is beyond the end of `{}` ({size} bytes)",
            explicit.file_offset,
            path.display()
        ));
    }
    let canonical = std::fs::canonicalize(path).unwrap_or_else(|_| path.clone());
    let maps =
        symbolizer::read_maps(pid).map_err(|error| format!("reading the maps of PID {pid}: {error}"))?;
    // The process may live in another mount namespace: compare through its root too.
    let root = PathBuf::from(format!("/proc/{pid}/root"));
    let maps_it = |m: &symbolizer::MapEntry| {
        m.file_path().is_some_and(|mapped| {
            mapped == canonical
                || std::fs::canonicalize(root.join(mapped.strip_prefix("/").unwrap_or(mapped)))
                    .is_ok_and(|seen| seen == canonical)
        })
    };
    if !maps.iter().any(maps_it) {
        return Err(format!(
            "PID {pid} does not map `{}` (is it the file the instance loaded?)",
            path.display()
        ));
    }
    // Only then the code itself: a uprobe inside an instruction corrupts it in every process
    // mapping the file.
    symbolizer::check_probe_point(path, explicit.file_offset).map_err(|error| {
        format!(
            "--probe {}: {error}; pass the file offset of the function's first instruction \
             (its symbol's address converted to a file offset)",
            explicit.function.name()
        )
    })?;
    Ok(FunctionLocation {
        path: path.clone(),
        file_offset: explicit.file_offset,
        debug_file: None,
    })
}

/// A function probed by name, where its symbol says it starts: probed only when that is the
/// first instruction of a function `.eh_frame` describes, decoded as such (the check
/// `--probe` offsets get). A symbol that is not (an alias into the middle of another function,
/// a label) would put the breakpoint inside an instruction of every process mapping the file.
fn named_entry(function: Function, location: FunctionLocation) -> Result<FunctionLocation, String> {
    match symbolizer::check_probe_point(&location.path, location.file_offset) {
        Ok(point) if point.is_entry => Ok(location),
        Ok(point) => Err(format!(
            "the symbol {} is at file offset {:#x} of `{}`, inside the function that starts at \
             {:#x}, not at a function's first instruction",
            function.name(),
            location.file_offset,
            location.path.display(),
            point.function_offset
        )),
        Err(error) => Err(format!("{} cannot be probed safely: {error}", function.name())),
    }
}

/// Why a function probed by name was not found, and what to do, in one sentence.
fn named_not_found(function: Function, executable: &str, error: &FindFunctionError) -> String {
    match error {
        FindFunctionError::NoSymbol { path, .. } => format!(
            "`{}` names no function of `{}` (its exported functions, or all of them with its \
             debug file; pgscope's own probes are {}): check the spelling, install the debug \
             package for a static function, or give a library's function with --probe \
             NAME=PATH:OFFSET",
            function.name(),
            path.display(),
            Function::ALL.map(|f| f.name()).join(", ")
        ),
        other => format!("{} (looked for in `{executable}`)", other),
    }
}

/// Where `function` is in process `pid`, or why it cannot be probed (one sentence).
fn locate(
    symbolizer: &mut Symbolizer,
    function: Function,
    pid: u32,
    executable: &str,
    major: u32,
    explicit: &[ExplicitProbe],
) -> Result<FunctionLocation, String> {
    if let Some(given) = explicit.iter().find(|p| p.function == function) {
        return explicit_location(given, pid);
    }
    let error = match symbolizer.find_function(pid, &module_of(function, executable), function.name()) {
        Ok(location) if function.is_named() => return named_entry(function, location),
        Ok(location) => return Ok(location),
        Err(error) => error,
    };
    if function.is_named() {
        return Err(named_not_found(function, executable, &error));
    }
    // Stripped and no debug file: pgss_store is still the one function all of
    // pg_stat_statements' hook functions call.
    if !matches!(
        (function, &error),
        (Function::PgssStore, FindFunctionError::NoSymbol { .. })
    ) {
        return Err(explain(function, major, &error));
    }
    match pgss_hooks::find_pgss_store(symbolizer, pid) {
        Ok(location) => {
            note!(
                "pgscope: pgss_store found through pg_stat_statements' hook functions at file offset {:#x} \
                 of pg_stat_statements.so (no debug file needed)",
                location.file_offset
            );
            Ok(location)
        }
        Err(hooks_error) => Err(format!(
            "{}; nor could it be found through pg_stat_statements' hook functions: {hooks_error:#}",
            explain(function, major, &error)
        )),
    }
}

/// The processes of each instance, by root PID: statement clocks read the instance's shared
/// memory through any of them.
pub type PidsByRoot = BTreeMap<u32, Vec<u32>>;

/// One probed function, attached or between duty-cycle windows.
struct ActiveProbe {
    function: Function,
    /// Where its values are among its arguments, in the instance's major.
    args: ProbeArgs,
    file: ProbedFile,
    file_offset: u64,
    links: Option<FunctionLinks>,
    /// Whether it follows the shared duty cycle (it is hot) or stays attached.
    cycled: bool,
    /// Time attached so far, from attach completed to detach started: the denominator of its
    /// extrapolation.
    attached_total: Duration,
    /// When the current attachment completed.
    attached_since: Option<Instant>,
    /// Hits and attached time since the last re-plan: the hit rate while attached.
    hits_window: u64,
    attached_window: Duration,
    /// Statements the instance ran while this probe was attached.
    statements_attached: u64,
    /// The traced processes' own hits while attached, and the instance's CPU time meanwhile
    /// ([`ProbeSet::account_cpu`]): what the probe's traps took out of its attached time.
    hits_attached: u64,
    cpu_attached_ns: f64,
    /// Per instance (root PID): statements while attached in the agent's current interval.
    interval_attached: BTreeMap<u32, u64>,
    /// Attached time when the agent's current interval began.
    mark: Duration,
    /// Per instance: statements run while this probe was detached since it was last attached.
    /// A call first measured at its next attachment may have run all through that stretch.
    detached_run: BTreeMap<u32, u64>,
    /// `detached_run` when the agent's current interval began.
    unseen_at_mark: BTreeMap<u32, u64>,
    /// When its last attachment ended; None while attached.
    detached_since: Option<Instant>,
    /// Time detached since its last attachment, when the agent's current interval began.
    unseen_time_at_mark: Duration,
}

/// The file a probe is in, held open for as long as the probe may be attached again. Found
/// through the process it was located in (`/proc/PID/root/…`: the process may live in another
/// mount namespace), a path that is gone once that process is: the duty cycle attaches again
/// long after, when the instance it was found through may have restarted, so attaching goes
/// through the agent's own descriptor instead (the kernel resolves `/proc/self/fd/N` to the
/// same file, whichever namespace it was opened in).
pub(super) struct ProbedFile {
    file: std::fs::File,
}

impl ProbedFile {
    pub(super) fn open(path: &std::path::Path) -> Result<Self> {
        let file = std::fs::File::open(path)
            .with_context(|| format!("cannot open `{}` to probe it", path.display()))?;
        Ok(Self { file })
    }

    pub(super) fn attach_path(&self) -> PathBuf {
        use std::os::fd::AsRawFd;
        PathBuf::from(format!("/proc/self/fd/{}", self.file.as_raw_fd()))
    }
}

/// The probed functions of a trace and their duty cycle.
pub struct ProbeSet {
    probes: Vec<ActiveProbe>,
    /// Budget as a fraction of the instance's CPU time; None: every call is measured.
    budget: Option<f64>,
    ns_per_hit: f64,
    /// The instance's CPU time over the trace ([`ProbeSet::account_cpu`]).
    cpu_total_ns: f64,
    cycle: DutyCycle,
    last_hits: [u64; FUNCTION_IDS],
    /// Hits by processes that are not targets (other instances mapping the same file), as last
    /// read and when the probes were attached: their traps are part of the probes' cost.
    last_foreign_hits: [u64; FUNCTION_IDS],
    foreign_hits_at_attach: [u64; FUNCTION_IDS],
    since_plan: Duration,
    /// Whether the duty cycle was planned once (the first plan comes sooner).
    planned: bool,
    /// Hit counters and time of the last live-view line.
    live_hits: [u64; FUNCTION_IDS],
    live_since: Option<Instant>,
    /// Each instance's statement count (by root PID), read at every switch; none without
    /// attribution.
    statements: BTreeMap<u32, StatementClock>,
    statements_total: u64,
    /// Set once the counts are read: nothing is accounted after.
    stopped: bool,
    /// Per instance (root PID): statements in the agent's current interval.
    interval_totals: BTreeMap<u32, u64>,
    /// Instances whose statement clock counted from the start of the current interval: only
    /// theirs are whole (a clock that starts counting mid-interval missed the statements
    /// before, and calls measured then would be scaled by too few statements).
    counting_at_mark: BTreeSet<u32>,
    /// Instances whose statement clock did not count at some moment a probe was attached in
    /// the current interval: calls measured then have no statements to be divided by.
    uncounted_attached: BTreeSet<u32>,
    /// When the agent's current interval began.
    mark: Instant,
}

/// How much of an interval a probe was attached for: in time, and in the instance's
/// statements when its statement clock counted while the probe was attached (a probe slows
/// what it measures, so time undercounts; statements are the better measure when there are
/// any).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct IntervalShare {
    /// The interval's length, and the time the probe was attached in it.
    pub time: (Duration, Duration),
    /// How long the probe had been detached when the interval began (zero if it was
    /// attached): what a call first measured in this interval may have run through before.
    pub unseen_time: Duration,
    pub statements: Option<StatementShare>,
}

/// An instance's statements in an interval, as its statement clock counted them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StatementShare {
    /// While the probe was attached: the clock counted all along, so the calls measured in
    /// the interval divided by these are the calls per statement.
    pub attached: u64,
    /// All of the interval's, when the clock counted the whole interval and there were any:
    /// `all - attached` is what the detached part ran.
    pub all: Option<u64>,
    /// The instance's statements while the probe was detached, from its last attachment to
    /// the interval's start (0 if it was attached then): the [`IntervalShare::unseen_time`]
    /// in statements.
    pub unseen: u64,
}

/// A probe's time in an interval: (interval, attached, detached before it began).
type TimeShare = (Duration, Duration, Duration);

/// An interval's shares per (function, instance).
#[derive(Clone, Debug, Default)]
pub struct IntervalShares {
    by_statements: BTreeMap<(Function, u32), StatementShare>,
    by_time: BTreeMap<Function, TimeShare>,
}

impl IntervalShares {
    pub fn get(&self, function: Function, root: u32) -> Option<IntervalShare> {
        let &(all, attached, unseen) = self.by_time.get(&function)?;
        Some(IntervalShare {
            time: (all, attached),
            unseen_time: unseen,
            statements: self.by_statements.get(&(function, root)).copied(),
        })
    }
}

/// What /metrics shows of one probed function.
#[derive(Clone, Debug)]
pub struct ProbeState {
    pub function: Function,
    /// Attached right now.
    pub attached: bool,
    /// Follows the shared duty cycle (it is hot) rather than staying attached.
    pub cycled: bool,
}

/// Functions found in their files and ready to attach: finding them parses the files, which
/// takes seconds in a debug build, while attaching takes milliseconds. A trace finds them
/// first and attaches them last, so that the duty cycle governs them from their first trap.
pub struct LocatedProbes {
    probes: Vec<LocatedProbe>,
    budget: Option<f64>,
    ns_per_hit: f64,
}

struct LocatedProbe {
    function: Function,
    args: ProbeArgs,
    file: ProbedFile,
    file_offset: u64,
}

impl LocatedProbes {
    /// Attaches every located function; one that cannot be attached is said and left out.
    pub fn attach(self, probes: &mut OnCpuProbes) -> Result<ProbeSet> {
        let mut set = ProbeSet::new(self.budget, self.ns_per_hit);
        if self.probes.is_empty() {
            return Ok(set);
        }
        set.last_hits = probes.function_hits()?;
        set.last_foreign_hits = probes.foreign_function_hits()?;
        set.foreign_hits_at_attach = set.last_foreign_hits;
        set.live_hits = set.last_hits;
        for LocatedProbe {
            function,
            args,
            file,
            file_offset,
        } in self.probes
        {
            match probes.attach_function(function, args, &file.attach_path(), file_offset) {
                Ok(links) => set.probes.push(ActiveProbe {
                    function,
                    args,
                    file,
                    file_offset,
                    links: Some(links),
                    cycled: false,
                    attached_total: Duration::ZERO,
                    attached_since: Some(Instant::now()),
                    hits_window: 0,
                    attached_window: Duration::ZERO,
                    statements_attached: 0,
                    hits_attached: 0,
                    cpu_attached_ns: 0.0,
                    interval_attached: BTreeMap::new(),
                    mark: Duration::ZERO,
                    detached_run: BTreeMap::new(),
                    unseen_at_mark: BTreeMap::new(),
                    detached_since: None,
                    unseen_time_at_mark: Duration::ZERO,
                }),
                Err(error) => note!("pgscope: probe {} not attached: {error:#}", function.name()),
            }
        }
        Ok(set)
    }
}

/// How often the duty cycle is re-planned from the measured hit rates.
const REPLAN_EVERY: Duration = Duration::from_secs(1);
/// The first plan: every probe is attached until then, at full cost, to measure its rate;
/// a quarter second of 50 ms ticks is enough for rates of thousands of calls per second.
const FIRST_PLAN_AFTER: Duration = Duration::from_millis(250);

impl ProbeSet {
    /// No probed function (none asked for, or the instance's major has no table).
    pub fn empty() -> ProbeSet {
        Self::new(None, 0.0)
    }

    fn new(budget: Option<f64>, ns_per_hit: f64) -> ProbeSet {
        ProbeSet {
            probes: Vec::new(),
            budget,
            ns_per_hit,
            cpu_total_ns: 0.0,
            cycle: DutyCycle::new(),
            last_hits: [0; FUNCTION_IDS],
            last_foreign_hits: [0; FUNCTION_IDS],
            foreign_hits_at_attach: [0; FUNCTION_IDS],
            since_plan: Duration::ZERO,
            planned: false,
            live_hits: [0; FUNCTION_IDS],
            live_since: None,
            statements: BTreeMap::new(),
            statements_total: 0,
            stopped: false,
            interval_totals: BTreeMap::new(),
            counting_at_mark: BTreeSet::new(),
            uncounted_attached: BTreeSet::new(),
            mark: Instant::now(),
        }
    }

    /// Finds and attaches what can be attached and says, per function, what could not and why;
    /// the trace goes on with the others ([`ProbeSet::locate`], then [`LocatedProbes::attach`]).
    #[allow(clippy::too_many_arguments)]
    pub fn attach(
        probes: &mut OnCpuProbes,
        symbolizer: &mut Symbolizer,
        functions: &[Function],
        explicit: &[ExplicitProbe],
        pid: u32,
        table: &VersionTable,
        budget: Option<f64>,
        ns_per_hit: f64,
    ) -> Result<ProbeSet> {
        Self::locate(symbolizer, functions, explicit, pid, table, budget, ns_per_hit)?.attach(probes)
    }

    /// Finds the functions, without attaching anything, and says, per function, what cannot be
    /// probed and why. Each function's arguments are read where `table`, the table of the
    /// major process `pid` runs, places them; a function it has no signature for is not
    /// probed. Functions are found with the symbolizer's symbol tables, so static functions of
    /// stripped files count when their debug file is installed; `pgss_store` without one is
    /// found through pg_stat_statements' hook functions.
    #[allow(clippy::too_many_arguments)]
    pub fn locate(
        symbolizer: &mut Symbolizer,
        functions: &[Function],
        explicit: &[ExplicitProbe],
        pid: u32,
        table: &VersionTable,
        budget: Option<f64>,
        ns_per_hit: f64,
    ) -> Result<LocatedProbes> {
        let mut located = LocatedProbes {
            probes: Vec::new(),
            budget,
            ns_per_hit,
        };
        if functions.is_empty() {
            return Ok(located);
        }
        let executable = super::executable_name(pid)?;
        for &function in functions {
            let args = match table.probe_args(function) {
                Ok(args) => args,
                Err(reason) => {
                    note!("pgscope: probe {} not attached: {reason}", function.name());
                    continue;
                }
            };
            let location = match locate(symbolizer, function, pid, &executable, table.major, explicit) {
                Ok(location) => location,
                Err(reason) => {
                    note!("pgscope: probe {} not attached: {reason}", function.name());
                    continue;
                }
            };
            match ProbedFile::open(&location.path) {
                Ok(file) => located.probes.push(LocatedProbe {
                    function,
                    args,
                    file,
                    file_offset: location.file_offset,
                }),
                Err(error) => note!("pgscope: probe {} not attached: {error:#}", function.name()),
            }
        }
        Ok(located)
    }

    /// Counts the statements of the instance rooted at `root` from now on (at every switch of
    /// the duty cycle), so that duty-cycled counts are scaled by statements rather than time.
    /// Without any they are scaled by time.
    pub fn count_statements(&mut self, root: u32, layout: CounterLayout, pids: &PidsByRoot) {
        if self.probes.is_empty() {
            return;
        }
        self.statements.insert(root, StatementClock::new(layout));
        self.account_statements(pids);
        // The clock counts from here: the instance's calls are divided by the statements
        // counted from now on. Calls it made before it was found, under probes attached for
        // another instance of the same executable, are the small error this accepts.
        self.uncounted_attached.remove(&root);
        if self
            .statements
            .get(&root)
            .is_some_and(StatementClock::is_counting)
        {
            self.counting_at_mark.insert(root);
        }
    }

    /// Instances whose statement clock has not found its array yet: it needs a backend's PID
    /// (the postmaster has no status entry).
    pub fn clocks_not_counting(&self) -> Vec<u32> {
        self.statements
            .iter()
            .filter(|(_, clock)| !clock.is_counting())
            .map(|(&root, _)| root)
            .collect()
    }

    /// Stops counting an instance's statements (it is gone).
    pub fn forget_instance(&mut self, root: u32) {
        self.statements.remove(&root);
    }

    /// Credits the statements run since the last call to every probe attached meanwhile.
    /// Called before each switch, so each interval had one attach state.
    fn account_statements(&mut self, pids: &PidsByRoot) {
        let mut progress = 0;
        let any_attached = self.probes.iter().any(|p| p.links.is_some());
        for (root, clock) in &mut self.statements {
            let Some(pids) = pids.get(root) else {
                continue;
            };
            if !clock.is_counting() && any_attached {
                self.uncounted_attached.insert(*root);
            }
            let of_root = clock.advance(pids);
            progress += of_root;
            *self.interval_totals.entry(*root).or_insert(0) += of_root;
            for probe in &mut self.probes {
                if probe.links.is_some() {
                    *probe.interval_attached.entry(*root).or_insert(0) += of_root;
                    probe.detached_run.insert(*root, 0);
                } else {
                    *probe.detached_run.entry(*root).or_insert(0) += of_root;
                }
            }
        }
        self.statements_total += progress;
        for probe in self.probes.iter_mut().filter(|p| p.links.is_some()) {
            probe.statements_attached += progress;
        }
    }

    /// Ends every probe's attached time now: call when the maps are read, before detaching,
    /// so that all functions' counts cover the same period.
    pub fn stop_clock(&mut self, pids: &PidsByRoot) {
        if self.stopped {
            return;
        }
        self.account_statements(pids);
        self.stopped = true;
        let now = Instant::now();
        for probe in &mut self.probes {
            if let Some(since) = probe.attached_since.take() {
                probe.attached_total += now - since;
            }
        }
    }

    /// Detaches every probe (the end of the trace; their maps stay readable): their calls stop
    /// counting at once, their links detach on threads of their own.
    pub fn detach_all(&mut self, probes: &mut OnCpuProbes, pids: &PidsByRoot) -> Result<()> {
        self.stop_clock(pids);
        for probe in &mut self.probes {
            if let Some(links) = probe.links.take() {
                probes.detach_function_in_background(links)?;
            }
        }
        Ok(())
    }

    /// Live view lines: calls per second of each probed function over the last second.
    pub fn live_lines(&mut self) -> Vec<String> {
        let now = Instant::now();
        let seconds = self.live_since.map_or(0.0, |since| (now - since).as_secs_f64());
        self.live_since = Some(now);
        let mut lines = Vec::new();
        for probe in &self.probes {
            let index = probe.function.id() as usize;
            let calls = self.last_hits[index].saturating_sub(self.live_hits[index]);
            if seconds > 0.0 {
                let state = if probe.links.is_some() {
                    ""
                } else {
                    " (detached: duty cycle)"
                };
                lines.push(format!(
                    "  probe {:<24} {:>9.0} calls/s{state}",
                    probe.function.name(),
                    calls as f64 / seconds
                ));
            }
        }
        self.live_hits = self.last_hits;
        lines
    }

    /// What one probed call (entry and return traps, full programs) costs, as calibrated: the
    /// cost of each nested call a probed function's time holds.
    pub fn ns_per_hit(&self) -> f64 {
        self.ns_per_hit
    }

    /// The shared duty cycle of the hot probes (1: always attached).
    pub fn duty(&self) -> f64 {
        self.cycle.duty()
    }

    /// Each probe's state, for /metrics.
    pub fn states(&self) -> Vec<ProbeState> {
        self.probes
            .iter()
            .map(|p| ProbeState {
                function: p.function,
                attached: p.links.is_some(),
                cycled: p.cycled,
            })
            .collect()
    }

    /// Per function and instance: what the interval since the last call held (the instance's
    /// statements, and how many ran while the probe was attached; time where the instance has
    /// no statement clock), and starts the next interval. The agent scales each upload
    /// interval's counts with it; `trace` uses [`ProbeSet::extrapolations`].
    pub fn take_interval(&mut self, pids: &PidsByRoot) -> IntervalShares {
        self.account_statements(pids);
        let now = Instant::now();
        let elapsed = now - self.mark;
        self.mark = now;
        let totals = std::mem::take(&mut self.interval_totals);
        let counting: BTreeSet<u32> = self
            .statements
            .iter()
            .filter(|(_, clock)| clock.is_counting())
            .map(|(&root, _)| root)
            .collect();
        let whole = std::mem::replace(&mut self.counting_at_mark, counting.clone());
        let uncounted = std::mem::take(&mut self.uncounted_attached);
        let attached_until: Vec<Duration> = self.probes.iter().map(|p| self.attached_until(p, now)).collect();
        let mut shares = IntervalShares::default();
        for (p, attached_now) in self.probes.iter_mut().zip(attached_until) {
            let attached = attached_now.saturating_sub(p.mark);
            p.mark = attached_now;
            let attached_statements = std::mem::take(&mut p.interval_attached);
            let detached_now = p.detached_since.map_or(Duration::ZERO, |since| now - since);
            let unseen_time = std::mem::replace(&mut p.unseen_time_at_mark, detached_now);
            let unseen = std::mem::replace(&mut p.unseen_at_mark, p.detached_run.clone());
            shares
                .by_time
                .insert(p.function, (elapsed, attached, unseen_time));
            for &root in counting.iter().filter(|root| !uncounted.contains(root)) {
                let all = totals.get(&root).copied().unwrap_or(0);
                let counted_all = whole.contains(&root);
                shares.by_statements.insert(
                    (p.function, root),
                    StatementShare {
                        attached: attached_statements.get(&root).copied().unwrap_or(0),
                        all: (all > 0 && counted_all).then_some(all),
                        // Only from a clock that counted when the interval began.
                        unseen: if counted_all {
                            unseen.get(&root).copied().unwrap_or(0)
                        } else {
                            0
                        },
                    },
                );
            }
        }
        shares
    }

    /// A probe's attached time from its first attach until `now`.
    fn attached_until(&self, probe: &ActiveProbe, now: Instant) -> Duration {
        probe.attached_total + probe.attached_since.map_or(Duration::ZERO, |since| now - since)
    }

    pub fn functions(&self) -> Vec<Function> {
        self.probes.iter().map(|p| p.function).collect()
    }

    /// Per probed function: hits by processes that are not targets since the probes were
    /// attached. They pay a trap per call although nothing is measured for them, and count
    /// against the budget.
    pub fn foreign_hits(&self, probes: &OnCpuProbes) -> Result<BTreeMap<Function, u64>> {
        let now = probes.foreign_function_hits()?;
        Ok(self
            .probes
            .iter()
            .map(|p| {
                let index = p.function.id() as usize;
                (
                    p.function,
                    now[index].saturating_sub(self.foreign_hits_at_attach[index]),
                )
            })
            .collect())
    }

    /// Accounts `cpu_ns` of the instance's CPU time (its on-CPU samples since the last call ×
    /// the period) to the trace and to each probe attached meanwhile: call before each
    /// [`ProbeSet::tick`], whose switches it must not straddle.
    pub fn account_cpu(&mut self, cpu_ns: f64) {
        if self.stopped {
            return;
        }
        self.cpu_total_ns += cpu_ns;
        for probe in self.probes.iter_mut().filter(|p| p.links.is_some()) {
            probe.cpu_attached_ns += cpu_ns;
        }
    }

    /// Advances by `elapsed`: accounts hits and attached time, re-plans once a second from the
    /// instance's CPU use (`instance_cpu_ns_per_s`, from the on-CPU samples), and attaches or
    /// detaches the hot probes when the shared window starts or ends.
    pub fn tick(
        &mut self,
        probes: &mut OnCpuProbes,
        elapsed: Duration,
        instance_cpu_ns_per_s: f64,
        pids: &PidsByRoot,
    ) -> Result<()> {
        if self.probes.is_empty() {
            return Ok(());
        }
        let hits = probes.function_hits()?;
        let foreign = probes.foreign_function_hits()?;
        for probe in &mut self.probes {
            let index = probe.function.id() as usize;
            let foreign_delta = foreign[index].saturating_sub(self.last_foreign_hits[index]);
            if probe.links.is_some() {
                let own = hits[index].saturating_sub(self.last_hits[index]);
                // Every trap costs the same CPU whoever takes it: the budget counts them all.
                probe.hits_window += own + foreign_delta;
                probe.attached_window += elapsed;
                if !self.stopped {
                    probe.hits_attached += own;
                }
            }
        }
        self.last_hits = hits;
        self.last_foreign_hits = foreign;

        self.since_plan += elapsed;
        let plan_after = if self.planned {
            REPLAN_EVERY
        } else {
            FIRST_PLAN_AFTER
        };
        if let Some(fraction) = self.budget.filter(|_| self.since_plan >= plan_after) {
            self.since_plan = Duration::ZERO;
            self.planned = true;
            self.replan(fraction * instance_cpu_ns_per_s);
        }

        // Every tick, so that a new backend's statements count from its first tick on.
        if self.budget.is_some() {
            self.account_statements(pids);
        }
        self.cycle.advance(elapsed);
        let window_open = self.cycle.is_attached();
        for index in 0..self.probes.len() {
            // Hot probes follow the shared window; the others stay attached.
            let want = !self.probes[index].cycled || window_open;
            if want == self.probes[index].links.is_some() {
                continue;
            }
            // Statements are credited to a probe only between its own attach completing and
            // its detach starting: switching one probe takes a kernel grace period, during
            // which the others are still in their previous state.
            self.account_statements(pids);
            let probe = &mut self.probes[index];
            let result = match probe.links.take() {
                Some(links) => {
                    if let Some(since) = probe.attached_since.take() {
                        probe.attached_total += since.elapsed();
                    }
                    probe.detached_since = Some(Instant::now());
                    probes.detach_function(links)
                }
                None => {
                    match probes.attach_function(
                        probe.function,
                        probe.args,
                        &probe.file.attach_path(),
                        probe.file_offset,
                    ) {
                        Ok(links) => {
                            // The attach itself counts as detached time.
                            self.account_statements(pids);
                            let probe = &mut self.probes[index];
                            probe.links = Some(links);
                            probe.attached_since = Some(Instant::now());
                            probe.detached_since = None;
                            Ok(())
                        }
                        Err(error) => Err(error),
                    }
                }
            };
            if let Err(error) = result {
                warn!(
                    "cannot switch probe {} on or off: {error:#}",
                    self.probes[index].function.name()
                );
            }
        }
        Ok(())
    }

    /// Recomputes which probes are hot and the shared duty, from hit rates while attached.
    fn replan(&mut self, budget_ns_per_s: f64) {
        // A probe not attached since the last plan keeps its last known rate (as cost 0 here
        // would make it cheap): only re-plan with every rate measured.
        if self.probes.iter().any(|p| p.attached_window.is_zero()) {
            return;
        }
        let costs: Vec<f64> = self
            .probes
            .iter()
            .map(|p| p.hits_window as f64 / p.attached_window.as_secs_f64() * self.ns_per_hit)
            .collect();
        let (duty, hot) = plan_shared_duty(&costs, budget_ns_per_s);
        self.cycle.set_duty(duty);
        for (probe, hot) in self.probes.iter_mut().zip(hot) {
            probe.cycled = hot && duty < 1.0;
            probe.hits_window = 0;
            probe.attached_window = Duration::ZERO;
        }
    }

    /// Per function: the factor from measured to estimated counts, whether that is an
    /// extrapolation, and the share of the trace the probe was attached ([`scale_factor`]).
    pub fn extrapolations(&self, trace: Duration) -> BTreeMap<Function, Extrapolation> {
        // The hot probes share one window: all their traps slow the instance while it is open.
        let cycled_trap_ns: f64 = self
            .probes
            .iter()
            .filter(|p| p.cycled)
            .map(|p| p.hits_attached as f64 * self.ns_per_hit)
            .sum();
        self.probes
            .iter()
            .map(|p| {
                tracing::debug!(
                    function = p.function.name(),
                    statements_attached = p.statements_attached,
                    statements_total = self.statements_total,
                    attached = ?p.attached_total,
                    ?trace,
                    "probe extrapolation"
                );
                let attached = p.attached_total.as_secs_f64();
                let total = trace.as_secs_f64().max(1e-9);
                let useful = p.cycled.then_some(UsefulCpu {
                    total_ns: self.cpu_total_ns,
                    attached_ns: p.cpu_attached_ns,
                    trap_ns: cycled_trap_ns,
                });
                let factor = scale_factor(
                    self.statements_total,
                    p.statements_attached,
                    total,
                    attached,
                    useful,
                );
                let extrapolated = factor > 1.01;
                (
                    p.function,
                    Extrapolation {
                        factor,
                        extrapolated,
                        attached_share: (attached / total).min(1.0),
                    },
                )
            })
            .collect()
    }
}

/// Fewest statements (status writes) counted while a probe was attached for them to scale its
/// counts: the count's own error is about 1/√n (10% at 100), and one long statement (a nested
/// loop running for seconds) writes its status only at its start and end, so a handful of
/// writes says nothing of how much of its work the probe saw.
pub const MIN_STATEMENTS_TO_SCALE: u64 = 100;

/// How much more of the statements than of the time may fall in the probe's attached time
/// before they are taken for bursts: the statement counts of a window are not exact.
const BURST_TOLERANCE: f64 = 1.25;

/// The instance's CPU time over the trace and while a duty-cycled probe was attached, and what
/// the traps of the probes sharing its window took of the latter (hits × the calibrated cost).
#[derive(Clone, Copy, Debug)]
pub struct UsefulCpu {
    pub total_ns: f64,
    pub attached_ns: f64,
    pub trap_ns: f64,
}

/// Below this share of the attached CPU left to the instance's own work, the traps' cost is too
/// uncertain to correct by: the estimate falls back to time.
const MIN_USEFUL_SHARE: f64 = 0.2;

impl UsefulCpu {
    /// The instance's own work over the trace, over its own work while attached: traps slow it
    /// only while attached, so by time alone a long statement's calls are under-counted by as
    /// much as the probe slowed it (2.7 times for `_bt_getroot` in a nested loop).
    fn ratio(&self) -> Option<f64> {
        let useful_attached = self.attached_ns - self.trap_ns;
        (self.attached_ns > 0.0 && useful_attached >= MIN_USEFUL_SHARE * self.attached_ns)
            .then(|| (self.total_ns - self.trap_ns) / useful_attached)
    }
}

/// From calls counted while attached to calls over the whole trace: all statements over
/// statements while attached, when enough were counted ([`MIN_STATEMENTS_TO_SCALE`]): calls per
/// statement do not depend on whether the probe is attached, while calls per second fall while
/// it is (it slows the workload). Else, for a duty-cycled probe, the instance's own work over
/// its own work while attached ([`UsefulCpu`]): calls per unit of work do not depend on the
/// probe either. Else trace time over attached time. Never below 1.
pub fn scale_factor(
    statements_total: u64,
    statements_attached: u64,
    trace_secs: f64,
    attached_secs: f64,
    useful: Option<UsefulCpu>,
) -> f64 {
    // A probe only slows the workload: more of the statements while attached than of the time
    // means they came in bursts (a session's start, a few short statements around one long one)
    // that say nothing of the work the probe saw.
    let plausible = trace_secs > 0.0
        && statements_total > 0
        && (statements_attached as f64 / statements_total as f64)
            <= (attached_secs / trace_secs) * BURST_TOLERANCE;
    if statements_attached >= MIN_STATEMENTS_TO_SCALE && plausible {
        (statements_total as f64 / statements_attached as f64).max(1.0)
    } else if let Some(ratio) = useful.and_then(|u| u.ratio()) {
        ratio.max(1.0)
    } else if attached_secs > 0.0 {
        (trace_secs / attached_secs).max(1.0)
    } else {
        1.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn many_statements_scale_by_statements_few_by_time() {
        // A busy OLTP instance: 40 000 statements, 10 000 of them while attached for 2 of 8 s.
        assert_eq!(scale_factor(40_000, 10_000, 8.0, 2.0, None), 4.0);
        // Slowed by the probe: fewer statements per second while attached; by statements, not 4.
        assert_eq!(scale_factor(40_000, 8_000, 8.0, 2.0, None), 5.0);
        // One nested loop running the whole trace: a few status writes, none meaningful.
        assert_eq!(scale_factor(6, 5, 8.0, 0.5, None), 16.0);
        assert_eq!(scale_factor(2, 0, 8.0, 0.5, None), 16.0);
        // Never scaled down, nor by nothing.
        assert_eq!(scale_factor(100, 200, 8.0, 8.0, None), 1.0);
        assert_eq!(scale_factor(0, 0, 8.0, 0.0, None), 1.0);
    }

    #[test]
    fn a_long_statement_slowed_by_the_probe_scales_by_its_own_work() {
        // One busy backend, 8 s; attached 0.5 s, of which traps took 0.3 s: 0.2 s of its own
        // work while attached, 7.7 s in all.
        let slowed = UsefulCpu {
            total_ns: 8e9,
            attached_ns: 0.5e9,
            trap_ns: 0.3e9,
        };
        assert!((scale_factor(6, 5, 8.0, 0.5, Some(slowed)) - 38.5).abs() < 1e-9);
        // Many statements, fewer of them while attached than of the time: they say it better.
        assert_eq!(scale_factor(40_000, 2_000, 8.0, 0.5, Some(slowed)), 20.0);
        // Most statements while attached, a sixteenth of the time: bursts (a session's SETs
        // around one long join), not the work.
        assert!((scale_factor(216, 210, 8.0, 0.5, Some(slowed)) - 38.5).abs() < 1e-9);
        assert_eq!(scale_factor(216, 210, 8.0, 0.5, None), 16.0);
        // Traps took (almost) all of it: too uncertain, by time.
        let swamped = UsefulCpu {
            trap_ns: 0.45e9,
            ..slowed
        };
        assert_eq!(scale_factor(6, 5, 8.0, 0.5, Some(swamped)), 16.0);
        // Not measured (no CPU rate): by time.
        let unknown = UsefulCpu {
            total_ns: 0.0,
            attached_ns: 0.0,
            trap_ns: 0.0,
        };
        assert_eq!(scale_factor(6, 5, 8.0, 0.5, Some(unknown)), 16.0);
    }
}
