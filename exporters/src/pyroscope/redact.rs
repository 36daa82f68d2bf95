//! Credentials out of text that shows a URL: the userinfo of `https://user:pass@host` and the
//! values of query parameters such as `?token=`. Used on every URL and error message the
//! Pyroscope client shows, since reqwest's errors quote the URL of the request whole.
//!
//! It errs towards hiding: everything between `://` and the last `@` of a URL is hidden
//! (a password may hold a raw `/`), and so is any parameter whose name looks like a secret.

use std::borrow::Cow;

/// What a hidden credential is shown as.
pub const MASK: &str = "***";

/// Whether a parameter or setting of this name holds a credential: `password`, `sslpassword`,
/// `basic_auth_password`, `token`, `access_token`, `api_key`, `secret`, … (case-insensitive).
pub fn is_sensitive_key(key: &str) -> bool {
    const PARTS: [&str; 9] = [
        "pass",
        "pwd",
        "secret",
        "token",
        "apikey",
        "api_key",
        "api-key",
        "signature",
        "credential",
    ];
    let key = key.to_ascii_lowercase();
    PARTS.iter().any(|part| key.contains(part))
}

/// Characters that end a URL in running text: none of them may appear unencoded in a URL.
fn ends_url(c: char) -> bool {
    c.is_whitespace() || matches!(c, '"' | '\'' | '`' | '<' | '>')
}

/// `text` with the credentials of every URL in it replaced by [`MASK`]; borrowed when there
/// were none.
pub fn urls(text: &str) -> Cow<'_, str> {
    if !text.contains("://") {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("://") {
        let (before, after) = rest.split_at(at + 3);
        out.push_str(before);
        let end = after.find(ends_url).unwrap_or(after.len());
        let (url, tail) = after.split_at(end);
        out.push_str(&url_credentials(url));
        rest = tail;
    }
    out.push_str(rest);
    if out == text {
        Cow::Borrowed(text)
    } else {
        Cow::Owned(out)
    }
}

/// One value meant as a URL, its credentials hidden even when it is malformed (`https:/u:p@h`,
/// `u:p@h`): everything before its last `@`, but a `scheme://`, is hidden.
pub fn url(url: &str) -> Cow<'_, str> {
    let scheme_end = url.find("://").filter(|&end| {
        let scheme = &url[..end];
        scheme.starts_with(|c: char| c.is_ascii_alphabetic())
            && scheme
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '.' | '-'))
    });
    let (scheme, rest) = match scheme_end {
        Some(end) => url.split_at(end + 3),
        None => ("", url),
    };
    let hidden = url_credentials(rest);
    if hidden == rest {
        Cow::Borrowed(url)
    } else {
        Cow::Owned(format!("{scheme}{hidden}"))
    }
}

/// One URL after its `scheme://`: userinfo and sensitive query values hidden.
fn url_credentials(url: &str) -> String {
    let (hidden, authority_on) = match url.rfind('@') {
        Some(at) => (Some(&url[..at]), &url[at..]),
        None => (None, url),
    };
    let mut out = String::with_capacity(url.len());
    if hidden.is_some() {
        out.push_str(MASK);
    }
    match authority_on.split_once('?') {
        Some((head, query)) => {
            out.push_str(head);
            out.push('?');
            out.push_str(&query_credentials(query));
        }
        // The last `@` may be in the query string (`?a=b@c&token=…`, `?token@x=…`): then what
        // follows it is the rest of a parameter begun in the hidden part, and more parameters.
        // (With a raw `?` in a password, `u:pa?ss@host`, the "parameter" is the host: shown.)
        None => match hidden.and_then(|h| h.rsplit_once('?')) {
            Some((_, query_begun)) => {
                out.push('@');
                out.push_str(&query_tail_credentials(query_begun, &authority_on[1..]));
            }
            None => out.push_str(authority_on),
        },
    }
    out
}

/// `a=1&token=x#frag` → `a=1&token=***#frag`.
fn query_credentials(query: &str) -> String {
    query_tail_credentials("", query)
}

/// The query from an `@` on: `begun` is what precedes the `@` in the query (empty for a whole
/// query), so that a parameter cut by the `@` is judged whole.
fn query_tail_credentials(begun: &str, tail: &str) -> String {
    let (params, fragment) = match tail.split_once('#') {
        Some((params, fragment)) => (params, Some(fragment)),
        None => (tail, None),
    };
    let begun = begun.rsplit('&').next().unwrap_or_default();
    let mut out = String::with_capacity(tail.len());
    for (index, param) in params.split('&').enumerate() {
        if index > 0 {
            out.push('&');
        }
        let cut = if index == 0 && !begun.is_empty() {
            begun.len() + 1
        } else {
            0
        };
        let whole = if cut > 0 {
            Cow::Owned(format!("{begun}@{param}"))
        } else {
            Cow::Borrowed(param)
        };
        match secret_value_start(&whole) {
            // The value is (partly) in `param`: hide that part.
            Some(start) if whole.len() > start.max(cut) => {
                out.push_str(&param[..start.saturating_sub(cut)]);
                out.push_str(MASK);
            }
            _ => out.push_str(param),
        }
    }
    if let Some(fragment) = fragment {
        out.push('#');
        out.push_str(fragment);
    }
    out
}

/// Where a secret's value begins in one query parameter: after the first `=` that a secret's
/// name precedes (`token=…`; in mangled text also `x@token=…` or `a=token=…`, erring towards
/// hiding).
fn secret_value_start(param: &str) -> Option<usize> {
    param
        .match_indices('=')
        .map(|(at, _)| at)
        .find(|&at| is_sensitive_key(&param[..at]))
        .map(|at| at + 1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn userinfo_and_token_parameters_are_hidden() {
        assert_eq!(
            urls("cannot reach Pyroscope at https://agent:hunter2@pyro:4040/push"),
            "cannot reach Pyroscope at https://***@pyro:4040/push"
        );
        assert_eq!(urls("`http://tok3n@h/`"), "`http://***@h/`");
        assert_eq!(
            urls("error sending request for url (http://u:p@127.0.0.1:9/x?a=1&access_token=abc#f)"),
            "error sending request for url (http://***@127.0.0.1:9/x?a=1&access_token=***#f)"
        );
        assert_eq!(
            urls("postgresql://u:pa/ss@db/postgres?sslpassword=x"),
            "postgresql://***@db/postgres?sslpassword=***"
        );
        assert_eq!(
            urls("http://a/ and https://b:c@d/"),
            "http://a/ and https://***@d/"
        );
    }

    #[test]
    fn a_parameter_after_an_at_sign_in_the_query_is_hidden() {
        // Found by the config fuzz test: the last `@` is in the query, so the userinfo mask
        // swallowed the `?` and the parameter after it was shown.
        assert_eq!(
            url("https://agent:pw@pyro:4443/prefix?@[[x&token=s3cret"),
            "https://***@[[x&token=***"
        );
        assert_eq!(
            url("https://pyro/p?a=b@c&token=s3cret"),
            "https://***@c&token=***"
        );
        assert_eq!(
            urls("at https://pyro/p?note=x@y&api_key=s3cret now"),
            "at https://***@y&api_key=*** now"
        );
        // The `@` inside a secret's name, or inside its value.
        assert_eq!(url("https://pyro/p?token@[[=s3cret"), "https://***@[[=***");
        assert_eq!(
            url("https://pyro/p?a=1&token=ab@s3cret&b=2"),
            "https://***@***&b=2"
        );
        // A raw `?` in a password: what follows the `@` is the host, shown.
        assert_eq!(url("https://u:pa?ss@host/p"), "https://***@host/p");
    }

    #[test]
    fn a_url_value_is_redacted_even_when_malformed() {
        assert_eq!(url("https:'//agent:pw@h:1/p?token=t"), "***@h:1/p?token=***");
        assert_eq!(url("agent:pw@h"), "***@h");
        assert_eq!(url("https://agent:pw@h"), "https://***@h");
        assert!(matches!(
            url("https://h:4040/x"),
            Cow::Borrowed("https://h:4040/x")
        ));
    }

    #[test]
    fn text_without_credentials_is_borrowed_unchanged() {
        for text in [
            "",
            "no URL at all: user@example.com",
            "http://pyroscope:4040/push.v1.PusherService/Push?tenant=a",
            "Pyroscope answered 503: unavailable",
        ] {
            assert!(matches!(urls(text), Cow::Borrowed(t) if t == text), "{text}");
        }
    }

    /// How many cases each property runs: `PGSCOPE_FUZZ_CASES` raises it for a longer run.
    fn cases() -> u32 {
        std::env::var("PGSCOPE_FUZZ_CASES")
            .ok()
            .and_then(|n| n.parse().ok())
            .unwrap_or(256)
    }

    /// Characters a user may put in a URL's password unencoded (RFC 3986 unreserved,
    /// sub-delims, `:`), plus the raw `/`, `?`, `@` and `#` some clients accept anyway.
    const PASSWORD_CHARS: &str = "[A-Za-z0-9._~!$&()*+,;=:%/?@#-]{6,24}";
    const WORDS: &str = "[a-z0-9 .,:;()\\[\\]{}=/-]{0,40}";

    fn config() -> ProptestConfig {
        ProptestConfig {
            cases: cases(),
            ..ProptestConfig::default()
        }
    }

    proptest! {
        #![proptest_config(config())]

        #[test]
        fn a_planted_password_never_survives(
            scheme in "(http|https|postgresql|postgres)",
            user in "[a-z][a-z0-9_]{0,10}",
            password in PASSWORD_CHARS,
            host in "[a-z][a-z0-9.-]{0,20}(:[0-9]{1,5})?",
            path in "(/[a-zA-Z0-9._-]{0,10}){0,3}",
            query in "(\\?[a-z]{1,6}=[a-z0-9]{0,6}(&[a-z]{1,6}=[a-z0-9]{0,6}){0,2})?",
            before in WORDS,
            after in WORDS,
            closing in "[ )`'\"]?",
        ) {
            let text = format!("{before} {scheme}://{user}:{password}@{host}{path}{query}{closing}{after}");
            let clean = format!("{before} {scheme}://{host}{path}{query}{closing}{after}");
            prop_assume!(!clean.contains(&password));
            let redacted = urls(&text);
            prop_assert!(!redacted.contains(&password), "{text} → {redacted}");
            prop_assert!(redacted.contains(&format!("{MASK}@{host}")), "{text} → {redacted}");
        }

        #[test]
        fn a_planted_token_parameter_never_survives(
            key in "(token|access_token|password|api_key|X-Amz-Signature|sslpassword)",
            secret in "[A-Za-z0-9._~%+-]{6,24}",
            host in "[a-z][a-z0-9.-]{0,20}",
            others in "(&[a-z]{1,6}=[a-z0-9]{0,6}){0,2}",
            after in WORDS,
        ) {
            let text = format!("at https://{host}/push?tenant=a&{key}={secret}{others} {after}");
            prop_assume!(!format!("{host}{others}{after}").contains(&secret));
            let redacted = urls(&text);
            prop_assert!(!redacted.contains(&secret), "{text} → {redacted}");
            prop_assert!(redacted.contains(&format!("{key}={MASK}")), "{text} → {redacted}");
        }

        /// A secret parameter survives no `@` planted anywhere in the query before it.
        #[test]
        fn a_token_parameter_after_an_at_in_the_query_never_survives(
            userinfo in "([a-z]{1,6}:[a-z0-9]{1,8}@)?",
            before in "[a-z0-9=&\\[\\]]{0,12}",
            after in "[a-z0-9=\\[\\]]{0,12}",
            secret in "[A-Za-z0-9._~%+-]{6,24}",
            split in any::<bool>(),
        ) {
            let value = format!("https://{userinfo}pyro:4443/p?{before}@{after}&token={secret}");
            prop_assume!(!format!("{userinfo}{before}{after}").contains(&secret));
            let value = if split { value.replacen("&token=", "token@x=", 1) } else { value };
            let redacted = url(&value);
            prop_assert!(!redacted.contains(&secret), "{value} → {redacted}");
            prop_assert!(!urls(&value).contains(&secret), "{value} → {}", urls(&value));
        }

        /// A URL value, however malformed, shows no password planted before its host.
        #[test]
        fn a_malformed_url_value_never_shows_its_password(
            prefix in "[ -?A-~]{0,16}",
            secret in "[ -?A-~]{6,24}",
            suffix in "[ -?A-~]{0,30}",
        ) {
            let value = format!("{prefix}{secret}@{suffix}");
            prop_assume!(!format!("{prefix}{suffix}").contains(&secret));
            let redacted = url(&value);
            prop_assert!(!redacted.contains(&secret), "{value} → {redacted}");
        }

        #[test]
        fn text_without_credentials_is_unchanged(
            text in "[a-zA-Z0-9 .,:;/?&=()#_-]{0,120}",
        ) {
            // No userinfo is possible without `@`; parameters may be anything but a secret's.
            let sensitive = text
                .split(['?', '&'])
                .skip(1)
                .any(|param| secret_value_start(param.split('#').next().unwrap_or_default())
                    .is_some_and(|start| start < param.split('#').next().unwrap_or_default().len()));
            prop_assume!(!sensitive);
            prop_assert_eq!(urls(&text), text.as_str());
        }
    }
}
