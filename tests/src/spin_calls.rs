//! `s_lock` calls with call-site arguments the test chooses. `s_lock` runs only when a spinlock
//! is contended, which no workload forces on demand; calling it from gdb inside a backend is a
//! real call with known arguments, in any build that names `s_lock` (`.dynsym` or `.symtab`).

use anyhow::{ensure, Result};

use crate::summary::SpinSite;

/// A call site as read back from a trace: (line, function, calls).
pub type SiteCalls = (u32, String, u64);

/// One call site as Postgres' `SpinLockAcquire` passes it: `__FILE__`, `__LINE__`, `__func__`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CallSite {
    pub file: &'static str,
    pub line: u32,
    pub function: &'static str,
}

/// Makes backend `pid` call `s_lock` once per site, on a free lock of its own (fresh zeroed
/// memory, so that no real lock of the instance is touched): a free lock is taken at once and
/// s_lock returns immediately. One gdb session for all of them; `pid` must be waiting for its
/// client ([`crate::gdb`] says why).
pub fn call_s_lock_in(pid: u32, sites: &[CallSite]) -> Result<()> {
    let mut commands = Vec::new();
    for site in sites {
        // A lock per call: s_lock returns holding it, and a second call on it would spin
        // until Postgres PANICs with "stuck spinlock".
        commands.push("set $lock = (void *) calloc(1, 8)".to_string());
        commands.push(format!(
            "call ((int(*)(void *, const char *, int, const char *)) s_lock)($lock, \"{}\", {}, \"{}\")",
            site.file, site.line, site.function
        ));
    }
    let output = crate::gdb::batch(pid, &commands)?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    // gdb prints `$N = 0` for each call that returned 0 (no delay); `set` prints nothing.
    let returned = stdout.lines().filter(|line| line.ends_with(" = 0")).count();
    ensure!(
        output.status.success() && returned == sites.len(),
        "gdb could not call s_lock {} times in backend {pid}:\n{stdout}\n{}",
        sites.len(),
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(())
}

/// `sites` as read back from a trace: (line, function, calls) of every `spin_sites[]` row whose
/// file is `file`, sorted.
pub fn sites_in_file(sites: &[SpinSite], file: &str) -> Vec<SiteCalls> {
    let mut found: Vec<SiteCalls> = sites
        .iter()
        .filter(|s| s.file == file)
        .map(|s| (s.line, s.function.clone(), s.calls))
        .collect();
    found.sort();
    found
}

/// `sites` each called once, as [`sites_in_file`] gives them back.
pub fn expected_once(sites: &[CallSite]) -> Vec<SiteCalls> {
    let mut expected: Vec<SiteCalls> = sites.iter().map(|s| (s.line, s.function.to_owned(), 1)).collect();
    expected.sort();
    expected
}

/// Whether a site read from a real contended s_lock names a Postgres source location.
pub fn decoded(site: &SpinSite) -> bool {
    site.file.ends_with(".c")
        && site.line > 0
        && !site.function.is_empty()
        && !site.function.starts_with("0x")
}
