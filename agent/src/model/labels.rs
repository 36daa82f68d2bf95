//! The labels pgscope puts on every sample, by name, and how the analysis reads them back. The
//! collection side writes them (`postgres::attribution`, `aggregate`); every view and rule reads
//! them through here, so a label is named in one place.

use exporters::StackSample;

use super::QueryId;
use crate::bpf::abi::OffCpuClass;
use crate::postgres::phase::Phase;

pub const PID: &str = "pid";
pub const BACKEND_TYPE: &str = "backend_type";
pub const DATABASE: &str = "database";
pub const STATE: &str = "state";
pub const QUERY_ID: &str = QueryId::LABEL;
/// `Type:Name` as `pg_stat_activity` shows the wait event.
pub const WAIT_EVENT: &str = "wait_event";
/// Off-CPU samples: why the process was off CPU ([`OffCpuClass`]).
pub const OFF_CPU: &str = "off_cpu";
/// The statement phase the stack runs under ([`Phase`]).
pub const PHASE: &str = "phase";
/// On-CPU samples in a trigger of their statement: the innermost trigger, `constraint <name>`
/// for a constraint's (a foreign key's checks), else `trigger <name>`.
pub const TRIGGER: &str = "trigger";

/// What a sample's labels say, typed.
pub trait SampleLabels {
    /// Its queryid; None for processes without one (no status entry, no attribution).
    fn query_id(&self) -> Option<QueryId>;
    /// Its statement phase, when its stack is in one.
    fn phase(&self) -> Option<Phase>;
    /// Its wait event, `Type:Name`.
    fn wait_event(&self) -> Option<&str>;
    /// Off-CPU samples: the class of the wait, as labelled.
    fn off_cpu_class(&self) -> Option<&str>;
    /// Whether an off-CPU sample is the client's time rather than the statement's: idle between
    /// statements, or waiting for the client inside a transaction (`Client:*`: its think time
    /// and round trips, while the previous statement's queryid stays in force).
    fn is_client_time(&self) -> bool;
    /// Whether an off-CPU sample is time blocked: neither the client's nor a sleep asked for.
    fn is_blocked(&self) -> bool;
}

impl SampleLabels for StackSample {
    fn query_id(&self) -> Option<QueryId> {
        self.label(QUERY_ID).and_then(|v| v.parse().ok())
    }

    fn phase(&self) -> Option<Phase> {
        let label = self.label(PHASE)?;
        Phase::ALL.into_iter().find(|p| p.label() == label)
    }

    fn wait_event(&self) -> Option<&str> {
        self.label(WAIT_EVENT)
    }

    fn off_cpu_class(&self) -> Option<&str> {
        self.label(OFF_CPU)
    }

    fn is_client_time(&self) -> bool {
        is_client_time(self.off_cpu_class(), self.wait_event())
    }

    fn is_blocked(&self) -> bool {
        is_blocked(self.off_cpu_class(), self.wait_event())
    }
}

/// [`SampleLabels::is_client_time`] over the two labels it reads.
pub fn is_client_time(class: Option<&str>, wait_event: Option<&str>) -> bool {
    class == Some(OffCpuClass::Idle.name()) || wait_event.is_some_and(|w| w.starts_with("Client:"))
}

/// The `Timeout:*` wait events that are sleeps asked for — `pg_sleep`, vacuum's and the
/// checkpointer's cost-based delays, base backups' throttle, a standby's apply delay and retry
/// interval — not waits on something another session holds. (`Timeout:SpinDelay`, a spinlock's
/// backoff, and `Timeout:RegisterSyncRequest`, a full checkpointer queue, are contention, and
/// `Timeout:VacuumTruncate` waits for a lock.)
const DELIBERATE_SLEEPS: [&str; 6] = [
    "Timeout:PgSleep",
    "Timeout:VacuumDelay",
    "Timeout:CheckpointWriteDelay",
    "Timeout:BaseBackupThrottle",
    "Timeout:RecoveryApplyDelay",
    "Timeout:RecoveryRetrieveRetryInterval",
];

/// Whether a wait event is a sleep the statement or process asked for: part of its time, but
/// not time it was blocked.
pub fn is_deliberate_sleep(wait_event: Option<&str>) -> bool {
    wait_event.is_some_and(|w| DELIBERATE_SLEEPS.contains(&w))
}

/// Whether off-CPU time of this class and wait event is time blocked: neither the client's
/// nor a sleep asked for.
pub fn is_blocked(class: Option<&str>, wait_event: Option<&str>) -> bool {
    !is_client_time(class, wait_event) && !is_deliberate_sleep(wait_event)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(labels: &[(&str, &str)]) -> StackSample {
        StackSample {
            frames: Vec::new(),
            labels: labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            count: 1,
        }
    }

    #[test]
    fn labels_read_back_typed() {
        let s = sample(&[
            (QUERY_ID, "-42"),
            (PHASE, "plan"),
            (WAIT_EVENT, "IO:DataFileRead"),
        ]);
        assert_eq!(s.query_id(), Some(QueryId(-42)));
        assert_eq!(s.phase(), Some(Phase::Plan));
        assert_eq!(s.wait_event(), Some("IO:DataFileRead"));
        assert!(!s.is_client_time());
        assert_eq!(sample(&[(QUERY_ID, "x")]).query_id(), None);
        assert_eq!(sample(&[(PHASE, "nosuch")]).phase(), None);
    }

    #[test]
    fn client_time_is_idle_or_a_client_wait() {
        assert!(sample(&[(OFF_CPU, "idle")]).is_client_time());
        assert!(sample(&[(OFF_CPU, "latch"), (WAIT_EVENT, "Client:ClientRead")]).is_client_time());
        assert!(!sample(&[(OFF_CPU, "futex"), (WAIT_EVENT, "LWLock:pg_stat_statements")]).is_client_time());
    }
}
