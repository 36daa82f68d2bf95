//! `s_lock` call sites: which spinlock acquisitions spin. Postgres calls `s_lock(lock, file,
//! line, func)` only when a `SpinLockAcquire` finds the lock taken, passing the call site's
//! `__FILE__`, `__LINE__` and `__func__`; the BPF probe keeps the two string pointers, and
//! they are read here from the process's memory once per distinct address.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;

use crate::bpf::abi::{SpinSiteKey, SpinSiteStats};
use crate::postgres::memory::read_c_string;

/// Longest call-site string read (file paths are relative to the source tree, names short).
const MAX_STRING: usize = 256;

/// One call site under one queryid, over all backends.
#[derive(Clone, Debug, PartialEq)]
pub struct SpinSite {
    pub query_id: i64,
    pub file: String,
    pub line: u32,
    pub function: String,
    /// Scaled to the whole trace when s_lock was duty-cycled.
    pub stats: SpinSiteStats,
    /// Calls measured while the probe was attached: what `stats.calls` rests on.
    pub measured_calls: u64,
}

/// Resolves the call sites' strings and merges backends. A string is read from the process
/// that made the call, else from `fallback_pid` (the traced backend or the postmaster, which
/// map the same files at the same addresses as their children); an unreadable one is shown
/// as its address rather than dropped, so that no call is lost from the totals.
pub fn resolve(raw: &[(SpinSiteKey, SpinSiteStats)], fallback_pid: u32) -> Vec<SpinSite> {
    let mut strings: HashMap<(u32, u64), String> = HashMap::new();
    let mut read = |tgid: u32, address: u64| -> String {
        strings
            .entry((tgid, address))
            .or_insert_with(|| {
                read_c_string(tgid, address, MAX_STRING)
                    .or_else(|_| read_c_string(fallback_pid, address, MAX_STRING))
                    .unwrap_or_else(|error| {
                        tracing::debug!(%error, tgid, address, "s_lock call-site string unreadable");
                        format!("{address:#x}")
                    })
            })
            .clone()
    };
    let mut merged: BTreeMap<(i64, String, u32, String), SpinSiteStats> = BTreeMap::new();
    for (key, stats) in raw {
        let site = (
            key.query_id as i64,
            tidy_path(&read(key.tgid, key.file)),
            key.line,
            read(key.tgid, key.func),
        );
        merged.entry(site).or_default().merge(stats);
    }
    let mut sites: Vec<SpinSite> = merged
        .into_iter()
        .map(|((query_id, file, line, function), stats)| SpinSite {
            query_id,
            file,
            line,
            function,
            measured_calls: stats.calls,
            stats,
        })
        .collect();
    sites.sort_by(|a, b| {
        b.stats
            .total_ns
            .cmp(&a.stats.total_ns)
            .then(b.stats.calls.cmp(&a.stats.calls))
    });
    sites
}

/// `__FILE__` as the build saw it, without the build directory's detours: Debian's
/// `./build/../contrib/x/x.c` becomes `contrib/x/x.c`.
fn tidy_path(path: &str) -> String {
    let mut parts: Vec<&str> = Vec::new();
    for part in path.split('/') {
        match part {
            "." => {}
            // Doubled slashes; a leading one keeps the path absolute.
            "" if !parts.is_empty() => {}
            ".." if parts.last().is_some_and(|last| *last != ".." && !last.is_empty()) => {
                parts.pop();
            }
            _ => parts.push(part),
        }
    }
    parts.join("/")
}

/// Scales calls and time of every site (the probe was duty-cycled).
pub fn scale(sites: &mut [SpinSite], factor: f64) {
    for site in sites {
        site.stats.calls = (site.stats.calls as f64 * factor).round() as u64;
        site.stats.total_ns = (site.stats.total_ns as f64 * factor).round() as u64;
    }
}

/// The call-site table of the summary, longest total first.
pub fn render(sites: &[SpinSite], limit: usize, out: &mut String) {
    if sites.is_empty() {
        return;
    }
    let _ = writeln!(out, "\nspinlocks waited for, by call site (s_lock):");
    let _ = writeln!(
        out,
        "{:>21} {:>9} {:>9} {:>10} {:>9} {:>9}  call site",
        "queryid", "calls", "measured", "total ms", "avg µs", "max µs"
    );
    for site in sites.iter().take(limit) {
        let avg = site.stats.total_ns as f64 / 1000.0 / site.stats.calls.max(1) as f64;
        let _ = writeln!(
            out,
            "{:>21} {:>9} {:>9} {:>10.2} {:>9.2} {:>9.1}  {}:{} ({})",
            site.query_id,
            site.stats.calls,
            site.measured_calls,
            site.stats.total_ns as f64 / 1e6,
            avg,
            site.stats.max_ns as f64 / 1000.0,
            site.file,
            site.line,
            site.function
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sites_are_named_from_process_memory_and_merged_over_backends() {
        let file = c"pg_stat_statements.c";
        let func = c"pgss_store";
        let pid = std::process::id();
        let key = |tgid| SpinSiteKey {
            tgid,
            line: 1370,
            query_id: 42,
            file: file.as_ptr() as u64,
            func: func.as_ptr() as u64,
        };
        let stats = |calls| SpinSiteStats {
            calls,
            total_ns: calls * 100,
            max_ns: 300,
        };
        // The second "backend" is gone: its strings are read from the fallback process.
        let sites = resolve(&[(key(pid), stats(2)), (key(u32::MAX - 3), stats(5))], pid);
        assert_eq!(
            sites,
            vec![SpinSite {
                query_id: 42,
                file: "pg_stat_statements.c".into(),
                line: 1370,
                function: "pgss_store".into(),
                stats: SpinSiteStats {
                    calls: 7,
                    total_ns: 700,
                    max_ns: 300
                },
                measured_calls: 7,
            }]
        );
    }

    #[test]
    fn build_directory_detours_are_removed_from_file_names() {
        assert_eq!(
            tidy_path("./build/../contrib/pg_stat_statements/pg_stat_statements.c"),
            "contrib/pg_stat_statements/pg_stat_statements.c"
        );
        assert_eq!(tidy_path("freelist.c"), "freelist.c");
        assert_eq!(tidy_path("/usr/src/pg/./a/../b.c"), "/usr/src/pg/b.c");
        assert_eq!(tidy_path("../x.c"), "../x.c");
    }

    #[test]
    fn unreadable_strings_keep_their_calls() {
        let key = SpinSiteKey {
            tgid: u32::MAX - 3,
            line: 7,
            query_id: 0,
            file: 0x10,
            func: 0x20,
        };
        let sites = resolve(&[(key, SpinSiteStats::default())], u32::MAX - 4);
        assert_eq!(sites.len(), 1);
        assert_eq!(
            (sites[0].file.as_str(), sites[0].function.as_str()),
            ("0x10", "0x20")
        );
    }
}
