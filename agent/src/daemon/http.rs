//! `/metrics`, `/healthz` and `/readyz` over HTTP/1.1.
//!
//! - `/healthz`: 200 while the main loop runs (it beats every second), 503 when it has not
//!   beaten for 30 s — a liveness probe restarts a stuck agent.
//! - `/readyz`: 200 once the BPF programs are attached and the first discovery ran.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use bytes::Bytes;
use http_body_util::Full;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tracing::{debug, warn};

use super::metrics::{self, OwnUsage, Snapshot};

/// How long the main loop may go without beating before `/healthz` fails.
const STALE_AFTER_SECS: u64 = 30;

/// What the main loop shares with the server.
#[derive(Default)]
pub struct Shared {
    pub snapshot: Mutex<Snapshot>,
    pub ready: AtomicBool,
    heartbeat_unix: AtomicU64,
}

impl Shared {
    pub fn beat(&self) {
        self.heartbeat_unix.store(unix_now(), Ordering::Relaxed);
    }

    pub fn publish(&self, snapshot: Snapshot) {
        if let Ok(mut slot) = self.snapshot.lock() {
            *slot = snapshot;
        }
    }

    fn healthy(&self) -> bool {
        unix_now().saturating_sub(self.heartbeat_unix.load(Ordering::Relaxed)) <= STALE_AFTER_SECS
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Binds `addr` now (so that a port in use is an error at start) and serves from a thread of
/// its own. Not from the main loop's runtime: that one thread also symbolizes, aggregates and
/// encodes, and on a busy host a long turn of it left `/metrics` unanswered for over 10 s (the
/// fault drill beside two CPU hogs), which a liveness probe takes for a dead agent; `/healthz`
/// says whether the main loop runs from its heartbeat, not from whether it answers.
pub fn serve(addr: SocketAddr, shared: Arc<Shared>) -> Result<SocketAddr> {
    let listener = std::net::TcpListener::bind(addr).with_context(|| {
        format!("listening on {addr} for /metrics (set server.metrics_addr or --metrics-addr)")
    })?;
    let local = listener.local_addr().context("reading the metrics address")?;
    listener
        .set_nonblocking(true)
        .context("making the metrics listener non-blocking")?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()
        .context("starting the metrics server's runtime")?;
    std::thread::Builder::new()
        .name("pgscope-http".to_string())
        .spawn(move || runtime.block_on(accept_loop(listener, shared)))
        .context("starting the metrics server's thread")?;
    Ok(local)
}

async fn accept_loop(listener: std::net::TcpListener, shared: Arc<Shared>) {
    let listener = match TcpListener::from_std(listener) {
        Ok(listener) => listener,
        Err(error) => {
            warn!("serving /metrics: {error}");
            return;
        }
    };
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(connection) => connection,
            Err(error) => {
                debug!("accepting a metrics connection: {error}");
                continue;
            }
        };
        let shared = shared.clone();
        tokio::spawn(async move {
            let service = service_fn(move |request| {
                let shared = shared.clone();
                async move { Ok::<_, Infallible>(respond(&request, &shared)) }
            });
            if let Err(error) = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await
            {
                debug!("metrics connection: {error}");
            }
        });
    }
}

fn respond<B>(request: &Request<B>, shared: &Shared) -> Response<Full<Bytes>> {
    let (status, content_type, body) = match request.uri().path() {
        "/metrics" => {
            let text = match shared.snapshot.lock() {
                Ok(snapshot) => metrics::render(&snapshot, &OwnUsage::read()),
                Err(_) => String::new(),
            };
            (StatusCode::OK, "text/plain; version=0.0.4; charset=utf-8", text)
        }
        "/healthz" if shared.healthy() => (StatusCode::OK, "text/plain", "ok\n".to_string()),
        "/healthz" => (
            StatusCode::SERVICE_UNAVAILABLE,
            "text/plain",
            "the main loop has not run for 30 s\n".to_string(),
        ),
        "/readyz" if shared.ready.load(Ordering::Relaxed) => {
            (StatusCode::OK, "text/plain", "ready\n".to_string())
        }
        "/readyz" => (
            StatusCode::SERVICE_UNAVAILABLE,
            "text/plain",
            "not attached yet\n".to_string(),
        ),
        _ => (
            StatusCode::NOT_FOUND,
            "text/plain",
            "pgscope agent: /metrics, /healthz, /readyz\n".to_string(),
        ),
    };
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    if let Ok(value) = content_type.parse() {
        response.headers_mut().insert(hyper::header::CONTENT_TYPE, value);
    }
    response
}
