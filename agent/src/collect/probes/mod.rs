//! Function probes of the collection core: which Postgres functions to probe (`--probes`,
//! `--probe`, the agent's `[probes]`), where they are, attaching them, and the shared duty
//! cycle that keeps their cost within a budget. `trace` reads their counts once at the end;
//! the agent reads them every upload interval.

pub mod calibrate;
mod duty;
pub mod nested;
mod set;
pub mod statement_clock;
mod triggers;

use std::path::PathBuf;

use anyhow::{bail, Context, Result};

use crate::bpf::abi::Function;
#[cfg(test)]
pub use set::StatementShare;
pub use set::{IntervalShare, IntervalShares, PidsByRoot, ProbeSet, ProbeState};
pub use triggers::{LocatedTriggerProbes, TriggerProbes};

/// Parses `--probes` items: function names, or `all` (the seven pgscope knows). A name that
/// is not one of the seven is probed by name: it must be a function the instance's files
/// export or their debug files name, which is checked where the probes are located.
pub fn parse_probe_list(items: &[String]) -> Result<Vec<Function>> {
    let mut functions = Vec::new();
    for item in items {
        if item == "all" {
            functions.extend(Function::ALL);
            continue;
        }
        let function = Function::named(item).with_context(|| {
            format!(
                "cannot probe `{item}`: name a function, one of {} or any other, or `all`",
                Function::ALL.map(|f| f.name()).join(", ")
            )
        })?;
        functions.push(function);
    }
    functions.sort();
    functions.dedup();
    Ok(functions)
}

/// The file name of process `pid`'s executable (`postgres`), the module its functions are
/// looked up in.
fn executable_name(pid: u32) -> Result<String> {
    let exe = std::fs::read_link(format!("/proc/{pid}/exe"))
        .with_context(|| format!("cannot resolve the executable of PID {pid}"))?;
    Ok(exe
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default())
}

/// The device and inode of process `pid`'s executable: the same file seen through different
/// paths (a container's root) is one, and one uprobe serves every process running it.
pub fn executable_file(pid: u32) -> std::io::Result<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(format!("/proc/{pid}/exe")).map(|meta| (meta.dev(), meta.ino()))
}

/// `--probe FUNCTION=PATH:OFFSET`: where a function is, given by the user (e.g. from `nm` on a
/// debug file kept elsewhere, or a disassembly), for files pgscope cannot name it in.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExplicitProbe {
    pub function: Function,
    pub path: PathBuf,
    /// Offset of the function's first instruction in the file (not its virtual address).
    pub file_offset: u64,
}

/// Parses `FUNCTION=PATH:OFFSET`; the offset is hexadecimal with `0x`, else decimal.
pub fn parse_explicit_probe(text: &str) -> Result<ExplicitProbe> {
    let (name, location) = text
        .split_once('=')
        .context("expected FUNCTION=PATH:OFFSET, e.g. pgss_store=/usr/lib/postgresql/15/lib/pg_stat_statements.so:0x4d80")?;
    let [function] = parse_probe_list(&[name.to_string()])?[..] else {
        bail!("`{name}` names more than one function; give one per --probe");
    };
    let (path, offset) = location
        .rsplit_once(':')
        .with_context(|| format!("`{location}` has no `:OFFSET`"))?;
    let file_offset = match offset.strip_prefix("0x").or_else(|| offset.strip_prefix("0X")) {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => offset.parse(),
    }
    .with_context(|| format!("`{offset}` is not a file offset (hexadecimal with 0x, or decimal)"))?;
    if path.is_empty() {
        bail!("`{text}` has an empty path");
    }
    Ok(ExplicitProbe {
        function,
        path: PathBuf::from(path),
        file_offset,
    })
}

/// How a function's measured counts relate to the whole trace.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Extrapolation {
    pub factor: f64,
    pub extrapolated: bool,
    /// Share of the trace the probe was attached (its effective duty cycle).
    pub attached_share: f64,
}

impl Default for Extrapolation {
    fn default() -> Self {
        Self {
            factor: 1.0,
            extrapolated: false,
            attached_share: 1.0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_list_accepts_names_and_all() {
        let parsed = parse_probe_list(&["LockRelationOid".into(), "_bt_getroot".into()]).expect("valid");
        assert_eq!(parsed, vec![Function::LockRelationOid, Function::BtGetroot]);
        assert_eq!(
            parse_probe_list(&["all".into()]).expect("valid").len(),
            Function::ALL.len()
        );
        // Any other function is probed by name (tested with the registry in bpf::abi, which
        // this test leaves alone: it is the process's); what is no C name is refused.
        let err = parse_probe_list(&["LockRelation Oid".into()]).expect_err("not a name");
        assert!(format!("{err:#}").contains("LockRelationOid"), "{err:#}");
    }

    #[test]
    fn explicit_probes_name_a_function_a_file_and_an_offset() {
        let probe =
            parse_explicit_probe("pgss_store=/usr/lib/x:y/pg_stat_statements.so:0x4d80").expect("valid");
        assert_eq!(
            probe,
            ExplicitProbe {
                function: Function::PgssStore,
                path: PathBuf::from("/usr/lib/x:y/pg_stat_statements.so"),
                file_offset: 0x4d80
            }
        );
        assert_eq!(
            parse_explicit_probe("s_lock=/bin/postgres:4096")
                .expect("valid")
                .file_offset,
            4096
        );
        for bad in [
            "pgss_store",
            "pgss_store=/x.so",
            "pgss_store=/x.so:zz",
            "all=/x.so:0x10",
            "no such=/x.so:0x10",
            "pgss_store=:0x10",
        ] {
            assert!(parse_explicit_probe(bad).is_err(), "{bad} accepted");
        }
    }
}
