//! What the live view shows beyond the progress line: per queryid the samples so far and per
//! wait event, counted as samples arrive (no symbolization needed).

use std::collections::HashMap;

use crate::postgres::attribution::Attribution;

#[derive(Debug, Default)]
pub struct LiveCounts {
    queries: HashMap<i64, u64>,
    waits: HashMap<String, u64>,
    samples: u64,
}

impl LiveCounts {
    pub fn record(&mut self, attribution: &Attribution) {
        self.samples += 1;
        if let Some(query_id) = attribution.query_id {
            *self.queries.entry(query_id).or_insert(0) += 1;
        }
        if let Some((kind, name)) = &attribution.wait_event {
            *self.waits.entry(format!("{kind}:{name}")).or_insert(0) += 1;
        }
    }

    /// Lines of the live table: the busiest queries and wait events so far.
    pub fn lines(&self, limit: usize) -> Vec<String> {
        let pct = |n: u64| 100.0 * n as f64 / self.samples.max(1) as f64;
        let mut lines = Vec::new();
        let mut queries: Vec<_> = self.queries.iter().collect();
        queries.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
        for (query_id, n) in queries.into_iter().take(limit) {
            lines.push(format!(
                "  queryid {query_id:>21}  {n:>7} samples {:>5.1}%",
                pct(*n)
            ));
        }
        let mut waits: Vec<_> = self.waits.iter().collect();
        waits.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
        for (wait, n) in waits.into_iter().take(limit) {
            lines.push(format!("  wait {wait:<32} {n:>7} samples {:>5.1}%", pct(*n)));
        }
        lines
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::borrow::Cow;

    #[test]
    fn busiest_queries_and_waits_first() {
        let mut live = LiveCounts::default();
        let query = |id| Attribution {
            query_id: Some(id),
            ..Default::default()
        };
        for _ in 0..3 {
            live.record(&query(7));
        }
        live.record(&query(9));
        live.record(&Attribution {
            wait_event: Some(("IO", Cow::Borrowed("DataFileRead"))),
            ..Default::default()
        });
        let lines = live.lines(5);
        assert!(
            lines[0].contains("queryid") && lines[0].contains(" 7 ") && lines[0].contains("60.0%"),
            "{lines:?}"
        );
        assert!(lines[1].contains(" 9 "), "{lines:?}");
        assert!(lines[2].contains("IO:DataFileRead"), "{lines:?}");
        assert_eq!(live.lines(1).len(), 2);
    }
}
