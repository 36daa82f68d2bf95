//! What Pyroscope (or a proxy in front of it) answers a push, as the client classifies it:
//! success, an error worth retrying (408, 429, 5xx, the network), or one to drop. Any status,
//! headers and body, and any bytes at all, give one of these without a panic and within the
//! client's timeout, with an error message of bounded length; an endless body is not read to
//! its end (a bug found here: the whole body was read into memory).
//!
//! Seeds (`exporters/tests/corpus/pyroscope_responses/`) are raw HTTP answers as Pyroscope v1
//! gives them (Connect JSON errors, an empty proto success), as a proxy gives them (HTML), and
//! chunked; they are replayed first, then mutated, then random answers are built. A loopback
//! server writes each answer as given and closes the connection.

use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::thread::JoinHandle;
use std::time::Duration;

use exporters::pyroscope::{ClientConfig, PushClient, PushError};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

/// Cases per property: `PGSCOPE_FUZZ_CASES`, else `default`.
fn config(default: u32) -> Config {
    let cases = std::env::var("PGSCOPE_FUZZ_CASES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(default);
    Config {
        cases,
        max_shrink_iters: 64,
        ..Config::default()
    }
}

/// The longest error message the client may make of an answer.
const MESSAGE_MAX_CHARS: usize = 1024;

/// Reads one request (headers, then the body its Content-Length announces).
fn read_request(stream: &mut TcpStream) {
    let mut request = Vec::new();
    let mut buf = [0u8; 4096];
    let header_end = loop {
        match stream.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => request.extend_from_slice(&buf[..n]),
        }
        if let Some(at) = request.windows(4).position(|w| w == b"\r\n\r\n") {
            break at + 4;
        }
    };
    let head = String::from_utf8_lossy(&request[..header_end]).to_ascii_lowercase();
    let length: usize = head
        .lines()
        .find_map(|line| line.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    let mut have = request.len() - header_end;
    while have < length {
        match stream.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => have += n,
        }
    }
}

/// Serves one connection: reads the push, then writes what `answer` writes (returning the
/// bytes written) and closes.
fn serve_once<F>(answer: F) -> (u16, JoinHandle<u64>)
where
    F: FnOnce(&mut TcpStream) -> u64 + Send + 'static,
{
    let listener = TcpListener::bind("127.0.0.1:0").expect("a loopback port");
    let port = listener.local_addr().expect("bound").port();
    let server = std::thread::spawn(move || {
        let Ok((mut stream, _)) = listener.accept() else {
            return 0;
        };
        let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
        let _ = stream.set_write_timeout(Some(Duration::from_secs(10)));
        read_request(&mut stream);
        answer(&mut stream)
    });
    (port, server)
}

fn push_to(port: u16) -> Result<(), PushError> {
    let client = PushClient::new(&ClientConfig {
        url: format!("http://127.0.0.1:{port}"),
        timeout: Duration::from_secs(5),
        user_agent: "pgscope-test".into(),
        ..ClientConfig::default()
    })
    .expect("a client");
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime")
        .block_on(client.push(b"\x0a\x00".to_vec()))
}

/// Sends `response` verbatim as the answer to one push and returns how the client took it.
fn answer_with(response: Vec<u8>) -> Result<(), PushError> {
    let (port, server) = serve_once(move |stream| {
        let _ = stream.write_all(&response);
        let _ = stream.shutdown(std::net::Shutdown::Both);
        response.len() as u64
    });
    let result = push_to(port);
    let _ = server.join();
    result
}

/// What every outcome must satisfy, given the status line the server sent (if it parses).
fn check_outcome(result: &Result<(), PushError>, sent_status: Option<u16>) {
    match result {
        Ok(()) => assert!(
            sent_status.is_some_and(|s| (200..300).contains(&s)),
            "success on the answer {sent_status:?}"
        ),
        Err(PushError::Status { status, message, .. }) => {
            assert!(!(200..300).contains(status), "{status} is a success");
            assert!(
                message.chars().count() <= MESSAGE_MAX_CHARS,
                "a {}-char message",
                message.len()
            );
            let error = result.as_ref().expect_err("an error");
            assert_eq!(
                error.is_retryable(),
                *status == 408 || *status == 429 || *status >= 500,
                "{status}"
            );
        }
        Err(PushError::Unreachable { .. }) => {
            assert!(result.as_ref().expect_err("an error").is_retryable());
        }
        Err(error @ PushError::Config(_)) => panic!("a configuration error from an answer: {error}"),
    }
}

/// The status code of a raw answer's status line, if it has one.
///
/// Read as bytes: the reason phrase after the code may hold any octet above 0x7f (`obs-text`,
/// RFC 9112 section 4), which a client rightly accepts, so the line need not be UTF-8. Empty
/// lines before it are skipped, as clients do (httparse), and so is the reason phrase: a line
/// that ends right after the code (`HTTP/1.1 200\r\n`) is a status line to them (a mutation
/// that deleted " OK" found this oracle calling it none).
fn status_of(response: &[u8]) -> Option<u16> {
    let line = response
        .split(|&b| b == b'\n')
        .find(|line| !line.is_empty() && *line != b"\r")?;
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let mut parts = line.split(|&b| b == b' ');
    parts.next().filter(|v| *v == b"HTTP/1.1" || *v == b"HTTP/1.0")?;
    std::str::from_utf8(parts.next()?).ok()?.parse().ok()
}

fn seeds() -> Vec<(String, Vec<u8>)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/corpus/pyroscope_responses");
    let mut seeds: Vec<(String, Vec<u8>)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("the seed corpus `{}`: {e}", dir.display()))
        .filter_map(|entry| entry.ok())
        .map(|entry| {
            let name = entry.file_name().to_string_lossy().into_owned();
            let bytes = std::fs::read(entry.path()).unwrap_or_else(|e| panic!("seed `{name}`: {e}"));
            (name, bytes)
        })
        .collect();
    seeds.sort();
    assert!(!seeds.is_empty(), "no seeds in `{}`", dir.display());
    seeds
}

#[test]
fn seed_answers_are_classified() {
    for (name, response) in seeds() {
        let status = status_of(&response).expect("seeds have a status line");
        let result = answer_with(response);
        check_outcome(&result, Some(status));
        match (&result, status) {
            (Ok(()), 200) => {}
            (
                Err(PushError::Status {
                    status: got, message, ..
                }),
                sent,
            ) => {
                assert_eq!(*got, sent, "{name}");
                if name.contains("429") {
                    assert!(message.contains("ingestion rate limit"), "{name}: {message}");
                }
                if name.contains("chunked-json") {
                    assert_eq!(message, "internal: db write failed", "{name}");
                }
            }
            (other, _) => panic!("{name}: {other:?}"),
        }
    }
}

#[derive(Clone, Debug)]
enum Edit {
    Flip(usize, u8),
    Delete(usize, usize),
    Insert(usize, Vec<u8>),
    Truncate(usize),
}

fn mutate(seed: &[u8], edits: &[Edit]) -> Vec<u8> {
    let mut bytes = seed.to_vec();
    for edit in edits {
        let len = bytes.len();
        let pos = |at: usize| at % (len + 1);
        match edit {
            Edit::Flip(at, bit) if len > 0 => bytes[at % len] ^= 1 << bit,
            Edit::Flip(..) => {}
            Edit::Delete(at, count) => {
                let start = pos(*at);
                bytes.drain(start..(start + count).min(len));
            }
            Edit::Insert(at, new) => {
                let at = pos(*at);
                bytes.splice(at..at, new.iter().copied());
            }
            Edit::Truncate(at) => bytes.truncate(pos(*at)),
        }
    }
    bytes
}

fn edit() -> impl Strategy<Value = Edit> {
    let tokens = prop_oneof![
        Just(b"\r\n".to_vec()),
        Just(b"Content-Length: 99999999\r\n".to_vec()),
        Just(b"Transfer-Encoding: chunked\r\n".to_vec()),
        Just(b"Content-Encoding: gzip\r\n".to_vec()),
        Just(b"ffffffffffffffff\r\n".to_vec()),
        Just(b"{\"code\":".to_vec()),
        Just(vec![0xff, 0xfe, 0x00]),
        proptest::collection::vec(any::<u8>(), 1..16),
    ];
    prop_oneof![
        (any::<usize>(), 0u8..8).prop_map(|(at, bit)| Edit::Flip(at, bit)),
        (any::<usize>(), 1usize..32).prop_map(|(at, n)| Edit::Delete(at, n)),
        (any::<usize>(), tokens).prop_map(|(at, bytes)| Edit::Insert(at, bytes)),
        any::<usize>().prop_map(Edit::Truncate),
    ]
}

#[test]
fn mutated_answers_are_classified() {
    let seeds: Vec<Vec<u8>> = seeds().into_iter().map(|(_, bytes)| bytes).collect();
    let count = seeds.len();
    let strategy = (0..count, proptest::collection::vec(edit(), 1..4));
    TestRunner::new(config(48))
        .run(&strategy, |(index, edits)| {
            let response = mutate(&seeds[index], &edits);
            let status = status_of(&response);
            check_outcome(&answer_with(response), status);
            Ok(())
        })
        .expect("mutated answers");
}

/// A well-formed answer: any final status, some headers, a body of any kind and length.
fn built_answer() -> impl Strategy<Value = (u16, Vec<u8>)> {
    let body = prop_oneof![
        Just(String::new()),
        ("[a-z_]{0,20}", ".{0,3000}").prop_map(|(code, message)| {
            serde_json::json!({ "code": code, "message": message }).to_string()
        }),
        ".{0,3000}",
        "\\{\\[{0,300}",
    ];
    let headers = proptest::collection::vec(
        prop_oneof![
            Just("Content-Type: application/json"),
            Just("Content-Type: text/html; charset=iso-8859-1"),
            Just("Retry-After: 30"),
            Just("Retry-After: -1"),
            Just("Connection: close"),
            Just("Connection: keep-alive"),
            Just("Location: /elsewhere"),
            Just("X-Padding: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"),
        ],
        0..4,
    );
    (200u16..600, headers, body, any::<bool>()).prop_map(|(status, headers, body, chunked)| {
        let mut out = format!("HTTP/1.1 {status} Whatever\r\n");
        for header in headers {
            out.push_str(header);
            out.push_str("\r\n");
        }
        let mut bytes = if chunked {
            out.push_str("Transfer-Encoding: chunked\r\n\r\n");
            let mut bytes = out.into_bytes();
            for chunk in body.as_bytes().chunks(700) {
                bytes.extend(format!("{:x}\r\n", chunk.len()).into_bytes());
                bytes.extend(chunk);
                bytes.extend(b"\r\n");
            }
            bytes.extend(b"0\r\n\r\n");
            bytes
        } else {
            out.push_str(&format!("Content-Length: {}\r\n\r\n", body.len()));
            let mut bytes = out.into_bytes();
            bytes.extend(body.as_bytes());
            bytes
        };
        bytes.shrink_to_fit();
        (status, bytes)
    })
}

#[test]
fn any_status_headers_and_body_are_classified() {
    TestRunner::new(config(48))
        .run(&built_answer(), |(status, response)| {
            let result = answer_with(response);
            check_outcome(&result, Some(status));
            // A redirect without a usable Location is an answer like any other.
            match &result {
                Ok(()) => prop_assert!((200..300).contains(&status)),
                Err(PushError::Status { status: got, .. }) => prop_assert_eq!(*got, status),
                Err(other) => prop_assert!(false, "{} for a well-formed {} answer", other, status),
            }
            Ok(())
        })
        .expect("built answers");
}

#[test]
fn an_endless_error_body_is_not_read_to_its_end() {
    const SENT_MAX: u64 = 256 << 20;
    let (port, server) = serve_once(|stream| {
        let head = b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: text/plain\r\nContent-Length: 1099511627776\r\n\r\n";
        if stream.write_all(head).is_err() {
            return 0;
        }
        let chunk = vec![b'x'; 1 << 20];
        let mut sent = 0;
        while sent < SENT_MAX {
            match stream.write_all(&chunk) {
                Ok(()) => sent += chunk.len() as u64,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => break,
            }
        }
        sent
    });
    let result = push_to(port);
    let sent = server.join().expect("the server thread");
    check_outcome(&result, Some(500));
    assert!(
        matches!(result, Err(PushError::Status { status: 500, .. })),
        "{result:?}"
    );
    // The client reads a bounded start and hangs up; the socket buffers take a few MiB more.
    assert!(
        sent < 64 << 20,
        "the client read {} MiB of an error body",
        sent >> 20
    );
}
