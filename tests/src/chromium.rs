//! Headless Chromium, for pages people read: pgscope's HTML report and Pyroscope's own UI.
//! `--virtual-time-budget` lets the page's scripts run (timers, fetches) before Chromium dumps
//! the DOM or takes the screenshot, without the test waiting that long in real time.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use anyhow::{bail, ensure, Context, Result};

/// Chromium, or an error that says how to get it (`scripts/install-deps.sh` installs it).
pub fn chromium() -> Result<PathBuf> {
    for name in ["chromium", "chromium-browser"] {
        if let Ok(output) = Command::new("which").arg(name).output() {
            let path = String::from_utf8_lossy(&output.stdout).trim().to_string();
            if output.status.success() && !path.is_empty() {
                return Ok(PathBuf::from(path));
            }
        }
    }
    bail!("the test renders a page in Chromium, which is not installed: apt-get install chromium")
}

/// Headless Chromium on `url` with `args` (`--dump-dom`, `--screenshot=…`), its profile in
/// `profile_dir`; scripts get `virtual_ms` of virtual time first.
pub fn headless(url: &str, profile_dir: &Path, virtual_ms: u32, args: &[&str]) -> Result<Output> {
    let output = Command::new(chromium()?)
        .args([
            "--headless",
            // Root cannot use Chromium's sandbox; the pages are our own or a local test server's.
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
        ])
        .arg(format!("--virtual-time-budget={virtual_ms}"))
        .arg(format!("--user-data-dir={}", profile_dir.display()))
        .args(args)
        .arg(url)
        .output()
        .context("running chromium")?;
    ensure!(
        output.status.success(),
        "chromium failed ({}): {}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(output)
}

/// Checks that `path` holds a PNG of a rendered page (more than a blank one's bytes).
pub fn check_screenshot(path: &Path) -> Result<usize> {
    let png = std::fs::read(path).with_context(|| format!("{} was not written", path.display()))?;
    ensure!(
        png.starts_with(b"\x89PNG") && png.len() > 20_000,
        "the screenshot is not a PNG of a rendered page ({} bytes)",
        png.len()
    );
    Ok(png.len())
}
