//! The live view of `pgscope trace`: samples taken and lost, and on a terminal a small table
//! redrawn every second (busiest queries and wait events, probe calls per second).

use std::io::{IsTerminal, Write};
use std::time::Duration;

use crate::aggregate::UnwindStats;
use crate::bpf::abi::Counter;
use crate::bpf::Counters;

/// On a terminal the view is redrawn every second; in a log one line is written every 5 s.
pub struct Progress {
    total: Duration,
    terminal: bool,
    updates: u64,
    /// Lines drawn last time (the cursor goes back up over them).
    drawn: usize,
}

impl Progress {
    pub fn new(total: Duration) -> Self {
        Self {
            total,
            terminal: std::io::stderr().is_terminal(),
            updates: 0,
            drawn: 0,
        }
    }

    /// `table` is drawn under the progress line on a terminal only.
    pub fn update(&mut self, elapsed: Duration, counters: &Counters, stats: &UnwindStats, table: &[String]) {
        self.updates += 1;
        if !self.terminal && !self.updates.is_multiple_of(5) {
            return;
        }
        let lost: u64 = counters.losses().iter().map(|&(_, n)| n).sum();
        let line = format!(
            "[{:>4.0}s/{:.0}s] samples {} · lost {} · user stacks complete {:.1}%",
            elapsed.as_secs_f64(),
            self.total.as_secs_f64(),
            counters.get(Counter::Samples),
            lost,
            stats.complete_pct()
        );
        // Progress is best effort: a closed stderr must not end the session.
        if !self.terminal {
            note!("{line}");
            return;
        }
        if !crate::console::stderr_open() {
            return;
        }
        let mut out = String::new();
        if self.drawn > 1 {
            out.push_str(&format!("\x1b[{}A", self.drawn - 1));
        }
        out.push('\r');
        // The table shows query and wait names: escaped, the view's own sequences added after.
        let lines: Vec<std::borrow::Cow<str>> = std::iter::once(line.as_str())
            .chain(table.iter().map(String::as_str))
            .map(crate::console::escape)
            .collect();
        // Lines left over from a taller table are cleared.
        let height = lines.len().max(self.drawn);
        for i in 0..height {
            out.push_str(lines.get(i).map_or("", |line| line.as_ref()));
            out.push_str("\x1b[K");
            if i + 1 < height {
                out.push('\n');
            }
        }
        self.drawn = height;
        let mut stderr = std::io::stderr().lock();
        if write!(stderr, "{out}").and_then(|()| stderr.flush()).is_err() {
            crate::console::stderr_failed();
        }
    }

    pub fn finish(&self) {
        if self.terminal && self.updates > 0 {
            note!();
        }
    }
}
