//! A push endpoint whose faults the test switches on and off: it takes pushes (200), answers
//! 500, answers 429 after a delay (an overloaded server), or is killed (its port closed, so
//! connections are refused) and restarted on the same port. Every request that reaches it is
//! kept in one log across restarts, with the answer it got, so a test can hold the agent's
//! counters against what the server really saw.
//!
//! The real Pyroscope is exercised by `agent_pyroscope.rs`; it cannot be told to fail on cue,
//! so fault injection uses this stand-in. Pushes are decoded with Pyroscope's own protobuf
//! types ([`crate::pyroscope_capture::decode_push`]).

use std::io::BufReader;
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::pyroscope_capture::{read_request, write_answer, Request};

/// How the server answers the pushes it receives from now on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// 200: the push is stored.
    Accept,
    /// 500 at once.
    Fail,
    /// 429 after this delay (the client waits for it, or gives up first).
    SlowTooMany(Duration),
}

impl Mode {
    fn status(self) -> u16 {
        match self {
            Mode::Accept => 200,
            Mode::Fail => 500,
            Mode::SlowTooMany(_) => 429,
        }
    }
}

struct Shared {
    mode: Mutex<Mode>,
    /// Every request received, in the order answered, with `status` set to the answer, and
    /// when it arrived.
    log: Mutex<Vec<(Instant, Request)>>,
}

/// The accept loop of one listening period (between a start and a kill).
struct Listening {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<()>,
}

pub struct FaultyPyroscope {
    port: u16,
    shared: Arc<Shared>,
    listening: Option<Listening>,
}

impl FaultyPyroscope {
    /// Listens on a free port of 127.0.0.1 in [`Mode::Accept`].
    pub fn start() -> Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").context("binding the fake Pyroscope")?;
        let port = listener.local_addr()?.port();
        let shared = Arc::new(Shared {
            mode: Mutex::new(Mode::Accept),
            log: Mutex::new(Vec::new()),
        });
        let listening = Some(listen(listener, shared.clone())?);
        Ok(Self {
            port,
            shared,
            listening,
        })
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn set_mode(&self, mode: Mode) {
        if let Ok(mut slot) = self.shared.mode.lock() {
            *slot = mode;
        }
    }

    /// Closes the port as a killed server does: new connections are refused until
    /// [`FaultyPyroscope::restart`]. Returns once the listener is closed.
    pub fn kill(&mut self) -> Result<()> {
        let Some(listening) = self.listening.take() else {
            bail!("the fake Pyroscope is not running");
        };
        listening.stop.store(true, Ordering::Relaxed);
        listening
            .thread
            .join()
            .map_err(|_| anyhow::anyhow!("the fake Pyroscope's accept loop panicked"))
    }

    /// Listens again on the same port, with the same log.
    pub fn restart(&mut self) -> Result<()> {
        if self.listening.is_some() {
            bail!("the fake Pyroscope is already running");
        }
        let listener = TcpListener::bind(("127.0.0.1", self.port))
            .with_context(|| format!("binding port {} again", self.port))?;
        self.listening = Some(listen(listener, self.shared.clone())?);
        Ok(())
    }

    /// Every request answered so far, in order.
    pub fn requests(&self) -> Vec<Request> {
        self.shared
            .log
            .lock()
            .map(|log| log.iter().map(|(_, r)| r.clone()).collect())
            .unwrap_or_default()
    }

    /// When the requests answered with `status` arrived, in order.
    pub fn arrivals(&self, status: u16) -> Vec<Instant> {
        let mut times: Vec<Instant> = self
            .shared
            .log
            .lock()
            .map(|log| {
                log.iter()
                    .filter(|(_, r)| r.status == status)
                    .map(|(t, _)| *t)
                    .collect()
            })
            .unwrap_or_default();
        times.sort();
        times
    }

    /// How many requests were answered with `status`.
    pub fn answered(&self, status: u16) -> usize {
        self.shared
            .log
            .lock()
            .map(|log| log.iter().filter(|(_, r)| r.status == status).count())
            .unwrap_or(0)
    }
}

impl Drop for FaultyPyroscope {
    fn drop(&mut self) {
        if let Some(listening) = self.listening.take() {
            listening.stop.store(true, Ordering::Relaxed);
        }
    }
}

fn listen(listener: TcpListener, shared: Arc<Shared>) -> Result<Listening> {
    listener.set_nonblocking(true)?;
    let stop = Arc::new(AtomicBool::new(false));
    let thread_stop = stop.clone();
    let thread = thread::spawn(move || {
        // The listener is dropped (the port closed) when this loop ends.
        while !thread_stop.load(Ordering::Relaxed) {
            match listener.accept() {
                Ok((stream, _)) => {
                    let shared = shared.clone();
                    thread::spawn(move || {
                        if let Err(error) = answer(stream, &shared) {
                            eprintln!("fake Pyroscope: {error:#}");
                        }
                    });
                }
                Err(_) => thread::sleep(Duration::from_millis(10)),
            }
        }
    });
    Ok(Listening { stop, thread })
}

/// One request per connection, answered in the mode in force when it arrived.
fn answer(stream: TcpStream, shared: &Shared) -> Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut writer = stream;
    let Some(mut request) = read_request(&mut reader)? else {
        return Ok(());
    };
    let arrived = Instant::now();
    let mode = shared.mode.lock().map(|m| *m).unwrap_or(Mode::Accept);
    if let Mode::SlowTooMany(delay) = mode {
        thread::sleep(delay);
    }
    request.status = mode.status();
    // Logged even when the client hung up meanwhile: it reached the server and failed.
    let written = write_answer(&mut writer, request.status);
    if let Ok(mut log) = shared.log.lock() {
        log.push((arrived, request));
    }
    written
}
