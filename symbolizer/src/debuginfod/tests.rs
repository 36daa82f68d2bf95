use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use super::*;

fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<OsString> {
    let map: HashMap<String, OsString> = pairs
        .iter()
        .map(|(name, value)| (name.to_string(), OsString::from(value)))
        .collect();
    move |name| map.get(name).cloned()
}

#[test]
fn server_urls_are_split_trimmed_and_filtered() {
    assert_eq!(
        server_urls("  http://a.example/  https://b.example:8002//\thttp://a.example "),
        vec!["http://a.example", "https://b.example:8002"]
    );
    assert_eq!(server_urls("HTTPS://c.example"), vec!["HTTPS://c.example"]);
    // Only http(s): file://, bare hosts and a scheme with nothing after it are dropped, and a
    // multi-byte character where the scheme would end does not panic.
    assert!(server_urls("file:///srv/debug ftp://x example.org http:// hé://x ĥttps://x").is_empty());
    assert!(server_urls("   ").is_empty());
}

#[test]
fn cache_dir_follows_elfutils_precedence() {
    let all = [
        ("DEBUGINFOD_CACHE_PATH", "/c"),
        ("XDG_CACHE_HOME", "/x"),
        ("HOME", "/h"),
    ];
    assert_eq!(cache_dir(vars(&all)), Some(PathBuf::from("/c")));
    assert_eq!(
        cache_dir(vars(&all[1..])),
        Some(PathBuf::from("/x/debuginfod_client"))
    );
    assert_eq!(
        cache_dir(vars(&all[2..])),
        Some(PathBuf::from("/h/.cache/debuginfod_client"))
    );
    // Empty counts as unset.
    assert_eq!(
        cache_dir(vars(&[
            ("DEBUGINFOD_CACHE_PATH", ""),
            ("XDG_CACHE_HOME", ""),
            ("HOME", "/h")
        ])),
        Some(PathBuf::from("/h/.cache/debuginfod_client"))
    );
    assert_eq!(cache_dir(vars(&[])), None);
}

#[test]
fn timeouts_follow_elfutils_meaning() {
    assert_eq!(timeout(None), Some(Duration::from_secs(90)));
    assert_eq!(timeout(Some("5")), Some(Duration::from_secs(5)));
    assert_eq!(timeout(Some(" 7 ")), Some(Duration::from_secs(7)));
    assert_eq!(timeout(Some("0")), None);
    assert_eq!(timeout(Some("-3")), None);
    assert_eq!(timeout(Some("soon")), Some(Duration::from_secs(90)));
    assert_eq!(max_time(None), DEFAULT_MAX_TIME);
    assert_eq!(max_time(Some("0")), DEFAULT_MAX_TIME);
    assert_eq!(max_time(Some("30")), Duration::from_secs(30));
}

#[test]
fn config_needs_urls_and_a_cache_dir() {
    assert_eq!(Config::from_vars(vars(&[("HOME", "/h")])), None);
    assert_eq!(
        Config::from_vars(vars(&[("DEBUGINFOD_URLS", " "), ("HOME", "/h")])),
        None
    );
    assert_eq!(Config::from_vars(vars(&[("DEBUGINFOD_URLS", "http://s")])), None);
    assert_eq!(
        Config::from_vars(vars(&[
            ("DEBUGINFOD_URLS", "http://s/ http://t"),
            ("XDG_CACHE_HOME", "/x"),
            ("DEBUGINFOD_TIMEOUT", "3"),
        ])),
        Some(Config {
            urls: vec!["http://s".into(), "http://t".into()],
            cache_dir: PathBuf::from("/x/debuginfod_client"),
            timeout: Some(Duration::from_secs(3)),
            max_time: DEFAULT_MAX_TIME,
        })
    );
}

#[test]
fn url_and_cache_entry_use_lowercase_hex() {
    let id = [0xAB, 0x01, 0xFF];
    assert_eq!(
        debuginfo_url("http://s:8002", &id),
        "http://s:8002/buildid/ab01ff/debuginfo"
    );
    assert_eq!(
        cache_entry(Path::new("/c"), &id),
        PathBuf::from("/c/ab01ff/debuginfo")
    );
}

#[test]
fn build_id_must_be_the_one_asked_for() {
    assert_eq!(check_build_id(&[1, 2, 3], Some(&[1, 2, 3])), Ok(()));
    let wrong = check_build_id(&[1, 2, 3], Some(&[1, 2, 4])).unwrap_err();
    assert_eq!(
        wrong.to_string(),
        "it is the debug file of build-id 010204, not 010203"
    );
    let none = check_build_id(&[0xaa], None).unwrap_err();
    assert_eq!(
        none.to_string(),
        "it is the debug file of build-id (none), not aa"
    );
    assert!(check_build_id(&[], Some(&[])).is_err());
}

/// A one-thread HTTP/1.1 server on 127.0.0.1 that answers every request with `respond(path)`
/// and records the paths asked for. Stops on drop.
struct Server {
    addr: SocketAddr,
    paths: Arc<Mutex<Vec<String>>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Server {
    fn start(respond: impl Fn(&str) -> (u16, Vec<u8>) + Send + 'static) -> Server {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind a local port");
        let addr = listener.local_addr().expect("local address");
        let paths = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (seen, stopped) = (paths.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            for stream in listener.incoming() {
                if stopped.load(Ordering::SeqCst) {
                    return;
                }
                let Ok(mut stream) = stream else { continue };
                let mut reader = BufReader::new(stream.try_clone().expect("clone stream"));
                let mut request_line = String::new();
                if reader.read_line(&mut request_line).is_err() {
                    continue;
                }
                // Skip the headers.
                let mut line = String::new();
                while reader.read_line(&mut line).is_ok_and(|n| n > 2) {
                    line.clear();
                }
                let path = request_line.split_whitespace().nth(1).unwrap_or("").to_string();
                let (status, body) = respond(&path);
                lock(&seen).push(path);
                let head = format!(
                    "HTTP/1.1 {status} X\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                    body.len()
                );
                let _ = stream.write_all(head.as_bytes());
                let _ = stream.write_all(&body);
            }
        });
        Server {
            addr,
            paths,
            stop,
            thread: Some(thread),
        }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn paths(&self) -> Vec<String> {
        lock(&self.paths).clone()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wakes the accept loop so that it sees the flag.
        let _ = TcpStream::connect(self.addr);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn client(urls: Vec<String>, cache_dir: &Path) -> Debuginfod {
    Debuginfod::new(Config {
        urls,
        cache_dir: cache_dir.to_path_buf(),
        timeout: Some(Duration::from_secs(5)),
        max_time: Duration::from_secs(20),
    })
}

/// This test binary: a real ELF file with a build-id (the system linker adds one), standing in
/// for both a module and its debug file.
fn this_binary() -> (ElfData, Vec<u8>) {
    let elf = ElfData::open(Path::new("/proc/self/exe")).expect("open the test binary");
    assert!(
        elf.build_id.is_some(),
        "the test binary has no build-id: link with -Wl,--build-id"
    );
    let bytes = std::fs::read("/proc/self/exe").expect("read the test binary");
    (elf, bytes)
}

/// Files in `dir` and below, relative to it.
fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in fs::read_dir(&dir).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path);
            } else {
                files.push(path.strip_prefix(dir.as_path()).unwrap_or(&path).to_path_buf());
            }
        }
    }
    files
}

#[test]
fn a_fetched_file_is_checked_cached_and_reused() {
    let (module, bytes) = this_binary();
    let id = hex(module.build_id.as_deref().unwrap_or_default());
    let cache = tempfile::tempdir().expect("temp dir");
    let server = Server::start(move |_| (200, bytes.clone()));
    // The first server has nothing; the second has it.
    let empty = Server::start(|_| (404, Vec::new()));

    let debuginfod = client(vec![empty.url(), server.url()], cache.path());
    let fetched = debuginfod
        .debug_file(&module, Path::new("/m"))
        .expect("fetched from the second server");
    let entry = cache.path().join(&id).join("debuginfo");
    assert_eq!(fetched.path, entry);
    assert_eq!(fetched.build_id, module.build_id);
    assert_eq!(files_under(cache.path()), vec![PathBuf::from("debuginfo")]);
    assert_eq!(empty.paths(), vec![format!("/buildid/{id}/debuginfo")]);
    assert_eq!(server.paths(), vec![format!("/buildid/{id}/debuginfo")]);

    // Another client (another run) finds it in the cache without asking.
    drop(server);
    let again = client(vec![empty.url()], cache.path())
        .debug_file(&module, Path::new("/m"))
        .expect("found in the cache");
    assert_eq!(again.path, entry);
    assert_eq!(empty.paths().len(), 1);
}

#[test]
fn a_wrong_or_non_elf_download_is_discarded() {
    let (mut module, bytes) = this_binary();
    // Asked for another build, the server sends this binary: the wrong file.
    module.build_id = Some(vec![0x12; 20]);
    let cache = tempfile::tempdir().expect("temp dir");
    let wrong = Server::start(move |_| (200, bytes.clone()));
    let garbage = Server::start(|_| (200, b"<html>not here</html>".to_vec()));
    let debuginfod = client(vec![wrong.url(), garbage.url()], cache.path());
    assert!(debuginfod.debug_file(&module, Path::new("/m")).is_none());
    assert_eq!(wrong.paths().len(), 1);
    assert_eq!(garbage.paths().len(), 1);
    // Neither the temporary files nor a cache entry remain.
    assert_eq!(files_under(cache.path()), Vec::<PathBuf>::new());

    // Remembered: not asked again in this run.
    assert!(debuginfod.debug_file(&module, Path::new("/m")).is_none());
    assert_eq!(wrong.paths().len() + garbage.paths().len(), 2);
}

#[test]
fn a_server_that_cannot_be_reached_is_not_asked_again() {
    let (mut module, _) = this_binary();
    let closed = {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind a local port");
        format!("http://{}", listener.local_addr().expect("local address"))
    };
    let counting = Server::start(|_| (404, Vec::new()));
    let cache = tempfile::tempdir().expect("temp dir");
    let debuginfod = client(vec![closed.clone(), counting.url()], cache.path());
    assert!(debuginfod.debug_file(&module, Path::new("/m")).is_none());
    assert!(lock(&debuginfod.down).contains(&closed));
    assert!(!lock(&debuginfod.down).contains(&counting.url()));

    // The next build-id skips the closed port and still asks the answering server.
    module.build_id = Some(vec![0x34; 20]);
    assert!(debuginfod.debug_file(&module, Path::new("/m")).is_none());
    assert_eq!(counting.paths().len(), 2);
    assert_eq!(files_under(cache.path()), Vec::<PathBuf>::new());
}

#[test]
fn an_empty_cache_entry_is_a_miss_and_gets_replaced() {
    let (module, bytes) = this_binary();
    let cache = tempfile::tempdir().expect("temp dir");
    let entry = cache_entry(cache.path(), module.build_id.as_deref().unwrap_or_default());
    fs::create_dir_all(entry.parent().expect("entry has a parent")).expect("create entry dir");
    // elfutils' mark of a failed query.
    fs::write(&entry, b"").expect("write marker");
    let server = Server::start(move |_| (200, bytes.clone()));
    let fetched = client(vec![server.url()], cache.path())
        .debug_file(&module, Path::new("/m"))
        .expect("fetched over the marker");
    assert_eq!(fetched.path, entry);
    assert!(fs::metadata(&entry).expect("entry").len() > 0);
}

/// https is set up (rustls, the system's trust store) and a failed handshake is an ordinary
/// server failure: here the "server" speaks plain HTTP.
#[test]
fn a_failed_tls_handshake_is_a_server_failure() {
    let (module, _) = this_binary();
    let plain = Server::start(|_| (404, Vec::new()));
    let https = format!("https://{}", plain.addr);
    let cache = tempfile::tempdir().expect("temp dir");
    let debuginfod = client(vec![https.clone()], cache.path());
    let entry = cache_entry(cache.path(), module.build_id.as_deref().unwrap_or_default());
    let failure = match debuginfod.fetch(module.build_id.as_deref().unwrap_or_default(), &entry) {
        Ok(_) => panic!("a plain-HTTP server passed for https"),
        Err(failure) => failure,
    };
    assert!(
        matches!(failure.errors.as_slice(), [FetchError::Request { .. }]),
        "expected one request error, got: {}",
        Causes(&failure.errors)
    );
    assert_eq!(failure.newly_down, vec![format!("`{https}`")]);
    eprintln!("{}", Causes(&failure.errors));
}
