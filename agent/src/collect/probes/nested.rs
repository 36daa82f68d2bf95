//! Probe traps inside probed calls. A call's time runs from its entry to its return, so the
//! traps of other probed functions it calls (`LockRelationOid` under `GetCachedPlan`, `s_lock`
//! under `pgss_store`) are counted as its own time: with a hundred nested calls the outer
//! function looks several times costlier than it is. The BPF side counts, per call, the traps
//! its thread took between its entry and its return (`nested_traps`); this takes their
//! calibrated cost out.

use crate::bpf::abi::CallStats;

/// Traps one probed call takes: its entry and its return. The calibration measures both
/// together (ns per hit, a hit being one call).
const TRAPS_PER_HIT: f64 = 2.0;

/// Nanoseconds `nested_traps` traps cost at `ns_per_hit` (the calibrated cost of a probed call,
/// entry and return together).
pub fn nested_trap_ns(nested_traps: u64, ns_per_hit: f64) -> u64 {
    (nested_traps as f64 * ns_per_hit.max(0.0) / TRAPS_PER_HIT).round() as u64
}

/// `stats.total_ns` without the traps of nested probed calls; never below zero (a calibration
/// a little high against a function that does little besides calling probed ones).
pub fn corrected_total_ns(stats: &CallStats, ns_per_hit: f64) -> u64 {
    stats
        .total_ns
        .saturating_sub(nested_trap_ns(stats.nested_traps, ns_per_hit))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nested_traps_are_taken_out_at_half_a_hit_each() {
        // GetCachedPlan: 10 calls, 2 ms in all, 67 LockRelationOid calls each under it (134
        // traps per call), a probed call costing 2 µs: 1.34 ms of the 2 ms were traps.
        let stats = CallStats {
            calls: 10,
            total_ns: 2_000_000,
            nested_traps: 1340,
            ..Default::default()
        };
        assert_eq!(nested_trap_ns(1340, 2000.0), 1_340_000);
        assert_eq!(corrected_total_ns(&stats, 2000.0), 660_000);
        // No nested probe: nothing taken out.
        let alone = CallStats {
            nested_traps: 0,
            ..stats
        };
        assert_eq!(corrected_total_ns(&alone, 2000.0), 2_000_000);
        // A calibration higher than what was measured: zero, not a wrap-around.
        assert_eq!(corrected_total_ns(&stats, 5000.0), 0);
        assert_eq!(nested_trap_ns(10, -1.0), 0);
    }
}
