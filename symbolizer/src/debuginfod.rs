//! The debuginfod client protocol, the last place a debug file is looked for: when
//! `DEBUGINFOD_URLS` is set (space-separated server URLs, as elfutils defines it), the debug file
//! of a stripped module that no local tree has is fetched by build-id
//! (`GET <url>/buildid/<hex>/debuginfo`) into the cache the elfutils client keeps, so that files
//! gdb or perf fetched are reused here and the other way round.
//!
//! HTTP is synchronous (ureq): the symbolizer runs inside the agent's tokio current-thread
//! runtime, where the blocking wrapper of an async client panics. A download blocks that thread,
//! so every wait is bounded and a server that cannot be reached is not asked again in this run.

use std::collections::HashSet;
use std::ffi::OsString;
use std::fmt;
use std::fs;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use ureq::tls::{RootCerts, TlsConfig};

use crate::elf::{hex, ElfData};

/// elfutils' default for `DEBUGINFOD_TIMEOUT`.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(90);

/// Longest one debug file may take over all servers when `DEBUGINFOD_MAXTIME` does not say
/// (elfutils waits forever): samples queue up while a download blocks the agent, and a Postgres
/// debug file (~30 MB) arrives well within this on any usable link.
const DEFAULT_MAX_TIME: Duration = Duration::from_secs(120);

/// What the environment asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Config {
    /// Server base URLs without a trailing slash, in the order they are asked.
    pub urls: Vec<String>,
    /// Root of the elfutils-compatible cache: `<cache_dir>/<build-id>/debuginfo`.
    pub cache_dir: PathBuf,
    /// `DEBUGINFOD_TIMEOUT`: the limit on connecting, on waiting for the answer and on any pause
    /// while the file arrives (None: zero or negative, no limit).
    pub timeout: Option<Duration>,
    /// Total time for one debug file, all servers included.
    pub max_time: Duration,
}

impl Config {
    /// The configuration from the variables `var` returns, or None when `DEBUGINFOD_URLS` names
    /// no usable server. Tells once why a set variable is not used.
    pub fn from_vars(var: impl Fn(&str) -> Option<OsString>) -> Option<Config> {
        let text = |name: &str| var(name).map(|v| v.to_string_lossy().into_owned());
        let urls = server_urls(&text("DEBUGINFOD_URLS")?);
        if urls.is_empty() {
            return None;
        }
        let Some(cache_dir) = cache_dir(&var) else {
            tracing::warn!(
                "DEBUGINFOD_URLS is set but neither DEBUGINFOD_CACHE_PATH, XDG_CACHE_HOME nor \
                 HOME names a cache directory; not fetching debug files: set DEBUGINFOD_CACHE_PATH"
            );
            return None;
        };
        Some(Config {
            urls,
            cache_dir,
            timeout: timeout(text("DEBUGINFOD_TIMEOUT").as_deref()),
            max_time: max_time(text("DEBUGINFOD_MAXTIME").as_deref()),
        })
    }
}

/// The servers of a `DEBUGINFOD_URLS` value: whitespace-separated, trailing slashes dropped (as
/// elfutils does), only http and https (this client speaks nothing else; each other one is
/// named once in a warning).
pub(crate) fn server_urls(value: &str) -> Vec<String> {
    let mut urls: Vec<String> = Vec::new();
    for url in value.split_whitespace() {
        let url = url.trim_end_matches('/');
        let scheme_ok = ["http://", "https://"].iter().any(|scheme| {
            url.len() > scheme.len()
                && url
                    .get(..scheme.len())
                    .is_some_and(|s| s.eq_ignore_ascii_case(scheme))
        });
        if !scheme_ok {
            tracing::warn!(
                url,
                "ignoring this DEBUGINFOD_URLS entry: only http:// and https:// servers are supported"
            );
        } else if !urls.iter().any(|known| known == url) {
            urls.push(url.to_string());
        }
    }
    urls
}

/// The cache directory elfutils' client uses: `$DEBUGINFOD_CACHE_PATH`, else
/// `$XDG_CACHE_HOME/debuginfod_client`, else `$HOME/.cache/debuginfod_client`. Empty values count
/// as unset.
pub(crate) fn cache_dir(var: impl Fn(&str) -> Option<OsString>) -> Option<PathBuf> {
    let set = |name: &str| var(name).filter(|v| !v.is_empty()).map(PathBuf::from);
    set("DEBUGINFOD_CACHE_PATH")
        .or_else(|| set("XDG_CACHE_HOME").map(|dir| dir.join("debuginfod_client")))
        .or_else(|| set("HOME").map(|home| home.join(".cache").join("debuginfod_client")))
}

/// `DEBUGINFOD_TIMEOUT` in seconds: unset or unreadable is the default, zero or negative is no
/// limit (elfutils' meaning).
pub(crate) fn timeout(value: Option<&str>) -> Option<Duration> {
    match value.map(|v| v.trim().parse::<i64>()) {
        None => Some(DEFAULT_TIMEOUT),
        Some(Ok(secs)) if secs <= 0 => None,
        Some(Ok(secs)) => Some(Duration::from_secs(secs.unsigned_abs())),
        Some(Err(_)) => {
            tracing::warn!(value, "DEBUGINFOD_TIMEOUT is not a number of seconds; using 90");
            Some(DEFAULT_TIMEOUT)
        }
    }
}

/// `DEBUGINFOD_MAXTIME` in seconds when positive, else [`DEFAULT_MAX_TIME`].
pub(crate) fn max_time(value: Option<&str>) -> Duration {
    match value.and_then(|v| v.trim().parse::<i64>().ok()) {
        Some(secs) if secs > 0 => Duration::from_secs(secs.unsigned_abs()),
        _ => DEFAULT_MAX_TIME,
    }
}

/// `<server>/buildid/<lowercase hex>/debuginfo`.
pub(crate) fn debuginfo_url(server: &str, build_id: &[u8]) -> String {
    format!("{server}/buildid/{}/debuginfo", hex(build_id))
}

/// `<cache>/<lowercase hex>/debuginfo`, where elfutils' client keeps it.
pub(crate) fn cache_entry(cache_dir: &Path, build_id: &[u8]) -> PathBuf {
    cache_dir.join(hex(build_id)).join("debuginfo")
}

/// A build-id other than the one asked for (or none at all).
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("it is the debug file of build-id {}, not {}", .found.as_deref().unwrap_or("(none)"), .wanted)]
pub(crate) struct WrongBuild {
    wanted: String,
    found: Option<String>,
}

/// Whether a file with build-id `found` is the debug file of build-id `wanted`.
pub(crate) fn check_build_id(wanted: &[u8], found: Option<&[u8]>) -> Result<(), WrongBuild> {
    match found {
        Some(found) if found == wanted && !wanted.is_empty() => Ok(()),
        _ => Err(WrongBuild {
            wanted: hex(wanted),
            found: found.map(hex),
        }),
    }
}

/// Why one server did not provide a debug file.
#[derive(Debug, thiserror::Error)]
pub(crate) enum FetchError {
    #[error("`{url}` has no such file (HTTP 404)")]
    NotFound { url: String },
    #[error("`{url}` answered HTTP {status}")]
    Status { url: String, status: u16 },
    #[error("cannot fetch `{url}`")]
    Request {
        url: String,
        #[source]
        source: Box<ureq::Error>,
    },
    #[error("the download of `{url}` broke off")]
    Receive {
        url: String,
        #[source]
        source: io::Error,
    },
    #[error("cannot write to the debuginfod cache `{path}`")]
    Cache {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("`{url}` sent a file that is not a 64-bit ELF file; discarded")]
    NotElf {
        url: String,
        #[source]
        source: crate::Error,
    },
    #[error("`{url}` sent an ELF file without section headers (cut off?); discarded")]
    NoSectionHeaders { url: String },
    #[error("`{url}` sent the wrong file; discarded")]
    WrongBuild {
        url: String,
        #[source]
        source: WrongBuild,
    },
}

impl FetchError {
    /// Whether the server itself failed (down, unreachable, too slow), rather than answering
    /// about this one file: such a server is not asked again in this run.
    fn server_failed(&self) -> bool {
        matches!(self, FetchError::Request { .. } | FetchError::Receive { .. })
    }
}

/// Each error with its causes, `; `-separated, for one log line.
struct Causes<'a>(&'a [FetchError]);

impl fmt::Display for Causes<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, error) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            write!(f, "{error}")?;
            let mut source = std::error::Error::source(error);
            while let Some(cause) = source {
                write!(f, ": {cause}")?;
                source = cause.source();
            }
        }
        Ok(())
    }
}

/// The client: one per process (see [`from_env`]), so that what failed is remembered across
/// every symbolizer of this run.
pub(crate) struct Debuginfod {
    config: Config,
    agent: ureq::Agent,
    /// Build-ids no server provided.
    failed: Mutex<HashSet<Vec<u8>>>,
    /// Servers that could not be reached or broke off.
    down: Mutex<HashSet<String>>,
}

/// The process's client, configured from its environment on first use; None when
/// `DEBUGINFOD_URLS` is unset or names no usable server.
pub(crate) fn from_env() -> Option<&'static Debuginfod> {
    static CLIENT: OnceLock<Option<Debuginfod>> = OnceLock::new();
    CLIENT
        .get_or_init(|| Config::from_vars(|name| std::env::var_os(name)).map(Debuginfod::new))
        .as_ref()
}

impl Debuginfod {
    pub fn new(config: Config) -> Debuginfod {
        let agent = ureq::Agent::config_builder()
            // Status codes are answers about one file, not transport failures.
            .http_status_as_error(false)
            .timeout_resolve(config.timeout)
            .timeout_connect(config.timeout)
            .timeout_recv_response(config.timeout)
            .timeout_per_read(config.timeout)
            // The system's trust store, as elfutils' libcurl uses: in-house servers often have an
            // in-house CA.
            .tls_config(
                TlsConfig::builder()
                    .root_certs(RootCerts::PlatformVerifier)
                    .build(),
            )
            .user_agent(concat!("pgscope/", env!("CARGO_PKG_VERSION")))
            .build()
            .new_agent();
        Debuginfod {
            config,
            agent,
            failed: Mutex::new(HashSet::new()),
            down: Mutex::new(HashSet::new()),
        }
    }

    /// The debug file of `elf` (found at `module`), from the cache or else from the servers,
    /// checked to be ELF with the same build-id. A failure is logged once per build-id and
    /// remembered; None then, as without debuginfod.
    pub fn debug_file(&self, elf: &ElfData, module: &Path) -> Option<ElfData> {
        let build_id = elf.build_id.as_deref().filter(|id| !id.is_empty())?;
        if lock(&self.failed).contains(build_id) {
            return None;
        }
        let entry = cache_entry(&self.config.cache_dir, build_id);
        if let Some(cached) = cached(&entry, build_id) {
            return Some(cached);
        }
        match self.fetch(build_id, &entry) {
            Ok(debug) => {
                tracing::info!(
                    module = %module.display(),
                    debug_file = %entry.display(),
                    "fetched debug file from debuginfod"
                );
                Some(debug)
            }
            Err(Failure { errors, newly_down }) => {
                lock(&self.failed).insert(build_id.to_vec());
                if errors.is_empty() {
                    // Every server is known to be down and was reported when it failed.
                    tracing::debug!(module = %module.display(), "no debuginfod server left to ask");
                } else {
                    tracing::warn!(
                        "no debug file from debuginfod for `{}` (build-id {}): {}{}; its static \
                         functions stay unnamed: check DEBUGINFOD_URLS, or install its debug \
                         package or pass --debug-dir",
                        module.display(),
                        hex(build_id),
                        Causes(&errors),
                        match newly_down.as_slice() {
                            [] => String::new(),
                            down => format!(" (not asking {} again in this run)", down.join(", ")),
                        }
                    );
                }
                None
            }
        }
    }

    /// Asks each server in turn, within [`Config::max_time`] in all.
    fn fetch(&self, build_id: &[u8], entry: &Path) -> Result<ElfData, Failure> {
        let deadline = Instant::now() + self.config.max_time;
        let mut failure = Failure::default();
        for server in &self.config.urls {
            if lock(&self.down).contains(server) {
                continue;
            }
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                break;
            }
            let url = debuginfo_url(server, build_id);
            match self.fetch_from(&url, build_id, entry, remaining) {
                Ok(debug) => return Ok(debug),
                Err(error) => {
                    if error.server_failed() {
                        lock(&self.down).insert(server.clone());
                        failure.newly_down.push(format!("`{server}`"));
                    }
                    let local = matches!(error, FetchError::Cache { .. });
                    failure.errors.push(error);
                    // The next server's file could not be stored either.
                    if local {
                        break;
                    }
                }
            }
        }
        Err(failure)
    }

    /// One `GET`, streamed into a temporary file beside the cache entry, which becomes the entry
    /// only once it is known to be the right ELF file: an interrupted or wrong download never
    /// does.
    fn fetch_from(
        &self,
        url: &str,
        build_id: &[u8],
        entry: &Path,
        time: Duration,
    ) -> Result<ElfData, FetchError> {
        let response = self
            .agent
            .get(url)
            .config()
            .timeout_global(Some(time))
            .build()
            .call()
            .map_err(|source| FetchError::Request {
                url: url.to_string(),
                source: Box::new(source),
            })?;
        match response.status().as_u16() {
            200 => {}
            404 => return Err(FetchError::NotFound { url: url.to_string() }),
            status => {
                return Err(FetchError::Status {
                    url: url.to_string(),
                    status,
                })
            }
        }
        let dir = entry.parent().unwrap_or(Path::new("."));
        let cache_err = |source| FetchError::Cache {
            path: dir.to_path_buf(),
            source,
        };
        fs::create_dir_all(dir).map_err(cache_err)?;
        let mut temp = tempfile::Builder::new()
            .prefix(".debuginfo.")
            .tempfile_in(dir)
            .map_err(cache_err)?;
        let mut body = response.into_body().into_reader();
        copy(&mut body, temp.as_file_mut()).map_err(|error| match error {
            CopyError::Read(source) => FetchError::Receive {
                url: url.to_string(),
                source,
            },
            CopyError::Write(source) => cache_err(source),
        })?;
        let mut debug =
            ElfData::from_file(temp.as_file(), temp.path()).map_err(|source| FetchError::NotElf {
                url: url.to_string(),
                source,
            })?;
        // A debug file is read through its sections; a cut one still has the program headers
        // (and build-id note) of its start.
        if !debug.has_section_headers {
            return Err(FetchError::NoSectionHeaders { url: url.to_string() });
        }
        check_build_id(build_id, debug.build_id.as_deref()).map_err(|source| FetchError::WrongBuild {
            url: url.to_string(),
            source,
        })?;
        // The mapping follows the file through the rename.
        temp.persist(entry).map_err(|error| FetchError::Cache {
            path: entry.to_path_buf(),
            source: error.error,
        })?;
        debug.path = entry.to_path_buf();
        Ok(debug)
    }
}

/// What no server provided, and which servers failed for the first time.
#[derive(Default)]
struct Failure {
    errors: Vec<FetchError>,
    newly_down: Vec<String>,
}

/// The cache entry, if one is there and is the right ELF file. elfutils marks a failed query
/// with an empty file: that is a miss here, and a fetch that succeeds replaces it.
fn cached(entry: &Path, build_id: &[u8]) -> Option<ElfData> {
    let metadata = fs::metadata(entry).ok()?;
    if !metadata.is_file() || metadata.len() == 0 {
        return None;
    }
    let debug = match ElfData::open(entry) {
        Ok(debug) => debug,
        Err(error) => {
            let error: &(dyn std::error::Error + 'static) = &error;
            tracing::warn!(error, "ignoring a bad debuginfod cache entry; fetching it again");
            return None;
        }
    };
    match check_build_id(build_id, debug.build_id.as_deref()) {
        Ok(()) if debug.has_section_headers => Some(debug),
        Ok(()) => {
            tracing::warn!(entry = %entry.display(), "ignoring a debuginfod cache entry without section headers; fetching it again");
            None
        }
        Err(error) => {
            let error: &(dyn std::error::Error + 'static) = &error;
            tracing::warn!(entry = %entry.display(), error, "ignoring a bad debuginfod cache entry; fetching it again");
            None
        }
    }
}

enum CopyError {
    Read(io::Error),
    Write(io::Error),
}

/// `io::copy`, telling a failed read (the network) from a failed write (the disk).
fn copy(from: &mut impl Read, to: &mut impl Write) -> Result<(), CopyError> {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) => return to.flush().map_err(CopyError::Write),
            Ok(n) => n,
            Err(error) if error.kind() == io::ErrorKind::Interrupted => continue,
            Err(error) => return Err(CopyError::Read(error)),
        };
        to.write_all(&buf[..n]).map_err(CopyError::Write)?;
    }
}

/// The sets only ever grow; one poisoned by a panic elsewhere is still usable.
fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
mod tests;
