//! What a Postgres backend's stack looks like while it runs a simple-protocol query (PG 15):
//! `main` → `PostmasterMain` → `ServerLoop` → `BackendStartup` → `BackendRun` → `PostgresMain`
//! → `exec_simple_query` → `PortalRun` → … executor. `ServerLoop`, `BackendStartup`,
//! `BackendRun` and `exec_simple_query` are static; the stripped distro build has no names for
//! them (the first three are inlined into one unnamed frame there).

use crate::perf::PERF_UNKNOWN;
use crate::profile::is_unnamed_postgres_frame;

/// Whether the profiler can name static Postgres functions (it has a debug file).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Statics {
    /// Debug info available: `exec_simple_query` appears by name.
    Named,
    /// Stripped binary only: statics show as `postgres+0x…` (pgscope) or `[unknown]` (perf).
    Unnamed,
}

/// `true` if `user_frames` (root first) show `PostgresMain`, directly followed by
/// `exec_simple_query` (or, with [`Statics::Unnamed`], an unnamed postgres frame), with
/// `PortalRun` further down.
pub fn runs_under_exec_simple_query(user_frames: &[String], statics: Statics) -> bool {
    let Some(main_at) = user_frames.iter().position(|f| f == "PostgresMain") else {
        return false;
    };
    let Some(next) = user_frames.get(main_at + 1) else {
        return false;
    };
    let next_ok = match statics {
        Statics::Named => next == "exec_simple_query",
        Statics::Unnamed => is_unnamed_postgres_frame(next) || next == PERF_UNKNOWN,
    };
    next_ok && user_frames[main_at + 2..].iter().any(|f| f == "PortalRun")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frames(s: &str) -> Vec<String> {
        s.split(';').map(String::from).collect()
    }

    #[test]
    fn recognises_the_query_chain() {
        let distro =
            frames("main;PostmasterMain;postgres+0x3f930b;PostgresMain;postgres+0x47c61c;PortalRun;int4mod");
        assert!(runs_under_exec_simple_query(&distro, Statics::Unnamed));
        assert!(!runs_under_exec_simple_query(&distro, Statics::Named));
        let nofp = frames(
            "main;PostmasterMain;ServerLoop;PostgresMain;exec_simple_query;PortalRun;PortalRunSelect;int4mod",
        );
        assert!(runs_under_exec_simple_query(&nofp, Statics::Named));
        assert!(!runs_under_exec_simple_query(
            &frames("PostgresMain;exec_simple_query;int4mod"),
            Statics::Named
        ));
    }
}
