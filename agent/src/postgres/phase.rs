//! Statement phases derived from stacks: which phase function a sample's stack runs under.
//! Free per statement (no probe): the phase is read off names the symbolizer already gives.

/// The phases of a statement, in execution order. Names are label values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Phase {
    Parse,
    Analyze,
    Plan,
    ExecutorStart,
    Run,
    Finish,
    Commit,
}

impl Phase {
    pub const ALL: [Phase; 7] = [
        Phase::Parse,
        Phase::Analyze,
        Phase::Plan,
        Phase::ExecutorStart,
        Phase::Run,
        Phase::Finish,
        Phase::Commit,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Phase::Parse => "parse",
            Phase::Analyze => "analyze",
            Phase::Plan => "plan",
            Phase::ExecutorStart => "executor_start",
            Phase::Run => "run",
            Phase::Finish => "finish",
            Phase::Commit => "commit",
        }
    }

    /// The phase a function marks the start of (exported names, so that stripped distro builds
    /// are covered; static ones such as `finish_xact_command` count when a debug file names them).
    /// The names of every major 14–18 are here together: a stack is of one major, and no name
    /// means one phase in one major and another elsewhere (15 renamed 14's `parse_analyze` and
    /// `pg_analyze_and_rewrite` to their `_fixedparams` forms).
    fn of_function(name: &str) -> Option<Phase> {
        Some(match name {
            "pg_parse_query" | "raw_parser" => Phase::Parse,
            "parse_analyze_fixedparams"
            | "parse_analyze" // 14
            | "pg_analyze_and_rewrite" // 14
            | "pg_analyze_and_rewrite_params" // 14
            | "parse_analyze_varparams"
            | "parse_analyze_withcb"
            | "pg_analyze_and_rewrite_fixedparams"
            | "pg_analyze_and_rewrite_varparams"
            | "pg_analyze_and_rewrite_withcb"
            | "pg_rewrite_query"
            | "QueryRewrite" => Phase::Analyze,
            // GetCachedPlan revalidates (and locks) a cached plan, or plans anew.
            "pg_plan_queries" | "pg_plan_query" | "planner" | "standard_planner" | "GetCachedPlan" => {
                Phase::Plan
            }
            "PortalStart" | "ExecutorStart" | "standard_ExecutorStart" => Phase::ExecutorStart,
            "PortalRun" | "ExecutorRun" | "standard_ExecutorRun" => Phase::Run,
            "PortalDrop"
            | "ExecutorFinish"
            | "standard_ExecutorFinish"
            | "ExecutorEnd"
            | "standard_ExecutorEnd" => Phase::Finish,
            "finish_xact_command" | "CommitTransactionCommand" => Phase::Commit,
            _ => return None,
        })
    }

    /// The phase an executor entry point marks when the portal that runs the statement calls it
    /// (`ProcessQuery` runs the executor's start, run, finish and end under `PortalRun`).
    fn of_executor_call(name: &str) -> Option<Phase> {
        Some(match name {
            "ExecutorStart" | "standard_ExecutorStart" => Phase::ExecutorStart,
            "ExecutorRun" | "standard_ExecutorRun" => Phase::Run,
            "ExecutorFinish" | "standard_ExecutorFinish" | "ExecutorEnd" | "standard_ExecutorEnd" => {
                Phase::Finish
            }
            _ => return None,
        })
    }

    /// Functions by which a portal runs a utility statement (`CALL`, `DO`, `EXPLAIN ANALYZE`,
    /// DDL): the executor calls below one are nested statements', and the utility statement is
    /// running throughout.
    fn is_utility_call(name: &str) -> bool {
        matches!(
            name,
            "PortalRunUtility" | "ProcessUtility" | "standard_ProcessUtility"
        )
    }

    /// The phase of a stack given root first: the phase of the statement the client sent.
    /// - The outermost phase function decides, so that planning a query nested in a running
    ///   function counts as running the outer statement.
    /// - Under `PortalRun`, the first executor entry point below it is the statement's own
    ///   (the portal runs the executor's start, run, finish and end in turn): a `DELETE` whose
    ///   time goes to its foreign keys' AFTER triggers, fired from `ExecutorFinish`, is
    ///   finishing, not running. Executor calls below a utility statement's are nested
    ///   statements', and leave it running.
    pub fn of_stack<'a>(frames_root_first: impl IntoIterator<Item = &'a str>) -> Option<Phase> {
        let mut frames = frames_root_first.into_iter();
        let outermost = frames.by_ref().find_map(Phase::of_function)?;
        if outermost != Phase::Run {
            return Some(outermost);
        }
        for name in frames {
            if Phase::is_utility_call(name) {
                break;
            }
            if let Some(phase) = Phase::of_executor_call(name) {
                return Some(phase);
            }
        }
        Some(outermost)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outermost_phase_function_wins() {
        let stack = [
            "main",
            "PostgresMain",
            "postgres+0x47c300",
            "PortalRun",
            "SPI_execute",
            "pg_plan_query",
        ];
        assert_eq!(Phase::of_stack(stack), Some(Phase::Run));
    }

    #[test]
    fn each_phase_is_recognised() {
        for (function, phase) in [
            ("pg_parse_query", Phase::Parse),
            ("pg_analyze_and_rewrite_fixedparams", Phase::Analyze),
            ("pg_analyze_and_rewrite", Phase::Analyze),
            ("GetCachedPlan", Phase::Plan),
            ("PortalStart", Phase::ExecutorStart),
            ("PortalRun", Phase::Run),
            ("PortalDrop", Phase::Finish),
            ("CommitTransactionCommand", Phase::Commit),
        ] {
            assert_eq!(
                Phase::of_stack(["main", "PostgresMain", function, "leaf"]),
                Some(phase),
                "{function}"
            );
        }
    }

    #[test]
    fn a_statement_finishing_under_its_portal_is_finishing() {
        // A DELETE whose foreign key's AFTER trigger runs a query of its own.
        let stack = [
            "main",
            "PostgresMain",
            "PortalRun",
            "PortalRunMulti",
            "ExecutorFinish",
            "standard_ExecutorFinish",
            "AfterTriggerEndQuery",
            "RI_FKey_noaction_del",
            "SPI_execute_snapshot",
            "standard_ExecutorRun",
            "ExecScan",
        ];
        assert_eq!(Phase::of_stack(stack), Some(Phase::Finish));
    }

    #[test]
    fn the_portals_first_executor_call_decides() {
        for (call, phase) in [
            ("standard_ExecutorStart", Phase::ExecutorStart),
            ("ExecutorRun", Phase::Run),
            ("standard_ExecutorEnd", Phase::Finish),
        ] {
            let stack = [
                "main",
                "PostgresMain",
                "PortalRun",
                call,
                "ExecutorFinish",
                "leaf",
            ];
            assert_eq!(Phase::of_stack(stack), Some(phase), "{call}");
        }
        assert_eq!(
            Phase::of_stack(["main", "PostgresMain", "PortalRun", "PortalRunSelect", "leaf"]),
            Some(Phase::Run)
        );
    }

    #[test]
    fn a_utility_statement_runs_throughout() {
        // DO, CALL, EXPLAIN ANALYZE: the executor below is a nested statement's.
        let stack = [
            "main",
            "PostgresMain",
            "PortalRun",
            "PortalRunUtility",
            "ProcessUtility",
            "ExecuteDoStmt",
            "SPI_execute",
            "standard_ExecutorFinish",
        ];
        assert_eq!(Phase::of_stack(stack), Some(Phase::Run));
    }

    #[test]
    fn background_work_has_no_phase() {
        assert_eq!(
            Phase::of_stack(["main", "PostmasterMain", "BackgroundWriterMain", "BgBufferSync"]),
            None
        );
    }
}
