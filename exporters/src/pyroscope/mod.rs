//! Sending profiles to Grafana Pyroscope through the push API Grafana Alloy uses:
//! `POST /push.v1.PusherService/Push` (Connect unary, `application/proto`), one series per
//! label set, each sample a gzipped pprof.
//!
//! - [`series`]: a [`crate::Profile`] → series within Pyroscope's limits (label names, label
//!   count, samples and bytes per profile);
//! - [`client`]: one push over HTTP(S) with auth, errors told apart as retryable or not;
//! - [`redact`]: credentials out of the URLs and errors it shows;
//! - [`sender`]: the bounded upload queue and the background task that empties it, retrying
//!   with backoff, never blocking whoever enqueues.
//!
//! The request and pprof message types are the ones the `pyroscope` crate generates from
//! Pyroscope's own `.proto` files.

pub mod client;
pub mod redact;
pub mod sender;
pub mod series;

pub use client::{split_credentials, ClientConfig, PushClient, PushError};
pub use sender::{Sender, SenderConfig, SenderStats};
pub use series::{build_series, encode_push_request, Built, Limits, SeriesProfile};
