//! The live progress line of `pgscope trace`: samples taken and lost while it runs.

use std::io::{IsTerminal, Write};
use std::time::Duration;

use crate::aggregate::UnwindStats;
use crate::bpf::abi::Counter;
use crate::bpf::Counters;

/// On a terminal the line is redrawn every second; in a log it is written every 5 seconds.
pub struct Progress {
    total: Duration,
    terminal: bool,
    updates: u64,
}

impl Progress {
    pub fn new(total: Duration) -> Self {
        Self {
            total,
            terminal: std::io::stderr().is_terminal(),
            updates: 0,
        }
    }

    pub fn update(&mut self, elapsed: Duration, counters: &Counters, stats: &UnwindStats) {
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
        let mut stderr = std::io::stderr().lock();
        // Progress is best effort: a closed stderr must not end the session.
        let _ = if self.terminal {
            write!(stderr, "\r{line}\x1b[K")
        } else {
            writeln!(stderr, "{line}")
        };
        let _ = stderr.flush();
    }

    pub fn finish(&self) {
        if self.terminal && self.updates > 0 {
            eprintln!();
        }
    }
}
