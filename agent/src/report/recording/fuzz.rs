//! Fuzzing `report --from`: mutated real recordings (the seed corpus
//! `agent/tests/corpus/recording/`, written by `pgscope trace --record`) never panic. What
//! parses goes on through everything the command does with it: the findings, their console
//! rendering and the HTML page.

use std::path::Path;

use proptest::prelude::*;

use super::Recording;
use crate::fuzzing::{config, corpus, mutate, mutation};

/// What `pgscope report --from` does with a file's bytes, but writing the page.
fn report(bytes: &[u8]) -> Result<(), TestCaseError> {
    match Recording::parse(bytes, Path::new("fuzzed.json")) {
        Ok(recording) => {
            let page = recording.with_analysis(|analysis| {
                let findings = crate::findings::evaluate(analysis);
                let _ = crate::findings::render(&findings, |q| recording.query_text(q));
                crate::report::html::render(&recording, analysis, &findings)
            });
            prop_assert!(page.is_ok(), "a parsed recording has no page: {:?}", page.err());
        }
        Err(error) => {
            let message = format!("{error:#}");
            prop_assert!(
                message.contains("fuzzed.json"),
                "the error does not name the file: {message}"
            );
        }
    }
    Ok(())
}

proptest! {
    // A seed is 66 KiB: fewer cases than the config's by default.
    #![proptest_config(config(64))]

    #[test]
    fn mutated_recordings_never_panic(
        seed in any::<prop::sample::Index>(),
        mutations in prop::collection::vec(mutation(), 1..6),
    ) {
        let seeds = corpus("recording");
        let (_, bytes) = seed.get(&seeds);
        report(&mutate(bytes, &mutations))?;
    }

    /// Edits that keep the JSON valid, at the values the report computes with: counts,
    /// durations, frequencies and queryids at their extremes.
    #[test]
    fn extreme_values_never_panic(
        seed in any::<prop::sample::Index>(),
        field in prop::sample::select(vec![
            "\"count\":", "\"frequency_hz\":", "\"duration_seconds\":", "\"calls\":",
            "\"total_ns\":", "\"dealloc\":", "\"max\":", "\"relations\":", "\"period\":",
        ]),
        value in prop::sample::select(vec![
            "0", "1", "-1", "18446744073709551615", "9223372036854775807", "1e308", "-1e308",
            "0.0", "1e-320", "\"x\"", "null",
        ]),
        nth in 0usize..64,
    ) {
        let seeds = corpus("recording");
        let (_, bytes) = seed.get(&seeds);
        let text = String::from_utf8_lossy(bytes);
        let Some((at, _)) = text.match_indices(field).nth(nth % text.matches(field).count().max(1)) else {
            return Ok(());
        };
        let start = at + field.len();
        let end = start + text[start..].find([',', '}', ']']).unwrap_or(0);
        let edited = format!("{}{value}{}", &text[..start], &text[end..]);
        report(edited.as_bytes())?;
    }
}

#[test]
fn every_seed_is_a_recording_with_a_report() {
    for (path, bytes) in corpus("recording") {
        let recording =
            Recording::parse(&bytes, &path).unwrap_or_else(|e| panic!("`{}`: {e:#}", path.display()));
        recording
            .with_analysis(|analysis| {
                let findings = crate::findings::evaluate(analysis);
                crate::report::html::render(&recording, analysis, &findings)
            })
            .unwrap_or_else(|e| panic!("`{}`: {e:#}", path.display()));
    }
}
