//! The `query` label: pg_stat_statements' normalized text of each labelled queryid, shortened.
//! It is one to one with `queryid`, so it adds no series, and in Pyroscope's Tag Explorer a DBA
//! reads statements rather than numbers. Only texts pg_stat_statements normalized (constants
//! replaced by `$1`, `$2`, …) are used: the text of a utility statement is kept with its
//! literals (`ALTER ROLE … PASSWORD '…'`), and never leaves the host.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use exporters::Profile;
use tracing::debug;

use crate::model::QueryId;
use crate::postgres::sql;

/// The longest label value, in characters: enough to recognise a statement in a list, far under
/// Pyroscope's limit (2048 bytes).
pub const MAX_CHARS: usize = 160;
/// The label's name.
pub const LABEL: &str = "query";
/// How long reading the texts may hold up an upload.
const READ_TIMEOUT: Duration = Duration::from_secs(2);
/// After a queryid pg_stat_statements did not have, when to ask again.
const RETRY: Duration = Duration::from_secs(60);
/// Texts kept per instance at most; past it the cache starts over (the labelled queryids are
/// a few hundred at most: this only bounds a workload that churns through them).
const MAX_CACHED: usize = 4096;

/// The commands whose text pg_stat_statements normalizes (planned statements, their constants
/// jumbled and replaced); every other command is a utility statement, kept as it was sent.
const NORMALIZED_COMMANDS: [&str; 8] = [
    "SELECT", "INSERT", "UPDATE", "DELETE", "MERGE", "VALUES", "WITH", "TABLE",
];

/// The label value for a pg_stat_statements text: whitespace collapsed, cut at [`MAX_CHARS`];
/// None for a text that may hold literals.
pub fn label_value(text: &str) -> Option<String> {
    let command = sql::command_of(text)?;
    if !NORMALIZED_COMMANDS.contains(&command.as_str()) {
        return None;
    }
    let collapsed = text.split_whitespace().collect::<Vec<_>>().join(" ");
    if collapsed.chars().count() <= MAX_CHARS {
        return Some(collapsed);
    }
    let mut cut: String = collapsed.chars().take(MAX_CHARS - 1).collect();
    cut.push('…');
    Some(cut)
}

/// One instance's texts.
#[derive(Default)]
struct InstanceTexts {
    /// Queryid → its label value; None: not in pg_stat_statements or not normalized, asked
    /// at that instant.
    texts: HashMap<i64, (Option<String>, Instant)>,
}

/// Per instance (root PID).
#[derive(Default)]
pub struct QueryTexts {
    instances: HashMap<u32, InstanceTexts>,
}

impl QueryTexts {
    /// Reads the texts of the queryids `profiles` label that are not known yet, over `client`
    /// (the findings' connection to the database that has pg_stat_statements), which it gives
    /// back unless the read failed or timed out.
    pub async fn refresh(
        &mut self,
        root: u32,
        profiles: &[(&'static str, Profile)],
        client: tokio_postgres::Client,
    ) -> Option<tokio_postgres::Client> {
        let ids = labelled_ids(profiles);
        self.instances
            .entry(root)
            .or_default()
            .refresh(root, &ids, client)
            .await
    }

    /// Labels the samples of `profiles` whose queryid has a known text with it.
    pub fn apply(&self, root: u32, profiles: &mut [(&'static str, Profile)]) {
        let Some(instance) = self.instances.get(&root) else {
            return;
        };
        for (_, profile) in profiles.iter_mut() {
            for sample in &mut profile.samples {
                let Some(id) = sample.label(QueryId::LABEL).and_then(|v| v.parse::<i64>().ok()) else {
                    continue;
                };
                if let Some((Some(text), _)) = instance.texts.get(&id) {
                    sample.labels.push((LABEL.to_string(), text.clone()));
                    sample.labels.sort();
                }
            }
        }
    }

    /// Forgets an instance that is gone.
    pub fn forget(&mut self, root: u32) {
        self.instances.remove(&root);
    }
}

impl InstanceTexts {
    /// Reads the texts of `ids` not known, or not found at least [`RETRY`] ago.
    async fn refresh(
        &mut self,
        root: u32,
        ids: &[i64],
        client: tokio_postgres::Client,
    ) -> Option<tokio_postgres::Client> {
        let now = Instant::now();
        let missing: Vec<i64> = ids
            .iter()
            .copied()
            .filter(|id| match self.texts.get(id) {
                None => true,
                Some((None, asked)) => now.duration_since(*asked) >= RETRY,
                Some((Some(_), _)) => false,
            })
            .collect();
        if missing.is_empty() {
            return Some(client);
        }
        match tokio::time::timeout(READ_TIMEOUT, sql::query_texts(&client, &missing)).await {
            Ok(Ok(texts)) => {
                if self.texts.len() + missing.len() > MAX_CACHED {
                    self.texts.clear();
                }
                for id in missing {
                    let value = texts.get(&id).and_then(|t| label_value(t));
                    self.texts.insert(id, (value, now));
                }
                Some(client)
            }
            Ok(Err(error)) => {
                debug!(postmaster = root, "no query labels for now: {error:#}");
                None
            }
            Err(_) => {
                debug!(postmaster = root, "no query labels for now: the read timed out");
                None
            }
        }
    }
}

/// The queryids the profiles label (not `other`).
fn labelled_ids(profiles: &[(&'static str, Profile)]) -> Vec<i64> {
    let mut ids: Vec<i64> = profiles
        .iter()
        .flat_map(|(_, p)| p.samples.iter())
        .filter_map(|s| s.label(QueryId::LABEL)?.parse().ok())
        .collect();
    ids.sort_unstable();
    ids.dedup();
    ids
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn planned_statements_are_labelled_with_their_normalized_text() {
        assert_eq!(
            label_value("SELECT abalance FROM pgbench_accounts\n  WHERE aid = $1").as_deref(),
            Some("SELECT abalance FROM pgbench_accounts WHERE aid = $1")
        );
        assert_eq!(
            label_value("/* app */ with x as (select $1) select * from x").as_deref(),
            Some("/* app */ with x as (select $1) select * from x")
        );
    }

    #[test]
    fn utility_statements_keep_their_literals_and_are_not_labelled() {
        for text in [
            "ALTER ROLE app PASSWORD 'secret'",
            "CREATE TABLE t AS SELECT 1",
            "SET work_mem = '64MB'",
            "VACUUM t",
            "",
        ] {
            assert_eq!(label_value(text), None, "{text}");
        }
    }

    #[test]
    fn long_texts_are_cut() {
        let text = format!("SELECT {} FROM t", vec!["a"; 200].join(", "));
        let value = label_value(&text).expect("a SELECT is labelled");
        assert_eq!(value.chars().count(), MAX_CHARS);
        assert!(value.ends_with('…'));
    }

    proptest! {
        #[test]
        fn a_label_value_is_bounded_and_on_one_line(text in "\\PC{0,600}") {
            if let Some(value) = label_value(&format!("SELECT {text}")) {
                prop_assert!(value.chars().count() <= MAX_CHARS);
                prop_assert!(!value.contains('\n'));
            }
        }
    }
}
