//! Finding the Postgres instances on the host: every postmaster (a postgres process whose parent
//! is not one), filtered by the configured include/exclude lists. Backends are not looked for
//! here: they fork from their postmaster and the BPF fork tracepoint follows them.

use std::collections::{HashMap, HashSet};
use std::fs;

use super::config::{DiscoveryConfig, InstanceFilter};
use crate::collect::InstanceFacts;
use crate::target::ProcessInfo;

/// A postmaster found by a scan.
#[derive(Clone, Debug)]
pub struct FoundPostmaster {
    pub postmaster: ProcessInfo,
    pub facts: InstanceFacts,
}

/// Every postmaster running now that the configuration lets in, by PID. `children` are
/// processes known to be children of an instance already profiled (the kernel's filter follows
/// their forks and drops them when they exit or exec): none of them can be a postmaster, and
/// not reading them keeps a scan's cost to the host's other processes rather than growing with
/// every connected backend (three /proc reads each, every scan).
///
/// An instance's facts are read once per postmaster (`facts`, keyed by its PID and start
/// time): finding its cluster name lists every process on the host.
pub fn scan(
    config: &DiscoveryConfig,
    children: &HashSet<u32>,
    facts: &mut FactsCache,
) -> Vec<FoundPostmaster> {
    let Ok(entries) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut found: Vec<FoundPostmaster> = entries
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| !children.contains(pid))
        .filter_map(ProcessInfo::read)
        .filter(|process| process.is_postgres())
        .filter(|process| !ProcessInfo::read(process.ppid).is_some_and(|parent| parent.is_postgres()))
        .map(|postmaster| FoundPostmaster {
            facts: facts.of(postmaster.pid),
            postmaster,
        })
        .collect();
    facts.keep_only(found.iter().map(|f| f.postmaster.pid));
    found.retain(|found| admitted(config, &found.facts));
    found.sort_by_key(|found| found.postmaster.pid);
    found
}

/// The facts of the postmasters found so far: they do not change while a postmaster runs (its
/// data directory, port, binary, major, container and cluster name are fixed at its start).
#[derive(Default)]
pub struct FactsCache {
    by_pid: HashMap<u32, (Option<u64>, InstanceFacts)>,
}

impl FactsCache {
    /// The facts of postmaster `pid`, read when it is new (or its PID now names another
    /// process: the start time differs).
    fn of(&mut self, pid: u32) -> InstanceFacts {
        let started = start_time(pid);
        match self.by_pid.get(&pid) {
            Some((when, facts)) if started.is_some() && *when == started => facts.clone(),
            _ => {
                let facts = InstanceFacts::read(pid);
                self.by_pid.insert(pid, (started, facts.clone()));
                facts
            }
        }
    }

    /// Forgets postmasters no longer running.
    fn keep_only(&mut self, running: impl Iterator<Item = u32>) {
        let running: HashSet<u32> = running.collect();
        self.by_pid.retain(|pid, _| running.contains(pid));
    }
}

/// When process `pid` started (clock ticks since boot, /proc/PID/stat's 22nd field): with its
/// PID, what tells one process from a later one given the same PID.
fn start_time(pid: u32) -> Option<u64> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name, which may hold spaces and parentheses: state is the 3rd.
    let rest = stat.get(stat.rfind(')')? + 1..)?;
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// Whether the configuration lets an instance in: it matches an include (when any are given)
/// and no exclude.
pub fn admitted(config: &DiscoveryConfig, facts: &InstanceFacts) -> bool {
    let included = config.include.is_empty() || config.include.iter().any(|filter| matches(filter, facts));
    included && !config.exclude.iter().any(|filter| matches(filter, facts))
}

fn matches(filter: &InstanceFilter, facts: &InstanceFacts) -> bool {
    let data_dir = filter
        .data_dir
        .as_ref()
        .is_none_or(|wanted| facts.data_dir.as_ref().is_some_and(|dir| same_path(dir, wanted)));
    let port = filter.port.is_none_or(|wanted| facts.port == Some(wanted));
    let binary = filter.binary.as_ref().is_none_or(|wanted| {
        facts
            .binary
            .as_ref()
            .is_some_and(|binary| same_path(binary, wanted))
    });
    data_dir && port && binary
}

/// Paths compare after resolving symlinks, so `/var/lib/postgresql/15/main` matches however
/// the data directory was named on the command line.
fn same_path(actual: &std::path::Path, wanted: &std::path::Path) -> bool {
    let wanted = fs::canonicalize(wanted).unwrap_or_else(|_| wanted.to_path_buf());
    let actual = fs::canonicalize(actual).unwrap_or_else(|_| actual.to_path_buf());
    actual == wanted
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    #[test]
    fn a_process_start_time_is_read_and_tells_processes_apart() {
        let ours = start_time(std::process::id()).expect("our own start time");
        assert_eq!(start_time(std::process::id()), Some(ours));
        // init started first.
        assert!(start_time(1).is_some_and(|init| init <= ours));
        assert_eq!(start_time(u32::MAX), None);
    }

    #[test]
    fn facts_are_read_once_per_postmaster_and_forgotten_when_it_is_gone() {
        let mut cache = FactsCache::default();
        let pid = std::process::id();
        let first = cache.of(pid);
        // A cached entry is what is returned: change it, and the change shows.
        if let Some((_, facts)) = cache.by_pid.get_mut(&pid) {
            facts.port = Some(1);
        }
        assert_eq!(cache.of(pid).port, Some(1));
        assert_ne!(first.port, Some(1));
        cache.keep_only(std::iter::empty());
        assert!(cache.by_pid.is_empty());
    }

    fn facts(dir: &str, port: u16) -> InstanceFacts {
        InstanceFacts {
            data_dir: Some(PathBuf::from(dir)),
            port: Some(port),
            binary: Some(PathBuf::from("/usr/lib/postgresql/15/bin/postgres")),
            ..InstanceFacts::default()
        }
    }

    #[test]
    fn include_and_exclude_select_instances() {
        let a = facts("/data/a", 5432);
        let b = facts("/data/b", 5433);
        let mut config = DiscoveryConfig::default();
        assert!(admitted(&config, &a) && admitted(&config, &b));
        config.exclude.push(InstanceFilter {
            port: Some(5433),
            ..InstanceFilter::default()
        });
        assert!(admitted(&config, &a) && !admitted(&config, &b));
        config.exclude.clear();
        config.include.push(InstanceFilter {
            data_dir: Some(PathBuf::from("/data/b")),
            ..InstanceFilter::default()
        });
        assert!(!admitted(&config, &a) && admitted(&config, &b));
        config.include[0].binary = Some(PathBuf::from("/usr/lib/postgresql/16/bin/postgres"));
        assert!(!admitted(&config, &b), "every field of a filter must match");
    }
}
