//! Off-CPU time measured without a stack (the sampler's idle and client waits; the tracer's
//! short waits, preemptions, idle waits) is kept by the kernel as running totals per
//! (process, wait): each upload interval takes what grew since
//! the last one, and totals of exited processes are read one last time and removed, so the
//! bounded map does not fill up under connection churn. Waits still open for a second or more
//! are shipped as far as they went (`Session::ship_open_waits`).

use std::collections::HashMap;

use tracing::warn;

use crate::bpf::abi::OffCpuKey;
use crate::bpf::OnCpuProbes;
use crate::collect::off_cpu::WaitWithoutStack;
use crate::collect::session::WaitSource;
use crate::collect::Session;

/// One tracker per source of totals: the sampler's and the tracer's.
#[derive(Default)]
pub struct Trackers {
    sampled: Tracker,
    traced: Tracker,
}

impl Trackers {
    /// Adds the time that grew since the last call to the session's off-CPU stacks.
    pub fn add_new_waits(&mut self, probes: &mut OnCpuProbes, session: &mut Session) {
        if session.off_cpu.samples() {
            self.sampled.add_new_waits(probes, session, WaitSource::Sampled);
        }
        if session.off_cpu.traces() {
            self.traced.add_new_waits(probes, session, WaitSource::Traced);
            // Long waits still going on are shipped as far as they went: a backend blocked
            // for the whole interval is in it.
            match probes.open_off_cpu_waits() {
                Ok(open) => session.ship_open_waits(&open),
                Err(error) => warn!("cannot read the off-CPU waits still open: {error:#}"),
            }
        }
    }
}

#[derive(Default)]
struct Tracker {
    /// Nanoseconds already handed to the session, per key.
    taken: HashMap<OffCpuKey, u64>,
}

impl Tracker {
    fn add_new_waits(&mut self, probes: &mut OnCpuProbes, session: &mut Session, source: WaitSource) {
        let totals = match source {
            WaitSource::Sampled => probes.wait_sample_totals(),
            WaitSource::Traced => probes.off_cpu_totals(),
        };
        let totals = match totals {
            Ok(totals) => totals,
            Err(error) => {
                warn!("cannot read the off-CPU totals: {error:#}");
                return;
            }
        };
        let mut waits = Vec::new();
        let mut exited = Vec::new();
        let mut taken = HashMap::with_capacity(totals.len());
        for (key, total) in totals {
            let before = self.taken.get(&key).copied().unwrap_or(0);
            let grown = total.ns.saturating_sub(before);
            if grown > 0 {
                waits.push(WaitWithoutStack {
                    tgid: key.tgid,
                    attr: key.attr,
                    ns: grown,
                    still_open: false,
                });
            }
            if crate::liveness::exists(key.tgid) {
                taken.insert(key, total.ns);
            } else {
                exited.push(key);
            }
        }
        // Keys that left the map are forgotten with it.
        self.taken = taken;
        session.add_waits_without_stack(waits.into_iter(), source);
        let removed = match source {
            WaitSource::Sampled => probes.remove_wait_sample_totals(&exited),
            WaitSource::Traced => probes.remove_off_cpu_totals(&exited),
        };
        if let Err(error) = removed {
            warn!("cannot remove the off-CPU totals of exited processes: {error:#}");
        }
    }
}
