//! Finding the Postgres instances on the host: every postmaster (a postgres process whose parent
//! is not one), filtered by the configured include/exclude lists. Backends are not looked for
//! here: they fork from their postmaster and the BPF fork tracepoint follows them.

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

/// Every postmaster running now that the configuration lets in, by PID.
pub fn scan(config: &DiscoveryConfig) -> Vec<FoundPostmaster> {
    let Ok(entries) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut found: Vec<FoundPostmaster> = entries
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(ProcessInfo::read)
        .filter(|process| process.is_postgres())
        .filter(|process| !ProcessInfo::read(process.ppid).is_some_and(|parent| parent.is_postgres()))
        .map(|postmaster| FoundPostmaster {
            facts: InstanceFacts::read(postmaster.pid),
            postmaster,
        })
        .filter(|found| admitted(config, &found.facts))
        .collect();
    found.sort_by_key(|found| found.postmaster.pid);
    found
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
