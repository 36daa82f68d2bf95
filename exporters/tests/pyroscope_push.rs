//! The Pyroscope sender against a real HTTP server on 127.0.0.1 that answers with scripted
//! statuses and keeps every request: what arrives is decoded with Pyroscope's published
//! protobuf types; retries, drops and the shutdown flush are counted exactly.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use exporters::pyroscope::{build_series, ClientConfig, Limits, Sender, SenderConfig};
use exporters::{Frame, FrameKind, Profile, ProfileMeta, StackSample};
use flate2::read::GzDecoder;
use prost::Message;
use pyroscope::encode::gen::google::Profile as Pprof;
use pyroscope::encode::gen::push::PushRequest;

struct Received {
    headers: Vec<(String, String)>,
    body: Vec<u8>,
    status: u16,
}

/// Answers each request with the next scripted status, then 200.
struct Server {
    port: u16,
    received: Arc<Mutex<Vec<Received>>>,
}

impl Server {
    fn start(script: &[u16]) -> Server {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        Self::serve(listener, script)
    }

    fn serve(listener: TcpListener, script: &[u16]) -> Server {
        Self::serve_with(listener, script, Duration::ZERO, String::new())
    }

    /// Each answer comes `delay` after its connection: a request stays in flight that long.
    fn serve_with_delay(listener: TcpListener, script: &[u16], delay: Duration) -> Server {
        Self::serve_with(listener, script, delay, String::new())
    }

    /// Answers every request with 307 to `location`.
    fn redirecting_to(location: &str) -> Server {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        Self::serve_with(
            listener,
            &[307; 100],
            Duration::ZERO,
            format!("Location: {location}\r\n"),
        )
    }

    fn serve_with(listener: TcpListener, script: &[u16], delay: Duration, headers: String) -> Server {
        let port = listener.local_addr().expect("address").port();
        let received = Arc::new(Mutex::new(Vec::new()));
        let script = Arc::new(Mutex::new(script.iter().copied().collect::<VecDeque<u16>>()));
        let (r, s) = (received.clone(), script.clone());
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let status = s.lock().expect("script").pop_front().unwrap_or(200);
                std::thread::sleep(delay);
                let _ = answer(stream, status, &headers, &r);
            }
        });
        Server { port, received }
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn accepted(&self) -> Vec<PushRequest> {
        self.received
            .lock()
            .expect("requests")
            .iter()
            .filter(|r| r.status == 200)
            .map(|r| PushRequest::decode(r.body.as_slice()).expect("a PushRequest"))
            .collect()
    }

    fn requests(&self) -> usize {
        self.received.lock().expect("requests").len()
    }
}

fn answer(
    stream: TcpStream,
    status: u16,
    extra_headers: &str,
    received: &Mutex<Vec<Received>>,
) -> std::io::Result<()> {
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let mut headers = Vec::new();
    loop {
        let mut header = String::new();
        reader.read_line(&mut header)?;
        let header = header.trim_end().to_string();
        if header.is_empty() {
            break;
        }
        if let Some((name, value)) = header.split_once(':') {
            headers.push((name.trim().to_ascii_lowercase(), value.trim().to_string()));
        }
    }
    let length = headers
        .iter()
        .find(|(n, _)| n == "content-length")
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(0);
    let mut body = vec![0; length];
    reader.read_exact(&mut body)?;
    let text = match status {
        200 => String::new(),
        _ => r#"{"code":"invalid_argument","message":"scripted refusal"}"#.to_string(),
    };
    // Kept before answering: once the sender has its answer, the request is here.
    received.lock().expect("requests").push(Received {
        headers,
        body,
        status,
    });
    let mut stream = stream;
    write!(
        stream,
        "HTTP/1.1 {status} X\r\n{extra_headers}Content-Length: {}\r\nConnection: close\r\n\r\n{text}",
        text.len()
    )?;
    Ok(())
}

fn frame(name: &str) -> Frame {
    Frame {
        name: name.into(),
        kind: FrameKind::User,
        module: None,
    }
}

fn cpu_profile(stacks: usize) -> Profile {
    Profile {
        meta: ProfileMeta::cpu(19, 1_700_000_000_000_000_000, 15_000_000_000),
        samples: (0..stacks)
            .map(|i| StackSample {
                frames: vec![frame("main"), frame(&format!("f{i}"))],
                labels: vec![
                    ("queryid".into(), format!("{}", i % 2)),
                    ("wait-event".into(), "LWLock:pg_stat_statements".into()),
                ],
                count: 1 + i as u64,
            })
            .collect(),
    }
}

fn base() -> Vec<(String, String)> {
    vec![("service_name".into(), "postgres/main".into())]
}

fn client(url: String) -> ClientConfig {
    ClientConfig {
        url,
        basic_auth: Some(("user".into(), "pass".into())),
        tenant_id: Some("team-a".into()),
        timeout: Duration::from_secs(5),
        user_agent: "pgscope-test".into(),
        ..ClientConfig::default()
    }
}

fn fast() -> SenderConfig {
    SenderConfig {
        initial_backoff: Duration::from_millis(10),
        max_backoff: Duration::from_millis(40),
        ..SenderConfig::default()
    }
}

async fn wait_until(what: &str, check: impl Fn() -> bool) {
    for _ in 0..500 {
        if check() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("timed out waiting for {what}");
}

#[tokio::test]
async fn pushes_carry_series_labels_types_and_values() {
    let server = Server::start(&[]);
    let sender = Sender::start(client(server.url()), fast()).expect("sender");
    let built = build_series(&cpu_profile(4), "process_cpu", &base(), &Limits::default()).expect("series");
    sender.enqueue(built.series);
    assert_eq!(sender.flush(Duration::from_secs(10)).await, 0);

    let received = server.received.lock().expect("requests");
    let headers = &received[0].headers;
    let header = |name: &str| headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str());
    assert_eq!(header("content-type"), Some("application/proto"));
    assert_eq!(header("authorization"), Some("Basic dXNlcjpwYXNz"));
    assert_eq!(header("x-scope-orgid"), Some("team-a"));
    drop(received);

    let pushes = server.accepted();
    assert_eq!(pushes.len(), 1);
    let series = &pushes[0].series;
    assert_eq!(series.len(), 2, "one series per queryid");
    let mut total = 0;
    for s in series {
        let labels: Vec<(&str, &str)> = s
            .labels
            .iter()
            .map(|l| (l.name.as_str(), l.value.as_str()))
            .collect();
        assert!(labels.contains(&("__name__", "process_cpu")));
        assert!(labels.contains(&("service_name", "postgres/main")));
        assert!(labels.contains(&("wait_event", "LWLock:pg_stat_statements")));
        assert_eq!(s.samples.len(), 1);
        assert!(!s.samples[0].id.is_empty());
        let mut bytes = Vec::new();
        GzDecoder::new(s.samples[0].raw_profile.as_slice())
            .read_to_end(&mut bytes)
            .expect("gunzip");
        let pprof = Pprof::decode(bytes.as_slice()).expect("pprof");
        let string = |i: i64| pprof.string_table[i as usize].as_str();
        let types: Vec<(&str, &str)> = pprof
            .sample_type
            .iter()
            .map(|t| (string(t.r#type), string(t.unit)))
            .collect();
        assert_eq!(types, vec![("samples", "count"), ("cpu", "nanoseconds")]);
        assert_eq!(pprof.period, 1_000_000_000 / 19);
        for sample in &pprof.sample {
            assert!(sample.label.is_empty(), "labels belong to the series");
            assert_eq!(sample.value[1], sample.value[0] * pprof.period);
            total += sample.value[0];
        }
    }
    assert_eq!(total, (1..=4).sum::<i64>());
}

#[tokio::test]
async fn retryable_errors_are_retried_until_the_batch_arrives() {
    let server = Server::start(&[503, 503]);
    let sender = Sender::start(client(server.url()), fast()).expect("sender");
    sender.enqueue(
        build_series(&cpu_profile(2), "process_cpu", &base(), &Limits::default())
            .expect("series")
            .series,
    );
    wait_until("the third attempt", || server.accepted().len() == 1).await;
    // The server keeps a request once it has answered; the sender counts it once it has read
    // the answer, a moment later.
    wait_until("the sender to count it", || sender.stats().pushes_ok == 1).await;
    let stats = sender.stats();
    assert_eq!(stats.retries, 2);
    assert_eq!(stats.pushes_failed_retryable, 2);
    assert_eq!(stats.pushes_ok, 1);
    assert_eq!(stats.queue_depth_batches, 0);
}

#[tokio::test]
async fn permanent_errors_drop_the_batch_and_go_on() {
    let server = Server::start(&[400]);
    let sender = Sender::start(client(server.url()), fast()).expect("sender");
    let series = build_series(&cpu_profile(2), "process_cpu", &base(), &Limits::default())
        .expect("series")
        .series;
    sender.enqueue(series.clone());
    sender.enqueue(series);
    wait_until("both batches handled", || server.requests() == 2).await;
    wait_until("the counters", || sender.stats().pushes_ok == 1).await;
    let stats = sender.stats();
    assert_eq!(stats.dropped_permanent_batches, 1);
    assert_eq!(stats.pushes_failed_permanent, 1);
    assert_eq!(stats.retries, 0);
}

#[tokio::test]
async fn a_full_queue_drops_the_oldest_and_the_rest_arrives_once_the_server_is_up() {
    // A port nobody listens on yet.
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("address").port();
    drop(listener);
    let one = build_series(&cpu_profile(3000), "process_cpu", &base(), &Limits::default())
        .expect("series")
        .series;
    let size = exporters::pyroscope::encode_push_request(&one).len() as u64;
    let config = SenderConfig {
        // Room for three batches (IDs in the encoding change sizes by a few bytes).
        queue_max_bytes: size * 3 + size / 2,
        ..fast()
    };
    let sender = Sender::start(client(format!("http://127.0.0.1:{port}")), config).expect("sender");
    for _ in 0..5 {
        sender.enqueue(one.clone());
    }
    let stats = sender.stats();
    assert_eq!(stats.dropped_queue_full_batches, 2);
    assert_eq!(stats.dropped_queue_full_series, 2 * one.len() as u64);
    assert_eq!(stats.queue_depth_batches, 3);
    wait_until("a failed attempt", || sender.stats().pushes_failed_retryable >= 1).await;

    let server = Server::serve(TcpListener::bind(("127.0.0.1", port)).expect("rebind"), &[]);
    wait_until("the queued batches", || server.accepted().len() == 3).await;
    wait_until("the sender to count them", || {
        sender.stats().queue_depth_batches == 0
    })
    .await;
    assert_eq!(sender.stats().dropped_queue_full_batches, 2);
}

#[tokio::test]
async fn flush_gives_up_at_its_deadline_when_the_server_is_down() {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("address").port();
    drop(listener);
    let sender = Sender::start(client(format!("http://127.0.0.1:{port}")), fast()).expect("sender");
    sender.enqueue(
        build_series(&cpu_profile(2), "process_cpu", &base(), &Limits::default())
            .expect("series")
            .series,
    );
    let started = std::time::Instant::now();
    let unsent = sender.flush(Duration::from_millis(300)).await;
    assert_eq!(unsent, 1);
    // Loose: the deadline bounds the wait, not a benchmark.
    assert!(started.elapsed() < Duration::from_secs(5));
}

#[tokio::test]
async fn batches_queued_while_backing_off_do_not_cut_the_backoff_short() {
    // Every push fails; the backoff is half a second (full jitter: 0-500 ms per wait).
    let server = Server::start(&[503; 1000]);
    let config = SenderConfig {
        initial_backoff: Duration::from_millis(500),
        max_backoff: Duration::from_millis(500),
        ..SenderConfig::default()
    };
    let sender = Sender::start(client(server.url()), config).expect("sender");
    let series = build_series(&cpu_profile(2), "process_cpu", &base(), &Limits::default())
        .expect("series")
        .series;
    // 100 batches over about a second, as agents queue an interval of every instance.
    for _ in 0..100 {
        sender.enqueue(series.clone());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let attempts = server.requests();
    // Backing off, the sender tries a few times a second; woken by every batch, it tried about
    // once per batch.
    assert!(
        (1..=20).contains(&attempts),
        "{attempts} pushes while 100 batches were queued over ~1 s with a 500 ms backoff"
    );
    assert_eq!(sender.stats().queue_depth_batches, 100);
}

#[tokio::test]
async fn the_batch_in_flight_is_not_dropped_for_room() {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let server = Server::serve_with_delay(listener, &[], Duration::from_millis(700));
    let one = build_series(&cpu_profile(3000), "process_cpu", &base(), &Limits::default())
        .expect("series")
        .series;
    let size = exporters::pyroscope::encode_push_request(&one).len() as u64;
    let config = SenderConfig {
        queue_max_bytes: size * 3 + size / 2,
        ..fast()
    };
    let sender = Sender::start(client(server.url()), config).expect("sender");
    sender.enqueue(one.clone());
    // The first batch is on its way (the server holds its answer), then four more come: two
    // must go for room, and neither may be the one being sent.
    tokio::time::sleep(Duration::from_millis(200)).await;
    for _ in 0..4 {
        sender.enqueue(one.clone());
    }
    wait_until("the queue to empty", || sender.stats().queue_depth_batches == 0).await;
    let stats = sender.stats();
    let delivered = server.accepted().len() as u64;
    assert_eq!(stats.dropped_queue_full_batches, 2);
    assert_eq!(
        delivered + stats.dropped_queue_full_batches,
        5,
        "a batch was both delivered and counted as dropped: {delivered} delivered, {stats:?}"
    );
}

#[tokio::test]
async fn a_redirect_is_not_followed_with_the_credentials() {
    let elsewhere = Server::start(&[]);
    let redirecting = Server::redirecting_to(&format!("{}/push.v1.PusherService/Push", elsewhere.url()));
    let sender = Sender::start(client(redirecting.url()), fast()).expect("sender");
    sender.enqueue(
        build_series(&cpu_profile(2), "process_cpu", &base(), &Limits::default())
            .expect("series")
            .series,
    );
    wait_until("the redirect answered", || {
        sender.stats().pushes_failed_permanent == 1
    })
    .await;
    assert_eq!(redirecting.requests(), 1);
    assert_eq!(
        elsewhere.requests(),
        0,
        "the push (and its basic auth) followed the redirect"
    );
    assert_eq!(sender.stats().dropped_permanent_batches, 1);
}
