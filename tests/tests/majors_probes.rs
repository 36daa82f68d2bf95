//! The seven function probes on every supported major's real server binaries: each test runs
//! [`check_probes`] on one build and prints one `major=NN build=LABEL probes=ok|FAIL` line with
//! every count as measured/expected, then fails on any disagreement.

use anyhow::{bail, Result};
use pgscope_tests::probe_matrix::check_probes;
use pgscope_tests::{require_root_and_bpf, PgInstall};

/// Prints the build's line whatever happens, then fails unless every count is right.
fn check(install: Result<PgInstall>) -> Result<()> {
    let install = install?;
    match check_probes(&install) {
        Ok(counts) => {
            eprintln!("{}", counts.summary());
            if !counts.ok() {
                bail!("{}", counts.failures.join("\n"));
            }
            Ok(())
        }
        Err(error) => {
            eprintln!(
                "major={} build={} probes=FAIL (the check could not run: {error:#})",
                install.major, install.label
            );
            Err(error)
        }
    }
}

#[test]
fn major_14_upstream() -> Result<()> {
    require_root_and_bpf();
    check(PgInstall::upstream(14))
}

/// Stripped, no debug file: pgss_store is only found through the hook functions, checked by
/// its counts (no symbol anywhere to compare its offset with).
#[test]
fn major_15_distro() -> Result<()> {
    require_root_and_bpf();
    check(PgInstall::distro())
}

/// Its debug file names pgss_store, in a build-id tree pgscope is not told about.
#[test]
fn major_15_no_frame_pointers() -> Result<()> {
    require_root_and_bpf();
    check(PgInstall::no_frame_pointers())
}

#[test]
fn major_16_upstream() -> Result<()> {
    require_root_and_bpf();
    check(PgInstall::upstream(16))
}

#[test]
fn major_17_upstream() -> Result<()> {
    require_root_and_bpf();
    check(PgInstall::upstream(17))
}

#[test]
fn major_18_upstream() -> Result<()> {
    require_root_and_bpf();
    check(PgInstall::upstream(18))
}
