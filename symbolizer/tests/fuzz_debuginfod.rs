//! Fuzzing the debuginfod client with hostile HTTP responses from a local server: random status
//! lines and headers, lengths that lie, chunked bodies that break, and bodies that are the
//! right debug file, another build's, a corrupted or cut copy, or noise.
//! Properties: no panic, no hang; a debug file is returned only if it is an ELF file of the
//! build-id asked for; the cache never keeps a wrong file or a partial download.

mod fuzz_support;
mod support;

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fuzz_support::{config, corpus, watch, EXTREMES};
use object::Object;
use proptest::prelude::*;
use proptest::test_runner::TestRunner;
use support::{tool, Fixtures};

/// The files a response body is made of.
struct Bodies {
    debug: Vec<u8>,
    other: Vec<u8>,
    build_id: Vec<u8>,
}

/// A server on 127.0.0.1 answering every request with the current response, then closing.
fn serve(response: Arc<Mutex<Vec<u8>>>) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind a local port");
    let url = format!("http://{}", listener.local_addr().expect("address"));
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let mut reader = BufReader::new(stream.try_clone().expect("clone stream"));
            let mut line = String::new();
            while reader.read_line(&mut line).is_ok_and(|n| n > 0) && line != "\r\n" {
                line.clear();
            }
            let bytes = response.lock().unwrap_or_else(|e| e.into_inner()).clone();
            let _ = stream.write_all(&bytes);
        }
    });
    url
}

/// One case: the response head (with `{len}` standing for the body's length) and the body.
fn body(bodies: &Bodies, kind: &str, n: usize) -> Vec<u8> {
    match kind {
        "debug" => bodies.debug.clone(),
        "other" => bodies.other.clone(),
        "empty" => Vec::new(),
        "truncated" => bodies.debug[..n.min(bodies.debug.len())].to_vec(),
        "garbage" => (0..n).map(|i| (i * 31 % 251) as u8).collect(),
        _ => panic!("unknown body kind {kind}"),
    }
}

fn run_case(
    url: &str,
    response: &Arc<Mutex<Vec<u8>>>,
    module: &Path,
    bodies: &Bodies,
    bytes: Vec<u8>,
) -> bool {
    let _guard = watch("debuginfod", &bytes);
    *response.lock().unwrap_or_else(|e| e.into_inner()) = bytes;
    let cache = tempfile::tempdir().expect("cache dir");
    let found = symbolizer::fuzzing::debuginfod_debug_file(
        vec![url.to_string()],
        cache.path(),
        module,
        Duration::from_secs(5),
    )
    .expect("the module itself is readable");
    let entry = cache
        .path()
        .join(symbolizer_hex(&bodies.build_id))
        .join("debuginfo");
    if let Some(path) = &found {
        assert_eq!(path, &entry);
    }
    // Whatever the server sent, the cache holds the right file or nothing, and no leftovers.
    for file in walk(cache.path()) {
        assert_eq!(file, entry, "stray file in the cache");
        let bytes = std::fs::read(&file).expect("read cache entry");
        let elf = object::File::parse(&*bytes).expect("cache entry is ELF");
        assert_eq!(elf.build_id().ok().flatten(), Some(&bodies.build_id[..]));
    }
    assert_eq!(found.is_some(), entry.exists());
    found.is_some()
}

fn symbolizer_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.is_dir() {
            files.extend(walk(&path));
        } else {
            files.push(path);
        }
    }
    files
}

/// `head` with `{len}` replaced, then `body`.
fn response(head: &str, body: &[u8]) -> Vec<u8> {
    let mut bytes = head.replace("{len}", &body.len().to_string()).into_bytes();
    bytes.extend_from_slice(body);
    bytes
}

fn setup(fixtures: &Fixtures) -> (std::path::PathBuf, Bodies) {
    let exe = fixtures.build_exe("fixture", &[]);
    let other = fixtures.build_exe("fixture-other", &["-DOTHER_BUILD=1"]);
    let stripped = fixtures.stripped_copy(&exe, "fixture-stripped");
    let keep_debug = |from: &Path, name: &str| {
        let to = fixtures.path(name);
        tool(
            "objcopy",
            &[
                "--only-keep-debug".into(),
                from.display().to_string(),
                to.display().to_string(),
            ],
        );
        std::fs::read(to).expect("read debug file")
    };
    let debug = keep_debug(&exe, "fixture.debug");
    let build_id = object::File::parse(&*debug)
        .expect("debug file parses")
        .build_id()
        .expect("notes")
        .expect("build-id")
        .to_vec();
    let bodies = Bodies {
        debug,
        other: keep_debug(&other, "other.debug"),
        build_id,
    };
    (stripped, bodies)
}

#[test]
fn corpus_responses_are_handled() {
    let fixtures = Fixtures::new();
    let (module, bodies) = setup(&fixtures);
    let current = Arc::new(Mutex::new(Vec::new()));
    let url = serve(current.clone());
    for (path, entry) in corpus("debuginfod") {
        // First line: `body KIND [N]`; the rest is the response head, CRLF-terminated lines.
        let text = String::from_utf8_lossy(&entry);
        let (first, head) = text
            .split_once('\n')
            .unwrap_or_else(|| panic!("{}: no head", path.display()));
        let words: Vec<&str> = first.split_whitespace().collect();
        let n = words.get(2).map_or(0, |n| n.parse().expect("body length"));
        let head = head.replace("\r\n", "\n").replace('\n', "\r\n");
        let bytes = response(&head, &body(&bodies, words[1], n));
        let found = run_case(&url, &current, &module, &bodies, bytes);
        // Only the honest answer (`ok*.http`) yields a debug file.
        let honest = path
            .file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with("ok"));
        assert_eq!(found, honest, "{}", path.display());
    }
}

#[test]
fn hostile_responses_never_panic_or_poison_the_cache() {
    let fixtures = Fixtures::new();
    let (module, bodies) = setup(&fixtures);
    let current = Arc::new(Mutex::new(Vec::new()));
    let url = serve(current.clone());

    let status = prop::sample::select(vec![
        "HTTP/1.1 200 OK",
        "HTTP/1.1 404 Not Found",
        "HTTP/1.1 500 Oops",
        "HTTP/1.1 302 Found\r\nLocation: http://127.0.0.1:1/x",
        "HTTP/1.0 200 OK",
        "HTTP/1.1 99999 What",
        "HTTP/1.1 200",
        "garbage",
        "",
    ]);
    let length = prop_oneof![
        Just("Content-Length: {len}".to_string()),
        prop::sample::select(EXTREMES).prop_map(|n| format!("Content-Length: {n}")),
        Just("Content-Length: -1".to_string()),
        Just("Transfer-Encoding: chunked".to_string()),
        Just(String::new()),
    ];
    let kind = prop::sample::select(vec!["debug", "other", "empty", "truncated", "garbage"]);
    let flips = prop::collection::vec((any::<usize>(), 0u8..8), 0..4);
    let strategy = (status, length, kind, 0usize..20_000, flips);
    let mut runner = TestRunner::new(config(60));
    let result = runner.run(&strategy, |(status, length, kind, n, flips)| {
        let mut body = body(&bodies, kind, n);
        for (at, bit) in flips {
            if !body.is_empty() {
                let i = at % body.len();
                body[i] ^= 1 << bit;
            }
        }
        if length.starts_with("Transfer-Encoding") {
            // One chunk, whose size line says `n` bytes whatever follows.
            let mut chunked = format!("{n:x}\r\n").into_bytes();
            chunked.extend_from_slice(&body);
            chunked.extend_from_slice(b"\r\n0\r\n\r\n");
            body = chunked;
        }
        let head = format!("{status}\r\n{length}\r\nConnection: close\r\n\r\n");
        run_case(&url, &current, &module, &bodies, response(&head, &body));
        Ok(())
    });
    if let Err(failure) = result {
        panic!("{failure}");
    }
}
