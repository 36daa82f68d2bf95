//! Fuzzing the config file parser: random TOML-ish text and mutated real configs (the seed
//! corpus `agent/tests/corpus/config/`) never panic, and what they make is clean: a config that
//! parses can be validated and summarised, an error is a message naming neither a planted
//! secret nor, through toml's rendering, the line it was on.

use proptest::prelude::*;

use super::AgentConfig;
use crate::fuzzing::{config, corpus, mutate, mutation};
use exporters::pyroscope::redact::is_sensitive_key;

/// The secrets the seeds plant: none may be shown, whatever the edit.
const SECRETS: [&str; 4] = [
    "SEEDSECRETpw-31337",
    "SEEDSECRETtoken-4242",
    "SEEDSECRETurl-777",
    "SEEDSECRETquery-888",
];

/// Parses `text` the way `--check-config` does, checking whatever comes out.
fn check(text: &str) -> Result<(), TestCaseError> {
    match AgentConfig::parse(text) {
        Ok(config) => {
            // As `--check-config` does: the summary of a valid config, else the error.
            let shown = match config.validate() {
                Ok(()) => config.summary(),
                Err(error) => format!("{error:#}"),
            };
            // An edit can make a secret an ordinary value (`service_name = "SEEDSECRET…"`,
            // a parameter `t?oken=`); those still in a credential's place must stay hidden.
            for secret in SECRETS.iter().filter(|s| in_credential_place(text, s)) {
                prop_assert!(
                    !shown.contains(secret),
                    "`{secret}` shown for:\n{text}\n---\n{shown}"
                );
            }
        }
        Err(error) => {
            let message = format!("{error:#}");
            prop_assert!(!message.trim().is_empty(), "an empty error for:\n{text}");
            prop_assert!(
                !message.contains("\n  |"),
                "the error quotes the file as toml renders it:\n{message}"
            );
            for secret in SECRETS
                .iter()
                .filter(|s| in_credential_place(text, s) && !in_name_place(text, s))
            {
                prop_assert!(
                    !message.contains(secret),
                    "`{secret}` shown for:\n{text}\n---\n{message}"
                );
            }
        }
    }
    Ok(())
}

/// Whether `secret` is only where a credential is: a URL's userinfo (`…:secret@`), a URL
/// parameter of a secret's name (`?token=secret`), or the string value of a secret's key
/// (`bearer_token = "secret`). An edit may have copied it elsewhere too, say into a host
/// name, where it may be shown.
fn in_credential_place(text: &str, secret: &str) -> bool {
    text.contains(secret)
        && text.match_indices(secret).all(|(at, _)| {
            let before = &text[..at];
            let line = &before[before.rfind('\n').map_or(0, |i| i + 1)..];
            let sensitive = |key: &str| !key.is_empty() && is_sensitive_key(key);
            let parameter = before.strip_suffix('=').is_some_and(|head| {
                let start = head.rfind(['?', '&']).map_or(head.len(), |i| i + 1);
                // A parameter's name ends at its first `=`. A backslash in it is a TOML escape
                // (`\token` is a tab and `oken`): the parsed name is another one.
                start < head.len() && !head[start..].contains(['=', '\\']) && sensitive(&head[start..])
            });
            let toml_value = line
                .strip_suffix('"')
                .and_then(|head| head.trim_end().strip_suffix('='))
                .is_some_and(|key| sensitive(key.trim()));
            text[at + secret.len()..].starts_with('@') || parameter || toml_value
        })
}

/// Whether an edit moved `secret` where a parse error may name it: into a key or a section
/// name (`SEEDSECRET… = 1` is a misspelt key, and the error names it).
fn in_name_place(text: &str, secret: &str) -> bool {
    text.lines().any(|line| {
        let line = line.trim_start();
        line.starts_with('[') && line.contains(secret)
            || line.split_once('=').is_some_and(|(key, _)| key.contains(secret))
            || !line.contains('=') && line.contains(secret)
    })
}

/// Keys of the real schema, and some that are not.
fn key() -> impl Strategy<Value = String> {
    prop_oneof![
        prop::sample::select(vec![
            "url",
            "basic_auth_user",
            "basic_auth_password",
            "bearer_token",
            "tenant_id",
            "ca_file",
            "timeout",
            "queue_max_bytes",
            "frequency",
            "upload_interval",
            "off_cpu",
            "off_cpu_min_stack",
            "off_cpu_stack_rate",
            "off_cpu_idle",
            "debug_dirs",
            "service_name",
            "pid",
            "static",
            "pod_service_name",
            "include",
            "exclude",
            "data_dir",
            "port",
            "binary",
            "functions",
            "budget",
            "metrics_addr",
            "log_format",
        ])
        .prop_map(str::to_string),
        "[a-zA-Z_.\"-]{1,12}",
    ]
}

fn value() -> impl Strategy<Value = String> {
    let leaf = prop_oneof![
        "\"[^\"\\\\\n]{0,20}\"",
        "'[^'\n]{0,20}'",
        any::<i64>().prop_map(|n| n.to_string()),
        any::<f64>().prop_map(|f| format!("{f:?}")),
        any::<bool>().prop_map(|b| b.to_string()),
        Just("\"SEEDSECRETpw-31337\"".to_string()),
        Just("\"15s\"".to_string()),
        Just("\"127.0.0.1:9437\"".to_string()),
        "[ -~]{0,12}",
    ];
    leaf.prop_recursive(3, 16, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(|v| format!("[{}]", v.join(", "))),
            prop::collection::vec((key(), inner), 0..4).prop_map(|v| {
                let pairs: Vec<String> = v.into_iter().map(|(k, v)| format!("{k} = {v}")).collect();
                format!("{{ {} }}", pairs.join(", "))
            }),
        ]
    })
}

fn line() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => (key(), value()).prop_map(|(k, v)| format!("{k} = {v}")),
        1 => prop::sample::select(vec![
            "[pyroscope]", "[collection]", "[labels]", "[discovery]", "[probes]", "[server]",
            "[[discovery.include]]", "[[discovery.exclude]]", "[labels.static]", "[nope]",
        ])
        .prop_map(str::to_string),
        1 => "[ -~]{0,30}",
    ]
}

proptest! {
    #![proptest_config(config(256))]

    #[test]
    fn random_toml_never_panics_and_errors_are_clean(lines in prop::collection::vec(line(), 0..24)) {
        check(&lines.join("\n"))?;
    }

    #[test]
    fn mutated_real_configs_never_panic_and_errors_are_clean(
        seed in any::<prop::sample::Index>(),
        mutations in prop::collection::vec(mutation(), 1..6),
    ) {
        let seeds = corpus("config");
        let (_, bytes) = seed.get(&seeds);
        let mutated = mutate(bytes, &mutations);
        check(&String::from_utf8_lossy(&mutated))?;
    }
}

#[test]
fn every_seed_is_a_valid_config_that_hides_its_secrets() {
    for (path, bytes) in corpus("config") {
        let text = String::from_utf8(bytes).expect("UTF-8 seed");
        let config = AgentConfig::parse(&text).unwrap_or_else(|e| panic!("`{}`: {e:#}", path.display()));
        // Each seed's own check, as --check-config runs it (the CA path may not exist here).
        check(&text).unwrap_or_else(|e| panic!("`{}`: {e}", path.display()));
        let summary = config.summary();
        assert!(SECRETS.iter().all(|s| !summary.contains(s)), "{summary}");
    }
}
