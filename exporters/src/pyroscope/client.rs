//! One push to Pyroscope over HTTP(S), with its authentication, and the error told apart as
//! worth retrying (the server or the network is down or overloaded) or not (the request or
//! the credentials are wrong: retrying sends the same thing to the same refusal).

use std::time::Duration;

use reqwest::header::{HeaderMap, HeaderValue, CONTENT_TYPE};
use reqwest::StatusCode;

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
            .field("url", &self.url)
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
        let base = config.url.trim_end_matches('/');
        if !(base.starts_with("http://") || base.starts_with("https://")) {
            return Err(PushError::Config(format!(
                "the URL `{}` must start with http:// or https://",
                config.url
            )));
        }
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
            push_url: format!("{base}/push.v1.PusherService/Push"),
            basic_auth: config.basic_auth.clone(),
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
            url: self.push_url.clone(),
            message: error_chain(&e),
        })?;
        let status = response.status();
        if status.is_success() {
            return Ok(());
        }
        let text = response.text().await.unwrap_or_default();
        Err(PushError::Status {
            status: status.as_u16(),
            message: connect_message(&text),
            hint: hint(status),
        })
    }
}

/// Connect errors are JSON `{"code": "...", "message": "..."}`; anything else is shown as is
/// (shortened).
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
        Some((code, message)) if !message.is_empty() => format!("{code}: {message}"),
        _ => body.chars().take(300).collect::<String>().trim().to_string(),
    }
}

fn hint(status: StatusCode) -> &'static str {
    match status.as_u16() {
        401 | 403 => " (check pyroscope.basic_auth_user/basic_auth_password or bearer_token, and tenant_id)",
        404 => " (check pyroscope.url: it should be Pyroscope's base URL, without a path to an API)",
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
}
