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

    /// The phase of a stack given root first: the outermost phase function decides, so that
    /// planning a query nested in a running function counts as running the outer statement.
    pub fn of_stack<'a>(frames_root_first: impl IntoIterator<Item = &'a str>) -> Option<Phase> {
        frames_root_first.into_iter().find_map(Phase::of_function)
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
    fn background_work_has_no_phase() {
        assert_eq!(
            Phase::of_stack(["main", "PostmasterMain", "BackgroundWriterMain", "BgBufferSync"]),
            None
        );
    }
}
