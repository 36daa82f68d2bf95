//! One push to Pyroscope over HTTP(S), with its authentication, and the error told apart as
//! worth retrying (the server or the network is down or overloaded) or not (the request or
//! the credentials are wrong: retrying sends the same thing to the same refusal).

use std::time::Duration;

use reqwest::header::{HeaderMap, HeaderValue, CONTENT_TYPE};
use reqwest::StatusCode;

use super::redact;

/// How to reach Pyroscope. Its `Debug` leaves the password and token out.
#[derive(Clone, Default)]
pub struct ClientConfig {
    /// Base URL, e.g. `http://pyroscope:4040` (a path prefix is kept).
    pub url: String,
    pub basic_auth: Option<(String, String)>,
    pub bearer_token: Option<String>,
    /// Sent as `X-Scope-OrgID` (multi-tenant Pyroscope / Grafana Cloud).
    pub tenant_id: Option<String>,
    /// PEM of CA certificates to trust besides the system's.
    pub ca_cert_pem: Option<Vec<u8>>,
    pub timeout: Duration,
    pub user_agent: String,
}

impl std::fmt::Debug for ClientConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientConfig")
            .field("url", &redact::url(&self.url))
            .field("basic_auth_user", &self.basic_auth.as_ref().map(|(user, _)| user))
            .field("bearer_token", &self.bearer_token.as_ref().map(|_| "<redacted>"))
            .field("tenant_id", &self.tenant_id)
            .field("ca_cert_pem", &self.ca_cert_pem.as_ref().map(|pem| pem.len()))
            .field("timeout", &self.timeout)
            .finish()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum PushError {
    #[error("invalid Pyroscope client settings: {0}")]
    Config(String),
    /// Connection refused, DNS, TLS handshake, timeout: the server may come back.
    #[error("cannot reach Pyroscope at {url}: {message}")]
    Unreachable { url: String, message: String },
    /// An HTTP error answer.
    #[error("Pyroscope answered {status}: {message}{hint}")]
    Status {
        status: u16,
        message: String,
        /// What to check, for answers that a retry cannot fix.
        hint: &'static str,
    },
}

impl PushError {
    /// Whether sending the same request again later may work: network errors, 408, 429, 5xx.
    pub fn is_retryable(&self) -> bool {
        match self {
            PushError::Config(_) => false,
            PushError::Unreachable { .. } => true,
            PushError::Status { status, .. } => *status == 408 || *status == 429 || *status >= 500,
        }
    }
}

pub struct PushClient {
    http: reqwest::Client,
    push_url: String,
    basic_auth: Option<(String, String)>,
}

impl PushClient {
    pub fn new(config: &ClientConfig) -> Result<Self, PushError> {
        // Credentials in the URL become basic auth: reqwest would send them so too, but its
        // errors quote the URL of the request, and that one must hold no password.
        let (url, url_auth) = split_credentials(&config.url)?;
        let basic_auth = match url_auth {
            Some(_) if config.basic_auth.is_some() || config.bearer_token.is_some() => {
                return Err(PushError::Config(format!(
                    "the URL `{}` holds credentials and basic auth or a bearer token is set too: keep one",
                    redact::url(&config.url)
                )))
            }
            Some(auth) => Some(auth),
            None => config.basic_auth.clone(),
        };
        // reqwest's rustls needs a process-wide crypto provider: ring, as the debuginfod client
        // uses (no C toolchain needed). Installing twice is harmless.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let mut headers = HeaderMap::new();
        if let Some(tenant) = &config.tenant_id {
            let value = HeaderValue::from_str(tenant).map_err(|_| {
                PushError::Config(format!("tenant id `{tenant}` is not a valid header value"))
            })?;
            headers.insert("X-Scope-OrgID", value);
        }
        if let Some(token) = &config.bearer_token {
            let mut value = HeaderValue::from_str(&format!("Bearer {token}"))
                .map_err(|_| PushError::Config("the bearer token is not a valid header value".into()))?;
            value.set_sensitive(true);
            headers.insert(reqwest::header::AUTHORIZATION, value);
        }
        let mut builder = reqwest::Client::builder()
            .timeout(config.timeout)
            .connect_timeout(config.timeout.min(Duration::from_secs(10)))
            .user_agent(config.user_agent.clone())
            // A redirect is an error to fix in the URL, not to follow: following one would
            // carry the credentials to wherever it points, and turn the POST into a GET.
            .redirect(reqwest::redirect::Policy::none())
            .default_headers(headers);
        if let Some(pem) = &config.ca_cert_pem {
            let certs = reqwest::Certificate::from_pem_bundle(pem).map_err(|e| {
                PushError::Config(format!("the CA file holds no usable PEM certificate: {e}"))
            })?;
            if certs.is_empty() {
                return Err(PushError::Config("the CA file holds no PEM certificate".into()));
            }
            builder = builder.tls_certs_merge(certs);
        }
        let http = builder
            .build()
            .map_err(|e| PushError::Config(format!("cannot build the HTTP client: {e}")))?;
        Ok(Self {
            http,
            push_url: push_url(&url)?,
            basic_auth,
        })
    }

    /// Sends one encoded `PushRequest`.
    pub async fn push(&self, body: Vec<u8>) -> Result<(), PushError> {
        let mut request = self
            .http
            .post(&self.push_url)
            .header(CONTENT_TYPE, "application/proto")
            .header("Connect-Protocol-Version", "1")
            .body(body);
        if let Some((user, password)) = &self.basic_auth {
            request = request.basic_auth(user, Some(password));
        }
        let response = request.send().await.map_err(|e| PushError::Unreachable {
            url: redact::url(&self.push_url).into_owned(),
            // The URL is said once, above; the causes are redacted in case one quotes it.
            message: redact::urls(&error_chain(&e.without_url())).into_owned(),
        })?;
        let status = response.status();
        if status.is_success() {
            return Ok(());
        }
        let text = body_start(response).await;
        Err(PushError::Status {
            status: status.as_u16(),
            message: redact::urls(&connect_message(&text)).into_owned(),
            hint: hint(status),
        })
    }
}

/// `url` without its userinfo, and the user and password it held (percent-decoded), for
/// basic auth. Refuses what is not an absolute http(s) URL without quoting it: where the
/// credentials of a malformed URL end cannot be told, so none of it is shown.
pub fn split_credentials(url: &str) -> Result<(String, Option<(String, String)>), PushError> {
    if !(url.starts_with("http://") || url.starts_with("https://")) {
        return Err(PushError::Config(
            "the URL must start with http:// or https:// (it is not shown: it may hold a password)".into(),
        ));
    }
    let mut parsed = reqwest::Url::parse(url).map_err(|error| {
        PushError::Config(format!(
            "the URL is not valid: {error} (it is not shown: it may hold a password)"
        ))
    })?;
    if parsed.username().is_empty() && parsed.password().is_none() {
        return Ok((url.to_string(), None));
    }
    let auth = (
        percent_decode(parsed.username()),
        percent_decode(parsed.password().unwrap_or_default()),
    );
    // Neither can fail on an http(s) URL, which always has a host.
    let _ = parsed.set_username("");
    let _ = parsed.set_password(None);
    Ok((parsed.to_string(), Some(auth)))
}

/// The push endpoint under `base` (a URL without credentials): the path gets the endpoint
/// appended, a query string (a proxy's token) is kept after it.
fn push_url(base: &str) -> Result<String, PushError> {
    let mut url = reqwest::Url::parse(base).map_err(|error| {
        PushError::Config(format!(
            "the URL is not valid: {error} (it is not shown: it may hold a password)"
        ))
    })?;
    url.set_fragment(None);
    let path = format!("{}/push.v1.PusherService/Push", url.path().trim_end_matches('/'));
    url.set_path(&path);
    Ok(url.to_string())
}

/// `%XX` escapes decoded (as the userinfo of a URL holds them); invalid ones kept as they are.
fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut index = 0;
    while index < bytes.len() {
        let hex = bytes
            .get(index + 1..index + 3)
            .filter(|h| h.iter().all(u8::is_ascii_hexdigit))
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (bytes[index], hex) {
            (b'%', Some(byte)) => {
                out.push(byte);
                index += 3;
            }
            (byte, _) => {
                out.push(byte);
                index += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// How much of an error answer's body is read: what its message needs. A server or proxy
/// that sends without end must not make the agent read (and hold) all of it.
const ERROR_BODY_MAX_BYTES: usize = 64 << 10;
/// The longest message quoted from an error answer.
const ERROR_MESSAGE_MAX_CHARS: usize = 300;

/// The first [`ERROR_BODY_MAX_BYTES`] of the body (less if the connection fails meanwhile).
async fn body_start(mut response: reqwest::Response) -> String {
    let mut body = Vec::new();
    while body.len() < ERROR_BODY_MAX_BYTES {
        let Ok(Some(chunk)) = response.chunk().await else {
            break;
        };
        let room = ERROR_BODY_MAX_BYTES - body.len();
        body.extend_from_slice(&chunk[..chunk.len().min(room)]);
    }
    String::from_utf8_lossy(&body).into_owned()
}

/// Connect errors are JSON `{"code": "...", "message": "..."}`; anything else is shown as is.
/// Either is shortened to [`ERROR_MESSAGE_MAX_CHARS`].
fn connect_message(body: &str) -> String {
    let parsed: Option<(String, String)> = serde_json::from_str::<serde_json::Value>(body).ok().map(|v| {
        let field = |name: &str| {
            v.get(name)
                .and_then(|x| x.as_str())
                .unwrap_or_default()
                .to_string()
        };
        (field("code"), field("message"))
    });
    match parsed {
        Some((code, message)) if !message.is_empty() => format!("{code}: {message}")
            .chars()
            .take(ERROR_MESSAGE_MAX_CHARS)
            .collect(),
        _ => body
            .chars()
            .take(ERROR_MESSAGE_MAX_CHARS)
            .collect::<String>()
            .trim()
            .to_string(),
    }
}

fn hint(status: StatusCode) -> &'static str {
    match status.as_u16() {
        401 | 403 => " (check pyroscope.basic_auth_user/basic_auth_password or bearer_token, and tenant_id)",
        404 => " (check pyroscope.url: it should be Pyroscope's base URL, without a path to an API)",
        300..=399 => " (the server redirects: set pyroscope.url to the URL it redirects to)",
        413 => " (the profile is over the server's size limit)",
        _ => "",
    }
}

/// An error and its causes on one line: reqwest's own message is terse ("error sending request").
fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retryable_errors_are_the_transient_ones() {
        let status = |status| PushError::Status {
            status,
            message: String::new(),
            hint: "",
        };
        assert!(status(503).is_retryable());
        assert!(status(429).is_retryable());
        assert!(!status(400).is_retryable());
        assert!(!status(401).is_retryable());
        assert!(PushError::Unreachable {
            url: String::new(),
            message: String::new()
        }
        .is_retryable());
    }

    #[test]
    fn debug_output_keeps_secrets_out() {
        let config = ClientConfig {
            basic_auth: Some(("agent".into(), "hunter2".into())),
            bearer_token: Some("tok-123".into()),
            ..ClientConfig::default()
        };
        let text = format!("{config:?}");
        assert!(
            text.contains("agent") && !text.contains("hunter2") && !text.contains("tok-123"),
            "{text}"
        );
    }

    #[test]
    fn url_credentials_become_basic_auth_and_leave_the_url() {
        let (url, auth) =
            split_credentials("https://agent:p%40ss%2Fw@pyro.example:4040/prefix").expect("valid");
        assert_eq!(url, "https://pyro.example:4040/prefix");
        assert_eq!(auth, Some(("agent".to_string(), "p@ss/w".to_string())));
        let (url, auth) = split_credentials("http://pyro:4040").expect("valid");
        assert_eq!((url.as_str(), auth), ("http://pyro:4040", None));
        let config = ClientConfig {
            url: "https://agent:hunter2@pyro:4040".into(),
            timeout: Duration::from_secs(1),
            ..ClientConfig::default()
        };
        let client = PushClient::new(&config).expect("client");
        assert_eq!(client.push_url, "https://pyro:4040/push.v1.PusherService/Push");
        assert_eq!(client.basic_auth, Some(("agent".into(), "hunter2".into())));
        assert!(!format!("{config:?}").contains("hunter2"), "{config:?}");
    }

    #[test]
    fn errors_about_urls_never_quote_their_password() {
        for url in [
            "ftp://agent:hunter2@pyro:4040",
            "https://agent:hunter2@pyro:99999",
            "https://agent:hunter2@",
        ] {
            let error = split_credentials(url).expect_err("refused").to_string();
            assert!(
                !error.contains("hunter2") && error.contains("not shown"),
                "{error}"
            );
        }
        let config = ClientConfig {
            url: "https://agent:hunter2@pyro:4040".into(),
            bearer_token: Some("tok".into()),
            timeout: Duration::from_secs(1),
            ..ClientConfig::default()
        };
        let Err(error) = PushClient::new(&config) else {
            panic!("credentials twice are refused");
        };
        let error = error.to_string();
        assert!(
            error.contains("keep one") && !error.contains("hunter2"),
            "{error}"
        );
    }

    #[test]
    fn an_unreachable_server_is_reported_without_the_password() {
        // A port nothing listens on: bound, then closed.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let config = ClientConfig {
            url: format!("http://agent:hunter2@127.0.0.1:{port}/?token=tok3n"),
            timeout: Duration::from_secs(5),
            ..ClientConfig::default()
        };
        let client = PushClient::new(&config).expect("client");
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let error = runtime
            .block_on(client.push(Vec::new()))
            .expect_err("nothing listens");
        let text = format!("{error} {error:?}");
        assert!(matches!(error, PushError::Unreachable { .. }), "{text}");
        assert!(!text.contains("hunter2") && !text.contains("tok3n"), "{text}");
    }

    #[test]
    fn connect_errors_are_read_from_json() {
        assert_eq!(
            connect_message(r#"{"code":"invalid_argument","message":"bad label"}"#),
            "invalid_argument: bad label"
        );
        assert_eq!(connect_message("plain text"), "plain text");
    }

    #[test]
    fn bad_urls_and_ca_files_are_refused() {
        let config = ClientConfig {
            url: "pyroscope:4040".into(),
            timeout: Duration::from_secs(1),
            ..ClientConfig::default()
        };
        assert!(matches!(PushClient::new(&config), Err(PushError::Config(_))));
        let config = ClientConfig {
            url: "https://pyroscope:4040".into(),
            ca_cert_pem: Some(b"not a certificate".to_vec()),
            timeout: Duration::from_secs(1),
            ..ClientConfig::default()
        };
        assert!(matches!(PushClient::new(&config), Err(PushError::Config(_))));
    }

    #[test]
    fn the_push_endpoint_goes_on_the_path_and_keeps_the_query() {
        let cases = [
            (
                "http://127.0.0.1:4040",
                "http://127.0.0.1:4040/push.v1.PusherService/Push",
            ),
            (
                "http://127.0.0.1:4040/",
                "http://127.0.0.1:4040/push.v1.PusherService/Push",
            ),
            (
                "https://example.net/pyroscope/",
                "https://example.net/pyroscope/push.v1.PusherService/Push",
            ),
            (
                "https://example.net/p?token=abc",
                "https://example.net/p/push.v1.PusherService/Push?token=abc",
            ),
            (
                "https://example.net/?a=1#x",
                "https://example.net/push.v1.PusherService/Push?a=1",
            ),
        ];
        for (base, expected) in cases {
            assert_eq!(push_url(base).expect("valid"), expected, "{base}");
        }
    }
}
