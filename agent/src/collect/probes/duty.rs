//! The probes' overhead budget. Every uprobe hit costs a trap (1-3 µs); a hot function such as
//! `LockRelationOid` can be hit 100k times a second. Probes cheap enough stay attached; the hot
//! ones share one duty cycle — attached together for a fixed window, then detached long enough
//! that their estimated cost, `hits/s × ns/hit`, fits what the budget leaves. One shared window
//! keeps ratios between hot functions right (a probe attached makes the workload slower while it
//! is, so probes measured in different windows would see different workloads). Counts measured
//! while attached are scaled by the statements the instance ran over those it ran while the
//! probe was attached (`statement_clock`), and marked as extrapolated.

use std::time::Duration;

/// How long the hot probes stay attached at a time. Attaching and detaching a uprobe patches
/// every process mapping the file and waits for a kernel grace period (measured here: up to
/// ~0.2 s), so windows are long against that; attached time is measured, not assumed.
pub const WINDOW: Duration = Duration::from_millis(500);

/// Duty cycles below this are raised to it: a probe attached less often sees too few calls to
/// say anything.
pub const MIN_DUTY: f64 = 0.02;

/// Splits a budget (ns of CPU per second) over functions of estimated full-time cost `costs`
/// (ns/s each): the cheapest keep all they need, the rest share what is left equally
/// ("water filling"). Returns each function's duty cycle in (0, 1].
pub fn plan_duties(costs: &[f64], budget_ns_per_s: f64) -> Vec<f64> {
    let mut order: Vec<usize> = (0..costs.len()).collect();
    order.sort_by(|&a, &b| costs[a].total_cmp(&costs[b]));
    let mut duties = vec![1.0; costs.len()];
    let mut remaining = budget_ns_per_s.max(0.0);
    for (rank, &i) in order.iter().enumerate() {
        let share = remaining / (order.len() - rank) as f64;
        let cost = costs[i].max(0.0);
        if cost <= share {
            remaining -= cost;
        } else {
            duties[i] = (share / cost).clamp(MIN_DUTY, 1.0);
            remaining -= share;
        }
    }
    duties
}

/// The duty cycle shared by the hot probes, and which probes are hot: the cheap ones (cost at
/// most an equal share of what is left) run full time, the others share one duty cycle such
/// that all together cost `budget_ns_per_s`.
pub fn plan_shared_duty(costs: &[f64], budget_ns_per_s: f64) -> (f64, Vec<bool>) {
    let individual = plan_duties(costs, budget_ns_per_s);
    let hot: Vec<bool> = individual.iter().map(|&d| d < 1.0).collect();
    let cheap_cost: f64 = costs
        .iter()
        .zip(&hot)
        .filter(|(_, &h)| !h)
        .map(|(c, _)| c.max(0.0))
        .sum();
    let hot_cost: f64 = costs
        .iter()
        .zip(&hot)
        .filter(|(_, &h)| h)
        .map(|(c, _)| c.max(0.0))
        .sum();
    if hot_cost <= 0.0 {
        return (1.0, hot);
    }
    let duty = ((budget_ns_per_s.max(0.0) - cheap_cost) / hot_cost).clamp(MIN_DUTY, 1.0);
    (duty, hot)
}

/// The attach/detach schedule of the hot probes.
#[derive(Clone, Debug)]
pub struct DutyCycle {
    duty: f64,
    attached: bool,
    /// Time in the current state.
    in_state: Duration,
}

impl DutyCycle {
    /// A probe that starts attached (its first window measures its hit rate).
    pub fn new() -> Self {
        Self {
            duty: 1.0,
            attached: true,
            in_state: Duration::ZERO,
        }
    }

    /// Share of the time the hot probes are attached (1: always).
    pub fn duty(&self) -> f64 {
        self.duty
    }

    /// Whether the shared window is open now.
    pub fn is_attached(&self) -> bool {
        self.attached
    }

    pub fn set_duty(&mut self, duty: f64) {
        self.duty = duty.clamp(MIN_DUTY, 1.0);
    }

    /// Advances the schedule by `elapsed`; [`DutyCycle::is_attached`] then says whether the
    /// hot probes should be attached.
    pub fn advance(&mut self, elapsed: Duration) {
        self.in_state += elapsed;
        let limit = if self.attached {
            if self.duty >= 1.0 {
                return;
            }
            WINDOW
        } else {
            WINDOW.mul_f64((1.0 - self.duty) / self.duty)
        };
        if self.in_state >= limit {
            self.attached = !self.attached;
            self.in_state = Duration::ZERO;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cheap_probes_run_full_time_and_hot_ones_share_the_rest() {
        // Budget 20 ms/s; PortalStart costs 5 ms/s at full time, LockRelationOid 200 ms/s.
        let duties = plan_duties(&[200e6, 5e6], 20e6);
        assert_eq!(duties[1], 1.0);
        assert!((duties[0] - 15e6 / 200e6).abs() < 1e-9, "{duties:?}");
        // Everything fits: all full time.
        assert_eq!(plan_duties(&[1e6, 2e6], 20e6), vec![1.0, 1.0]);
        // Two hot ones share equally.
        let duties = plan_duties(&[100e6, 100e6], 20e6);
        assert!(
            (duties[0] - 0.1).abs() < 1e-9 && (duties[1] - 0.1).abs() < 1e-9,
            "{duties:?}"
        );
        // Never below the minimum.
        assert_eq!(plan_duties(&[1e12], 1.0), vec![MIN_DUTY]);
    }

    #[test]
    fn hot_probes_share_one_duty_within_the_budget() {
        // PortalStart 5 ms/s stays; LockRelationOid 200 and GetCachedPlan 100 share 15 ms/s.
        let (duty, hot) = plan_shared_duty(&[200e6, 5e6, 100e6], 20e6);
        assert_eq!(hot, vec![true, false, true]);
        assert!((duty - 15e6 / 300e6).abs() < 1e-9, "{duty}");
        assert_eq!(plan_shared_duty(&[1e6, 2e6], 20e6), (1.0, vec![false, false]));
    }

    #[test]
    fn schedule_keeps_the_duty() {
        let mut cycle = DutyCycle::new();
        cycle.set_duty(0.25);
        let tick = Duration::from_millis(10);
        let (mut attached, mut switches) = (Duration::ZERO, 0);
        for _ in 0..4000 {
            let before = cycle.is_attached();
            if before {
                attached += tick;
            }
            cycle.advance(tick);
            if cycle.is_attached() != before {
                switches += 1;
            }
        }
        let share = attached.as_secs_f64() / 40.0;
        assert!((share - 0.25).abs() < 0.02, "attached {share} of the time");
        assert!(switches >= 20, "{switches} switches");
    }

    #[test]
    fn full_duty_never_detaches() {
        let mut cycle = DutyCycle::new();
        for _ in 0..100 {
            cycle.advance(Duration::from_millis(50));
            assert!(cycle.is_attached());
        }
    }
}
