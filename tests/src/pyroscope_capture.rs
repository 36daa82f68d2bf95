//! A stand-in for Pyroscope's push endpoint that keeps every request: the agent's pushes are
//! decoded with Pyroscope's published protobuf types (push.v1, types.v1, google pprof), so the
//! tests check what a real server would receive. It can also answer with an error status, or
//! stop listening, to play an outage.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU16, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use flate2::read::GzDecoder;
use prost::Message;
use pyroscope::encode::gen::google::Profile as Pprof;
use pyroscope::encode::gen::push::PushRequest;

/// One HTTP request as received.
#[derive(Clone, Debug)]
pub struct Request {
    pub method: String,
    pub path: String,
    /// Header names lower-cased.
    pub headers: BTreeMap<String, String>,
    pub body: Vec<u8>,
    /// The status it was answered with.
    pub status: u16,
    /// When it was read: which pushes came after a change the test made.
    pub received: Instant,
}

/// One series of one push, its profiles decoded.
#[derive(Clone, Debug)]
pub struct Series {
    pub labels: BTreeMap<String, String>,
    pub profiles: Vec<Pprof>,
}

impl Series {
    pub fn label(&self, name: &str) -> Option<&str> {
        self.labels.get(name).map(String::as_str)
    }

    /// Every stack of every profile, root first, with its values.
    pub fn stacks(&self) -> Vec<(Vec<String>, Vec<i64>)> {
        let mut stacks = Vec::new();
        for profile in &self.profiles {
            let string = |index: i64| {
                profile
                    .string_table
                    .get(index as usize)
                    .cloned()
                    .unwrap_or_default()
            };
            for sample in &profile.sample {
                let mut frames: Vec<String> = sample
                    .location_id
                    .iter()
                    .filter_map(|id| profile.location.iter().find(|l| l.id == *id))
                    .filter_map(|location| location.line.first())
                    .filter_map(|line| profile.function.iter().find(|f| f.id == line.function_id))
                    .map(|function| string(function.name))
                    .collect();
                frames.reverse();
                stacks.push((frames, sample.value.clone()));
            }
        }
        stacks
    }
}

pub struct PyroscopeCapture {
    port: u16,
    requests: Arc<Mutex<Vec<Request>>>,
    status: Arc<AtomicU16>,
    stop: Arc<AtomicBool>,
    /// The accept loop, which ends once told to stop and its connections are answered.
    server: Option<thread::JoinHandle<()>>,
}

impl PyroscopeCapture {
    /// Listens on a free port of 127.0.0.1, answering 200 until told otherwise.
    pub fn start() -> Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").context("binding the capture server")?;
        let port = listener.local_addr()?.port();
        Self::serve(listener, port)
    }

    /// Listens on `port` (e.g. again after [`PyroscopeCapture::stop`]).
    pub fn start_on(port: u16) -> Result<Self> {
        let listener =
            TcpListener::bind(("127.0.0.1", port)).with_context(|| format!("binding port {port}"))?;
        Self::serve(listener, port)
    }

    fn serve(listener: TcpListener, port: u16) -> Result<Self> {
        listener.set_nonblocking(true)?;
        let requests = Arc::new(Mutex::new(Vec::new()));
        let status = Arc::new(AtomicU16::new(200));
        let stop = Arc::new(AtomicBool::new(false));
        let (thread_requests, thread_status, thread_stop) = (requests.clone(), status.clone(), stop.clone());
        let server = thread::spawn(move || {
            let mut connections = Vec::new();
            while !thread_stop.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((stream, _)) => {
                        let _ = stream.set_nonblocking(false);
                        let requests = thread_requests.clone();
                        let status = thread_status.load(Ordering::Relaxed);
                        connections.push(thread::spawn(move || handle(stream, &requests, status)));
                    }
                    Err(_) => thread::sleep(Duration::from_millis(20)),
                }
                connections.retain(|connection| !connection.is_finished());
            }
            drop(listener);
            for connection in connections {
                let _ = connection.join();
            }
        });
        Ok(Self {
            port,
            requests,
            status,
            stop,
            server: Some(server),
        })
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// Answer every request from now on with `status` (e.g. 503 for an overloaded server).
    pub fn answer_with(&self, status: u16) {
        self.status.store(status, Ordering::Relaxed);
    }

    /// Closes the port: connections are refused, as when Pyroscope is down.
    ///
    /// Returns every request it answered, those of connections it had accepted before the stop
    /// included: a push accepted a moment before the outage was answered 200, and its interval
    /// is delivered, though it came after any earlier look at [`PyroscopeCapture::requests`].
    pub fn stop(mut self) -> Vec<Request> {
        self.stop.store(true, Ordering::Relaxed);
        // The accept loop notices within its poll interval, drops the listener and waits for
        // the connections it accepted to be answered (each reads for at most 10 s).
        if let Some(server) = self.server.take() {
            let _ = server.join();
        }
        self.requests()
    }

    pub fn requests(&self) -> Vec<Request> {
        self.requests.lock().map(|r| r.clone()).unwrap_or_default()
    }

    /// Every series of every push answered 200, decoded.
    pub fn accepted_series(&self) -> Result<Vec<Series>> {
        let mut all = Vec::new();
        for request in self.requests().iter().filter(|r| r.status == 200) {
            all.extend(decode_push(request)?);
        }
        Ok(all)
    }
}

impl Drop for PyroscopeCapture {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Decodes a push request as Pyroscope does: the body as `PushRequest`, each raw profile
/// gunzipped and decoded as pprof.
pub fn decode_push(request: &Request) -> Result<Vec<Series>> {
    if request.path != "/push.v1.PusherService/Push" {
        bail!("request to {} instead of the push endpoint", request.path);
    }
    let push = PushRequest::decode(request.body.as_slice()).context("decoding PushRequest")?;
    let mut series = Vec::new();
    for raw in push.series {
        let labels = raw.labels.into_iter().map(|l| (l.name, l.value)).collect();
        let mut profiles = Vec::new();
        for sample in raw.samples {
            let mut bytes = Vec::new();
            GzDecoder::new(sample.raw_profile.as_slice())
                .read_to_end(&mut bytes)
                .context("gunzipping a raw profile")?;
            profiles.push(Pprof::decode(bytes.as_slice()).context("decoding a pprof profile")?);
        }
        series.push(Series { labels, profiles });
    }
    Ok(series)
}

fn handle(stream: TcpStream, requests: &Mutex<Vec<Request>>, status: u16) -> Result<()> {
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut writer = stream;
    // One request per connection (answered with `Connection: close`): a stopped server must
    // not keep serving a client's pooled connection.
    let Some(mut request) = read_request(&mut reader)? else {
        return Ok(());
    };
    write_answer(&mut writer, status)?;
    request.status = status;
    if let Ok(mut all) = requests.lock() {
        all.push(request);
    }
    Ok(())
}

/// Reads one HTTP/1.1 request (request line, headers, a `Content-Length` body); `None` when
/// the client closed the connection without sending one. Its `status` is 0 until answered.
pub(crate) fn read_request(reader: &mut impl BufRead) -> Result<Option<Request>> {
    let mut line = String::new();
    if reader.read_line(&mut line)? == 0 {
        return Ok(None);
    }
    let mut parts = line.split_whitespace();
    let method = parts.next().unwrap_or_default().to_string();
    let path = parts.next().unwrap_or_default().to_string();
    let mut headers = BTreeMap::new();
    loop {
        let mut header = String::new();
        reader.read_line(&mut header)?;
        let header = header.trim_end();
        if header.is_empty() {
            break;
        }
        if let Some((name, value)) = header.split_once(':') {
            headers.insert(name.trim().to_ascii_lowercase(), value.trim().to_string());
        }
    }
    let length: usize = headers
        .get("content-length")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let mut body = vec![0; length];
    reader.read_exact(&mut body)?;
    Ok(Some(Request {
        method,
        path,
        headers,
        body,
        status: 0,
        received: Instant::now(),
    }))
}

/// Answers with `status` as Pyroscope's Connect API does: an empty protobuf body for 200, a
/// Connect JSON error otherwise; then the connection is closed.
pub(crate) fn write_answer(writer: &mut impl Write, status: u16) -> Result<()> {
    let (reason, answer) = match status {
        200 => ("OK", String::new()),
        401 => (
            "Unauthorized",
            r#"{"code":"unauthenticated","message":"invalid credentials"}"#.to_string(),
        ),
        _ => (
            "Error",
            r#"{"code":"unavailable","message":"test outage"}"#.to_string(),
        ),
    };
    let content_type = if status == 200 {
        "application/proto"
    } else {
        "application/json"
    };
    write!(
        writer,
        "HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{answer}",
        answer.len()
    )?;
    writer.flush()?;
    Ok(())
}
