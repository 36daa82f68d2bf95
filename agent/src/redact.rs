//! Credentials out of everything pgscope prints or logs: a password in `--conninfo`
//! (`password=…`, `postgresql://user:pass@…`, `?sslpassword=…`), in a Pyroscope URL, or in a
//! line of the config file a parse error quotes (`basic_auth_password = "…"`).
//!
//! Secrets are kept in [`Secret`], whose `Debug` and `Display` print [`MASK`], so that they
//! cannot be printed by accident; text that may quote one goes through [`text`].

use std::borrow::Cow;

use exporters::pyroscope::redact as urls;
pub use exporters::pyroscope::redact::{url, MASK};

/// A password or token: printed as `***` whatever the format.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    /// The value itself, for the one place that sends it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(MASK)
    }
}

impl std::fmt::Display for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(MASK)
    }
}

impl<'de> serde::Deserialize<'de> for Secret {
    /// A string; anything else is refused without quoting it (serde's usual message would).
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        String::deserialize(deserializer).map(Secret).map_err(|_| {
            serde::de::Error::custom("expected a string (the value is not shown: it is a secret)")
        })
    }
}

/// `text` with every credential in it replaced by [`MASK`]: URL userinfo and secret query
/// parameters, and the value of every `key=value` whose key names a secret (`password`,
/// `sslpassword`, `bearer_token`, …), quoted or not, as libpq, TOML and URLs write them.
pub fn text(text: &str) -> Cow<'_, str> {
    match urls::urls(text) {
        Cow::Borrowed(text) => key_values(text),
        Cow::Owned(text) => Cow::Owned(key_values(&text).into_owned()),
    }
}

/// An error and its causes as printed: whatever it quotes of a connection string, a password
/// least of all, is redacted.
pub fn error(error: &anyhow::Error) -> String {
    text(&format!("{error:#}")).into_owned()
}

fn is_key_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.')
}

/// Where the key that ends `text` starts.
fn key_start(text: &str) -> usize {
    text.char_indices()
        .rev()
        .find(|&(_, c)| !is_key_char(c))
        .map_or(0, |(i, c)| i + c.len_utf8())
}

/// Hides the values of secret `key=value` pairs.
fn key_values(text: &str) -> Cow<'_, str> {
    let mut out = String::new();
    // Up to where `text` has been copied to `out`.
    let mut copied = 0;
    let mut search = 0;
    while let Some(offset) = text[search..].find('=') {
        let equals = search + offset;
        search = equals + 1;
        let key_end = text[..equals].trim_end_matches([' ', '\t']).len();
        let key_start = key_start(&text[..key_end]);
        if key_start < copied || !urls::is_sensitive_key(&text[key_start..key_end]) {
            continue;
        }
        // In a URL's query string a value ends at the next parameter; elsewhere (libpq's
        // `key=value`, TOML) only at white space or its closing quote.
        let in_query = text[..key_start].ends_with(['?', '&']);
        let value_start = equals
            + 1
            + (text[equals + 1..].len() - text[equals + 1..].trim_start_matches([' ', '\t']).len());
        let value_end = value_start + value_len(&text[value_start..], in_query);
        if value_end == value_start {
            continue;
        }
        out.push_str(&text[copied..value_start]);
        out.push_str(MASK);
        copied = value_end;
        search = value_end;
    }
    if copied == 0 {
        return Cow::Borrowed(text);
    }
    out.push_str(&text[copied..]);
    Cow::Owned(out)
}

/// The length of the value at the start of `text`: quoted (`'…'` or `"…"`, backslash escapes,
/// up to the closing quote, or to the end when there is none) or bare.
fn value_len(text: &str, in_query: bool) -> usize {
    let mut chars = text.char_indices();
    let Some((_, first)) = chars.next() else {
        return 0;
    };
    if first == '\'' || first == '"' {
        let mut escaped = false;
        for (index, c) in chars {
            match c {
                _ if escaped => escaped = false,
                '\\' => escaped = true,
                c if c == first => return index + c.len_utf8(),
                _ => {}
            }
        }
        return text.len();
    }
    let mut escaped = false;
    for (index, c) in text.char_indices() {
        let ends = if in_query {
            c.is_whitespace() || matches!(c, '&' | '#' | '"' | '\'' | '`' | '<' | '>')
        } else {
            // libpq: a backslash escapes the next character, white space included.
            !escaped && c.is_whitespace()
        };
        if ends {
            return index;
        }
        escaped = !escaped && c == '\\' && !in_query;
    }
    text.len()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn conninfo_passwords_are_hidden_in_every_form() {
        let cases = [
            (
                "connecting through --conninfo `host=/tmp port=5432 password=hunter2 user=x`",
                "connecting through --conninfo `host=/tmp port=5432 password=*** user=x`",
            ),
            ("password = 'hunter 2\\' x' dbname=d", "password = *** dbname=d"),
            ("sslpassword=hun\\ ter2", "sslpassword=***"),
            (
                "postgresql://u:hunter2@db:5432/postgres",
                "postgresql://***@db:5432/postgres",
            ),
            (
                "postgres://db/postgres?user=u&password=hunter2&sslmode=off",
                "postgres://db/postgres?user=u&password=***&sslmode=off",
            ),
            (
                "3 | basic_auth_password = \"hunt\\\"er2\"",
                "3 | basic_auth_password = ***",
            ),
            ("bearer_token=\"hunter2", "bearer_token=***"),
            ("PGSCOPE_PYROSCOPE_TOKEN=hunter2", "PGSCOPE_PYROSCOPE_TOKEN=***"),
            // Found by the config fuzzer: a key after a multi-byte character.
            (
                "?tok\u{feff}en=x \u{feff}token=hunter2",
                "?tok\u{feff}en=x \u{feff}token=***",
            ),
        ];
        for (text, expected) in cases {
            assert_eq!(super::text(text), expected, "{text}");
        }
    }

    #[test]
    fn text_without_credentials_is_borrowed_unchanged() {
        for text in [
            "",
            "host=/tmp port=5432 user=postgres dbname=postgres",
            "collection.frequency 0 Hz is outside 1..=1000",
            "password authentication failed for user \"x\"",
            "password=",
        ] {
            assert!(
                matches!(super::text(text), Cow::Borrowed(t) if t == text),
                "{text}"
            );
        }
    }

    #[test]
    fn secrets_print_as_a_mask() {
        let secret = Secret::new("hunter2");
        assert_eq!(
            format!("{secret} {secret:?} {:?}", Some(&secret)),
            "*** *** Some(***)"
        );
        assert_eq!(secret.expose(), "hunter2");
        let error = toml::from_str::<std::collections::BTreeMap<String, Secret>>("t = 12345")
            .expect_err("a number is not a secret string");
        assert!(!error.to_string().contains("integer"), "{error}");
    }

    fn cases() -> u32 {
        std::env::var("PGSCOPE_FUZZ_CASES")
            .ok()
            .and_then(|n| n.parse().ok())
            .unwrap_or(256)
    }

    fn config() -> ProptestConfig {
        ProptestConfig {
            cases: cases(),
            ..ProptestConfig::default()
        }
    }

    /// A libpq value as libpq quotes it: in single quotes, `\` and `'` escaped.
    fn quoted(value: &str) -> String {
        format!("'{}'", value.replace('\\', "\\\\").replace('\'', "\\'"))
    }

    /// Percent-encodes everything but unreserved characters.
    fn percent_encoded(value: &str) -> String {
        value
            .bytes()
            .map(|b| match b {
                b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                    (b as char).to_string()
                }
                _ => format!("%{b:02X}"),
            })
            .collect()
    }

    proptest! {
        #![proptest_config(config())]

        /// Whatever the password, however the conninfo is written and whatever the message
        /// around it, the password is gone; tokio-postgres agrees it was the password.
        #[test]
        fn a_planted_conninfo_password_never_survives(
            secret in "[ -~]{6,24}",
            others in proptest::collection::vec("(host=/tmp|port=5433|user=u|dbname=d|sslmode=disable)", 0..4),
            position in 0usize..5,
            spaced in any::<bool>(),
            bare in any::<bool>(),
            key in "(password|sslpassword)",
            form in 0u8..3,
            before in "[a-z :`(]{0,20}",
            after in "[a-z :`)]{0,20}",
        ) {
            let conninfo = match form {
                // key=value, quoted as libpq quotes it.
                0 => {
                    let eq = if spaced { " = " } else { "=" };
                    let plain = !secret.contains(|c: char| c.is_whitespace() || c == '\\' || c == '\'');
                    let value = if bare && plain { secret.clone() } else { quoted(&secret) };
                    let mut parts = others.clone();
                    parts.insert(position.min(parts.len()), format!("{key}{eq}{value}"));
                    parts.join(" ")
                }
                // URI with the password in the userinfo.
                1 => format!("postgresql://u:{}@localhost:5433/d", percent_encoded(&secret)),
                // URI with the password as a parameter.
                _ => format!("postgresql://localhost:5433/d?user=u&{key}={}&sslmode=disable", percent_encoded(&secret)),
            };
            // tokio-postgres knows no `sslpassword` (libpq does): checked with `password` only.
            if key == "password" || form == 1 {
                let parsed: tokio_postgres::Config = conninfo
                    .parse()
                    .map_err(|e| TestCaseError::fail(format!("{conninfo}: {e}")))?;
                prop_assert_eq!(parsed.get_password(), Some(secret.as_bytes()));
            }
            let message = format!("{before}{conninfo}{after}");
            let clean = message.replace(&secret, "");
            prop_assume!(!clean.contains(&secret) && !before.contains(&secret) && !after.contains(&secret));
            let redacted = super::text(&message);
            for form in [secret.clone(), percent_encoded(&secret), quoted(&secret)] {
                prop_assert!(!redacted.contains(&form), "{message} → {redacted}");
            }
        }

        /// A config line with a secret key hides its value, whatever its quoting.
        #[test]
        fn a_planted_config_secret_never_survives(
            key in "(basic_auth_password|bearer_token)",
            secret in "[a-zA-Z0-9 !#$%&()*+,./:;<=>?@^_{|}~-]{6,24}",
            line in 1u32..100,
        ) {
            let message = format!("TOML parse error at line {line}\n  |\n{line} | {key} = \"{secret}\n  |   ^\ninvalid basic string");
            prop_assume!(!message.replacen(&secret, "", 1).contains(&secret));
            let redacted = super::text(&message);
            prop_assert!(!redacted.contains(&secret), "{message} → {redacted}");
        }

        #[test]
        fn text_without_credentials_is_unchanged(text in "([ -~\n]|\\PC){0,120}") {
            let sensitive = text.match_indices('=').any(|(at, _)| {
                let key = text[..at].trim_end_matches([' ', '\t']);
                let key = &key[key_start(key)..];
                urls::is_sensitive_key(key)
            });
            // URLs are the exporters' redaction's, tested there.
            prop_assume!(!sensitive && !text.contains("://"));
            prop_assert_eq!(super::text(&text), text.as_str());
        }
    }
}
