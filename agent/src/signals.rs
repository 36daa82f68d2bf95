//! The signals both front ends handle: SIGINT and SIGTERM stop them; SIGHUP ends a trace (its
//! terminal closed: the trace is kept) and reloads the agent's configuration. Installed before
//! the operator is told how to stop, so that a Ctrl-C from then on always ends cleanly.

use anyhow::{Context, Result};
use tokio::signal::unix::{signal, Signal, SignalKind};

pub struct Signals {
    pub interrupt: Signal,
    pub terminate: Signal,
    pub hangup: Signal,
}

impl Signals {
    pub fn install() -> Result<Self> {
        Ok(Self {
            interrupt: signal(SignalKind::interrupt()).context("installing the SIGINT handler")?,
            terminate: signal(SignalKind::terminate()).context("installing the SIGTERM handler")?,
            hangup: signal(SignalKind::hangup()).context("installing the SIGHUP handler")?,
        })
    }
}
