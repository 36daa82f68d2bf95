//! `initdb` once per build: the data directory it makes is kept as a template and copied for
//! every later cluster of that build. `initdb` took 0.7 s a cluster and the suite starts about
//! two hundred; a copy takes 0.1 s.
//!
//! Templates live under the system's temp dir, one per build, `initdb` arguments and owner,
//! named by a hash of the build's programs (size, modification time), the arguments and the
//! test user's uid, so that a rebuilt Postgres gets a new one. Every test process may make one:
//! each makes it in a directory of its own and renames it into place, and a process that finds
//! the name taken uses the one already there. Clusters copied from one template share its
//! system identifier, as replicas of one primary do; nothing in pgscope or its tests tells
//! instances apart by it.

use std::collections::hash_map::DefaultHasher;
use std::fs;
use std::hash::{Hash, Hasher};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result};

use crate::install::PgInstall;
use crate::process::run_checked;
use crate::system::{chown, UserIds};

const COPY_TIMEOUT: Duration = Duration::from_secs(60);

/// The directory holding every build's template.
fn templates_root() -> PathBuf {
    std::env::temp_dir().join("pgscope-initdb-templates")
}

/// The template's name: the build's label and a hash of what makes its `initdb` output, and of
/// the user who owns it (Postgres refuses a data directory another user owns, and templates
/// outlive a test user recreated with another uid).
fn template_name(install: &PgInstall, user: UserIds, initdb_args: &[&str]) -> Result<String> {
    let mut hasher = DefaultHasher::new();
    user.uid.hash(&mut hasher);
    for program in ["initdb", "postgres"] {
        let path = install.bin(program);
        let meta = fs::metadata(&path).with_context(|| format!("cannot stat `{}`", path.display()))?;
        // Not the path: a copy of a build (`pgss_discovery::hooks_only`, linked or copied with
        // its times) makes the same data directory, and a template per copy would pile up.
        meta.len().hash(&mut hasher);
        meta.mtime().hash(&mut hasher);
        meta.mtime_nsec().hash(&mut hasher);
    }
    initdb_args.hash(&mut hasher);
    Ok(format!("{}-{:016x}", install.label, hasher.finish()))
}

/// Copies the template of `install` (made first, by `initdb` into the directory it is given,
/// as the test user, if there is none yet) to `data`, which must not exist.
pub fn copy_to(
    install: &PgInstall,
    user: UserIds,
    initdb_args: &[&str],
    data: &Path,
    initdb: impl FnOnce(&Path) -> Result<()>,
) -> Result<()> {
    let root = templates_root();
    fs::create_dir_all(&root).with_context(|| format!("cannot create `{}`", root.display()))?;
    let template = root.join(template_name(install, user, initdb_args)?);
    if !template.exists() {
        make(&root, &template, user, initdb)?;
    }
    run_checked(
        Command::new("cp").arg("-a").arg(template.join("data")).arg(data),
        COPY_TIMEOUT,
    )
    .with_context(|| format!("cannot copy the initdb template `{}`", template.display()))?;
    Ok(())
}

/// Runs `initdb` into a directory of this process's and renames it to `template`.
fn make(root: &Path, template: &Path, user: UserIds, initdb: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let making = tempfile::Builder::new()
        .prefix("making-")
        .tempdir_in(root)
        .with_context(|| format!("cannot create a directory in `{}`", root.display()))?;
    fs::set_permissions(making.path(), fs::Permissions::from_mode(0o755))?;
    chown(making.path(), user)?;
    initdb(&making.path().join("data"))?;
    let made = making.keep();
    if fs::rename(&made, template).is_err() {
        // Another test process renamed its own first: theirs is as good.
        fs::remove_dir_all(&made).with_context(|| format!("cannot remove `{}`", made.display()))?;
    }
    Ok(())
}
