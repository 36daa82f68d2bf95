//! Finding pg_stat_statements' static `pgss_store` without a debug file. Distros ship
//! `pg_stat_statements.so` stripped, so the name is gone; but the library installs its hook
//! functions into hook variables the postgres executable exports, and the hooks that record
//! statistics all call `pgss_store` directly. Reading those variables in a live process gives
//! the hook functions; the one function that all of them call is `pgss_store`.

use std::collections::BTreeSet;
use std::path::Path;

use anyhow::{Context, Result};
use symbolizer::{read_maps, FindFunctionError, FunctionLocation, MapEntry, Symbolizer};
use tracing::debug;

use super::memory;

/// The library the hooks must point into.
const LIBRARY: &str = "pg_stat_statements.so";
const PGSS_STORE: &str = "pgss_store";

/// Hook variables (function pointers exported by the postgres executable, PG13-18) whose
/// pg_stat_statements hook calls `pgss_store`: analysis (normalized text), planning (with
/// `track_planning`), executor end, utility statements. Its ExecutorStart/Run/Finish hooks only
/// count nesting levels and are left out.
const HOOK_VARIABLES: [&str; 4] = [
    "post_parse_analyze_hook",
    "planner_hook",
    "ExecutorEnd_hook",
    "ProcessUtility_hook",
];

/// Every hook variable pg_stat_statements installs a function into that runs per statement, and
/// that function's name in its source (the same in 13 to 18): a function of the library a hook
/// variable holds is that one, however stripped the library is.
const HOOK_FUNCTIONS: [(&str, &str); 7] = [
    ("post_parse_analyze_hook", "pgss_post_parse_analyze"),
    ("planner_hook", "pgss_planner"),
    ("ExecutorStart_hook", "pgss_ExecutorStart"),
    ("ExecutorRun_hook", "pgss_ExecutorRun"),
    ("ExecutorFinish_hook", "pgss_ExecutorFinish"),
    ("ExecutorEnd_hook", "pgss_ExecutorEnd"),
    ("ProcessUtility_hook", "pgss_ProcessUtility"),
];

/// Fewer hook functions than this can not single out `pgss_store`: one function's callees
/// are all candidates.
const MIN_HOOKS: usize = 2;

/// The direct callees (file offsets) of the pg_stat_statements function one hook variable holds.
#[derive(Clone, Debug)]
pub struct HookCallees {
    pub hook: &'static str,
    pub callees: BTreeSet<u64>,
}

/// Why the hook functions do not single out `pgss_store`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error(
        "{} of the hook variables hold a function of {LIBRARY}{}, at least {MIN_HOOKS} are needed \
         (pg_stat_statements installs its hooks only from shared_preload_libraries, and an \
         extension loaded after it may have chained in front of them)",
        .hooks.len(), parenthesized(.hooks)
    )]
    TooFewHooks { hooks: Vec<&'static str> },
    #[error("the functions in {} call no function of {LIBRARY} in common", .hooks.join(", "))]
    NoCommonCallee { hooks: Vec<&'static str> },
    #[error(
        "the functions in {} call {} functions of {LIBRARY} in common (file offsets {}), not one",
        .hooks.join(", "), .offsets.len(), hex_list(.offsets)
    )]
    Ambiguous {
        hooks: Vec<&'static str>,
        offsets: Vec<u64>,
    },
}

/// The one function every hook calls directly: `pgss_store`.
pub fn common_callee(hooks: &[HookCallees]) -> Result<u64, Refusal> {
    let names = || hooks.iter().map(|h| h.hook).collect::<Vec<_>>();
    let Some((first, rest)) = hooks.split_first().filter(|_| hooks.len() >= MIN_HOOKS) else {
        return Err(Refusal::TooFewHooks { hooks: names() });
    };
    let common: Vec<u64> = first
        .callees
        .iter()
        .copied()
        .filter(|offset| rest.iter().all(|h| h.callees.contains(offset)))
        .collect();
    match common.as_slice() {
        [only] => Ok(*only),
        [] => Err(Refusal::NoCommonCallee { hooks: names() }),
        _ => Err(Refusal::Ambiguous {
            hooks: names(),
            offsets: common,
        }),
    }
}

/// Where `pgss_store` is in process `pid` (a process of an instance that loaded
/// pg_stat_statements, e.g. through `shared_preload_libraries`), found from the hook functions
/// installed in its memory; no symbol or debug file is used.
pub fn find_pgss_store(symbolizer: &mut Symbolizer, pid: u32) -> Result<FunctionLocation> {
    let variables = symbolizer::executable_globals(pid, &HOOK_VARIABLES)
        .with_context(|| format!("reading the symbols of PID {pid}'s executable"))?;
    let maps = read_maps(pid).with_context(|| format!("reading the memory maps of PID {pid}"))?;

    let mut hooks = Vec::new();
    let mut path = None;
    // What each variable held, for the error when they do not single out pgss_store.
    let mut seen = Vec::new();
    for hook in HOOK_VARIABLES {
        let Some(&variable) = variables.get(hook) else {
            seen.push(format!("{hook} not exported"));
            continue;
        };
        let function = memory::read_u64(pid, variable)
            .with_context(|| format!("reading `{hook}` at {variable:#x} in PID {pid}"))?;
        let file = file_at(&maps, function);
        seen.push(match (function, file) {
            (0, _) => format!("{hook} unset"),
            (_, Some(file)) => format!("{hook} in {file}"),
            (_, None) => format!("{hook} at {function:#x} in no file"),
        });
        // An extension loaded after pg_stat_statements (auto_explain, pg_hint_plan) may have
        // chained its own function in front: that one calls pg_stat_statements' through a
        // pointer only, and tells nothing.
        if file != Some(LIBRARY) {
            continue;
        }
        let found = symbolizer
            .direct_callees(pid, function)
            .with_context(|| format!("decoding the function `{hook}` points to"))?;
        path = Some(found.path);
        hooks.push(HookCallees {
            hook,
            callees: found.callees,
        });
    }
    let seen = seen.join(", ");
    debug!(pid, hooks = %seen, "pg_stat_statements' hook variables");
    let file_offset = common_callee(&hooks).with_context(|| format!("hook variables: {seen}"))?;
    // Set with the first hook considered, and common_callee needs two.
    let path = path.context("no hook function was decoded")?;
    Ok(FunctionLocation {
        path,
        file_offset,
        debug_file: None,
    })
}

/// Names `pgss_store` in stacks where nothing else does: when process `pid` maps
/// pg_stat_statements.so and neither the library nor a debug file has the symbol, the function
/// all its hook functions call is named `pgss_store`, in every process mapping the file.
/// Returns the function's file offset when it was named this way; None when a symbol names it
/// already, the library is not loaded, or the hooks do not single it out (logged).
pub fn name_in_stacks(symbolizer: &mut Symbolizer, pid: u32) -> Option<u64> {
    match symbolizer.find_function(pid, LIBRARY, PGSS_STORE) {
        Err(FindFunctionError::NoSymbol { .. }) => {}
        // Named by a symbol already, or not loaded.
        Ok(_) | Err(_) => return None,
    }
    let hooks = name_hook_functions(symbolizer, pid);
    debug!(
        pid,
        hooks, "pg_stat_statements' hook functions named through the hook variables"
    );
    let location = find_pgss_store(symbolizer, pid)
        .map_err(|error| debug!(pid, "pgss_store stays unnamed in stacks: {error:#}"))
        .ok()?;
    symbolizer
        .name_function(pid, LIBRARY, location.file_offset, PGSS_STORE)
        .then_some(location.file_offset)
}

/// Names pg_stat_statements' hook functions (`pgss_post_parse_analyze`, `pgss_ExecutorEnd`, …)
/// by the hook variables of process `pid` that hold them, where no symbol names them: without
/// it a stripped library's frames around `pgss_store` read `pg_stat_statements.so+0x…`. A
/// variable holding another library's function (an extension chained in front) names nothing.
/// Returns how many were named.
fn name_hook_functions(symbolizer: &mut Symbolizer, pid: u32) -> usize {
    let names: Vec<&str> = HOOK_FUNCTIONS.iter().map(|(variable, _)| *variable).collect();
    let (Ok(variables), Ok(maps)) = (symbolizer::executable_globals(pid, &names), read_maps(pid)) else {
        return 0;
    };
    let mut named = 0;
    for (variable, function_name) in HOOK_FUNCTIONS {
        let Some(function) = variables
            .get(variable)
            .and_then(|&address| memory::read_u64(pid, address).ok())
            .filter(|&function| function != 0 && file_at(&maps, function) == Some(LIBRARY))
        else {
            continue;
        };
        // The function's start, from its FDE: the variable holds it, but check.
        let Ok(found) = symbolizer.direct_callees(pid, function) else {
            continue;
        };
        if symbolizer.name_function(pid, LIBRARY, found.function_offset, function_name) {
            named += 1;
        }
    }
    named
}

/// Basename of the file mapped at `addr`.
fn file_at(maps: &[MapEntry], addr: u64) -> Option<&str> {
    maps.iter()
        .find(|m| m.contains(addr))
        .and_then(MapEntry::file_path)
        .and_then(Path::file_name)
        .and_then(|name| name.to_str())
}

fn parenthesized(hooks: &[&str]) -> String {
    match hooks {
        [] => String::new(),
        _ => format!(" ({})", hooks.join(", ")),
    }
}

fn hex_list(offsets: &[u64]) -> String {
    offsets
        .iter()
        .map(|o| format!("{o:#x}"))
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hook(hook: &'static str, callees: &[u64]) -> HookCallees {
        HookCallees {
            hook,
            callees: callees.iter().copied().collect(),
        }
    }

    #[test]
    fn the_one_function_all_hooks_call_is_found() {
        let hooks = [
            hook("post_parse_analyze_hook", &[0x4130]),
            hook("planner_hook", &[0x4130, 0x3900, 0x5000]),
            hook("ExecutorEnd_hook", &[0x3900, 0x4130]),
        ];
        assert_eq!(common_callee(&hooks), Ok(0x4130));
        assert_eq!(
            common_callee(&hooks[1..]),
            Err(Refusal::Ambiguous {
                hooks: vec!["planner_hook", "ExecutorEnd_hook"],
                offsets: vec![0x3900, 0x4130],
            })
        );
    }

    #[test]
    fn no_common_callee_or_too_few_hooks_are_refused() {
        let disjoint = [
            hook("planner_hook", &[0x1000]),
            hook("ExecutorEnd_hook", &[0x2000]),
        ];
        assert_eq!(
            common_callee(&disjoint),
            Err(Refusal::NoCommonCallee {
                hooks: vec!["planner_hook", "ExecutorEnd_hook"],
            })
        );
        // A single hook's callees would all be candidates, even when it calls only one.
        let single = [hook("ExecutorEnd_hook", &[0x4130])];
        let refusal = common_callee(&single).expect_err("one hook is not enough");
        assert_eq!(
            refusal,
            Refusal::TooFewHooks {
                hooks: vec!["ExecutorEnd_hook"],
            }
        );
        let message = refusal.to_string();
        assert!(
            message.starts_with("1 of the hook variables hold a function of pg_stat_statements.so"),
            "{message}"
        );
        assert!(
            message.contains("(ExecutorEnd_hook), at least 2 are needed"),
            "{message}"
        );
        assert_eq!(common_callee(&[]), Err(Refusal::TooFewHooks { hooks: vec![] }));
    }
}
