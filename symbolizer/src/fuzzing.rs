//! Entry points for the fuzz harnesses (`tests/fuzz_*.rs`) into parsers that the public API
//! reaches only through the network or the environment. Not part of the API.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::debuginfod::{Config, Debuginfod};
use crate::elf::ElfData;
use crate::Error;

/// Asks the debuginfod servers `servers` for the debug file of the ELF file at `module`, as the
/// symbolizer does when `DEBUGINFOD_URLS` is set, with a fresh client caching under
/// `cache_dir` and every wait bounded by `timeout`. Returns the path of the accepted (checked)
/// debug file, or None when no server provided one.
pub fn debuginfod_debug_file(
    servers: Vec<String>,
    cache_dir: &Path,
    module: &Path,
    timeout: Duration,
) -> Result<Option<PathBuf>, Error> {
    let elf = ElfData::open(module)?;
    let client = Debuginfod::new(Config {
        urls: servers,
        cache_dir: cache_dir.to_path_buf(),
        timeout: Some(timeout),
        max_time: timeout.saturating_mul(2),
    });
    Ok(client.debug_file(&elf, module).map(|debug| debug.path))
}
