//! Where `pgss_store`, pg_stat_statements' static store function, is in a build's
//! `pg_stat_statements.so`: as pgscope reports finding it through the library's hook functions,
//! and as a symbol table names it (the library's own `.symtab`, or its separate debug file).
//!
//! pgscope takes the hook path only when the library has no symbol for `pgss_store`. Upstream
//! builds keep `.symtab`, so [`hooks_only`] gives a copy of such a build whose
//! `pg_stat_statements.so` is stripped: the same code at the same file offsets, no names.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use object::{Object, ObjectSection, ObjectSymbol};
use tempfile::TempDir;

use crate::install::PgInstall;
use crate::process::run_checked;

/// What pgscope says when it found pgss_store through the hook functions.
pub const FOUND_THROUGH_HOOKS: &str = "pgscope: pgss_store found through pg_stat_statements' hook functions";

/// The library pgss_store is in.
pub const LIBRARY: &str = "pg_stat_statements.so";

/// Copying a build's tree as hard links and stripping one library take well under a second.
const COPY_TIMEOUT: Duration = Duration::from_secs(60);

/// The file `basename` as process `pid` maps it.
pub fn mapped_library(pid: u32, basename: &str) -> Result<PathBuf> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps"))
        .with_context(|| format!("cannot read the maps of PID {pid}"))?;
    maps.lines()
        .filter_map(|line| line.split_whitespace().nth(5))
        .map(PathBuf::from)
        .find(|path| path.file_name().is_some_and(|name| name == basename))
        .with_context(|| format!("PID {pid} maps no {basename}"))
}

/// The file offset pgscope printed when it found pgss_store through the hook functions.
pub fn offset_found_through_hooks(stderr: &str) -> Result<u64> {
    let line = stderr
        .lines()
        .find(|line| line.starts_with(FOUND_THROUGH_HOOKS))
        .with_context(|| format!("pgscope did not say it found pgss_store through the hooks:\n{stderr}"))?;
    let hex = line
        .split("at file offset 0x")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .with_context(|| format!("no file offset in `{line}`"))?;
    u64::from_str_radix(hex, 16).with_context(|| format!("bad file offset in `{line}`"))
}

/// The lowercase hex build-id of the ELF file `path`.
pub fn build_id_hex(path: &Path) -> Result<String> {
    let bytes = read(path)?;
    let file = parse(path, &bytes)?;
    let id = file
        .build_id()?
        .with_context(|| format!("`{}` has no build-id", path.display()))?;
    Ok(id.iter().map(|b| format!("{b:02x}")).collect())
}

/// The debug file of build-id `hex` in the build-id tree `debug_dir`.
pub fn debug_file_in_tree(debug_dir: &Path, hex: &str) -> PathBuf {
    debug_dir
        .join(".build-id")
        .join(&hex[..2])
        .join(format!("{}.debug", &hex[2..]))
}

/// The debug file of `library` in the build-id tree `debug_dir`.
pub fn debug_file_of(library: &Path, debug_dir: &Path) -> Result<PathBuf> {
    Ok(debug_file_in_tree(debug_dir, &build_id_hex(library)?))
}

/// The file offset in `library` of the function `symbols` (the library itself, or its debug
/// file) names `name`: what a uprobe by name attaches to. `None` when `symbols` has no such
/// symbol.
pub fn symbol_file_offset(library: &Path, symbols: &Path, name: &str) -> Result<Option<u64>> {
    let symbols_bytes = read(symbols)?;
    let Some(svma) = parse(symbols, &symbols_bytes)?
        .symbols()
        .find(|s| s.name() == Ok(name))
        .map(|s| s.address())
    else {
        return Ok(None);
    };
    let bytes = read(library)?;
    let file = parse(library, &bytes)?;
    let text = file
        .section_by_name(".text")
        .with_context(|| format!("`{}` has no .text", library.display()))?;
    let (text_offset, _) = text.file_range().context(".text has no file bytes")?;
    if !(text.address()..text.address() + text.size()).contains(&svma) {
        bail!("{name} at {svma:#x} is outside .text of `{}`", library.display());
    }
    Ok(Some(svma - text.address() + text_offset))
}

/// Like [`symbol_file_offset`], an error when there is no such symbol.
pub fn offset_by_name(library: &Path, symbols: &Path) -> Result<u64> {
    symbol_file_offset(library, symbols, "pgss_store")?
        .with_context(|| format!("`{}` has no symbol pgss_store", symbols.display()))
}

/// A build on which pgscope can only find pgss_store through the hook functions, and what names
/// pgss_store's offset for comparison.
pub struct HooksOnly {
    /// The build to run: the given one, or a copy whose `pg_stat_statements.so` is stripped.
    pub install: PgInstall,
    /// Holds pgss_store's symbol: the original library's `.symtab` or the build's debug tree;
    /// `None` for a build that ships neither (the distro's).
    pub names: Option<SymbolSource>,
    /// The copy, removed on drop; the cluster running it must be dropped first.
    _copy: Option<TempDir>,
}

/// Where a build's pgss_store symbol is.
#[derive(Debug, Clone)]
pub enum SymbolSource {
    /// In this file's `.symtab`: the library the build ships, the same code as the stripped copy
    /// that runs.
    Symtab(PathBuf),
    /// In the debug file of the loaded library's build-id in this `.build-id` tree.
    DebugTree(PathBuf),
}

impl HooksOnly {
    /// The file offset of pgss_store by name in `loaded` (the library the backend maps), or
    /// `None` when the build has no symbol for it anywhere.
    pub fn offset_by_name(&self, loaded: &Path) -> Result<Option<u64>> {
        match &self.names {
            None => Ok(None),
            Some(SymbolSource::Symtab(original)) => {
                let offset = offset_by_name(original, original)?;
                same_code_at(original, loaded, offset)?;
                Ok(Some(offset))
            }
            Some(SymbolSource::DebugTree(tree)) => {
                offset_by_name(loaded, &debug_file_of(loaded, tree)?).map(Some)
            }
        }
    }
}

/// `install` as pgscope sees a build whose pg_stat_statements.so has no symbol for pgss_store.
/// A build whose library has one in `.symtab` (the upstream builds) is copied, its files hard
/// links to the originals (Postgres finds its libraries and share files relative to its
/// executable) except the library, stripped.
pub fn hooks_only(install: &PgInstall) -> Result<HooksOnly> {
    let library = install.pkglibdir.join(LIBRARY);
    if symbol_file_offset(&library, &library, "pgss_store")?.is_none() {
        return Ok(HooksOnly {
            install: install.clone(),
            names: install.debug_dir.clone().map(SymbolSource::DebugTree),
            _copy: None,
        });
    }
    let root = install
        .bindir
        .parent()
        .with_context(|| format!("`{}` has no parent", install.bindir.display()))?;
    let relative = |dir: &Path| -> Result<PathBuf> {
        Ok(dir
            .strip_prefix(root)
            .with_context(|| format!("`{}` is not under `{}`", dir.display(), root.display()))?
            .to_path_buf())
    };
    let (bin, pkglib) = (relative(&install.bindir)?, relative(&install.pkglibdir)?);

    let copy = tempfile::Builder::new().prefix("pgscope-hooks-only-").tempdir()?;
    // The cluster runs as an unprivileged user, who must reach the programs.
    std::fs::set_permissions(copy.path(), std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
    let tree = copy.path().join("install");
    // Hard links cost nothing, but only within one file system (a tmpfs /tmp is another):
    // a plain copy of the tree (tens of MB) otherwise.
    if run_checked(Command::new("cp").arg("-al").arg(root).arg(&tree), COPY_TIMEOUT).is_err() {
        if tree.exists() {
            std::fs::remove_dir_all(&tree)?;
        }
        run_checked(Command::new("cp").arg("-a").arg(root).arg(&tree), COPY_TIMEOUT)
            .with_context(|| format!("cannot copy `{}`", root.display()))?;
    }
    let stripped = tree.join(&pkglib).join(LIBRARY);
    // A hard link: strip must write a new file, never the original's inode.
    std::fs::remove_file(&stripped)?;
    run_checked(
        Command::new("strip")
            .args(["--strip-all", "-o"])
            .arg(&stripped)
            .arg(&library),
        COPY_TIMEOUT,
    )
    .context("cannot strip pg_stat_statements.so (binutils)")?;
    ensure!(
        symbol_file_offset(&stripped, &stripped, "pgss_store")?.is_none(),
        "`{}` still names pgss_store after strip",
        stripped.display()
    );
    Ok(HooksOnly {
        install: PgInstall {
            bindir: tree.join(bin),
            pkglibdir: tree.join(pkglib),
            ..install.clone()
        },
        names: Some(SymbolSource::Symtab(library)),
        _copy: Some(copy),
    })
}

/// The stripped copy must hold the original's code at `offset`: strip keeps the loaded
/// segments where they are, and the offset by name is only comparable if it did.
fn same_code_at(original: &Path, copy: &Path, offset: u64) -> Result<()> {
    let window = |path: &Path| -> Result<Vec<u8>> {
        let bytes = read(path)?;
        let start = usize::try_from(offset)?;
        bytes
            .get(start..start + 64)
            .map(<[u8]>::to_vec)
            .with_context(|| format!("`{}` ends before {offset:#x}", path.display()))
    };
    ensure!(
        window(original)? == window(copy)?,
        "`{}` holds other code than `{}` at {offset:#x}: the offsets are not comparable",
        copy.display(),
        original.display()
    );
    Ok(())
}

fn read(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).with_context(|| format!("cannot read `{}`", path.display()))
}

fn parse<'a>(path: &Path, bytes: &'a [u8]) -> Result<object::File<'a>> {
    object::File::parse(bytes).with_context(|| format!("cannot parse `{}`", path.display()))
}
