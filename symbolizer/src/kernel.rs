//! Kernel text symbols from `/proc/kallsyms`.

use std::io::BufRead;
use std::path::{Path, PathBuf};

use crate::Error;

const KALLSYMS: &str = "/proc/kallsyms";

/// Kernel text symbols, sorted by address. Addresses are real only when read as root with
/// `kernel.kptr_restrict` below 2; [`KernelSymbols::load`] refuses all-zero addresses.
#[derive(Debug, Default)]
pub struct KernelSymbols {
    /// (address, offset into `names`, length), sorted by address then preference.
    entries: Vec<(u64, u32, u32)>,
    names: String,
}

impl KernelSymbols {
    /// Read `/proc/kallsyms`.
    pub fn load() -> Result<Self, Error> {
        let path = Path::new(KALLSYMS);
        let file = std::fs::File::open(path).map_err(|source| Error::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::parse(std::io::BufReader::new(file), path)
    }

    /// Parse text in the `/proc/kallsyms` format (for tests and saved copies).
    pub fn from_reader(r: impl BufRead) -> Result<Self, Error> {
        Self::parse(r, Path::new("kallsyms"))
    }

    fn parse(r: impl BufRead, path: &Path) -> Result<Self, Error> {
        let malformed = |line: usize, reason| Error::Kallsyms {
            path: path.to_path_buf(),
            line,
            reason,
        };
        // (address, preference, name range); preference: global before local, then shorter.
        let mut parsed: Vec<(u64, (bool, u32), u32, u32)> = Vec::new();
        let mut names = String::new();
        let mut lines = 0;
        // Judged on every line, text or not: a file of data symbols is not a hidden one.
        let mut any_address = false;
        for (index, line) in r.lines().enumerate() {
            let line = line.map_err(|source| Error::Io {
                path: PathBuf::from(path),
                source,
            })?;
            let mut fields = line.split_whitespace();
            let Some(addr) = fields.next() else { continue };
            lines += 1;
            let addr = u64::from_str_radix(addr, 16).map_err(|_| malformed(index + 1, "bad address"))?;
            any_address |= addr != 0;
            let kind = fields
                .next()
                .ok_or_else(|| malformed(index + 1, "missing type"))?;
            let name = fields
                .next()
                .ok_or_else(|| malformed(index + 1, "missing name"))?;
            let global = match kind {
                "T" | "W" => true,
                "t" | "w" => false,
                _ => continue,
            };
            let (Ok(start), Ok(len)) = (u32::try_from(names.len()), u32::try_from(name.len())) else {
                return Err(malformed(index + 1, "too many symbols"));
            };
            names.push_str(name);
            parsed.push((addr, (!global, len), start, len));
        }
        if lines > 0 && !any_address {
            return Err(Error::KallsymsHidden {
                path: path.to_path_buf(),
            });
        }
        parsed.sort_by(|a, b| {
            (a.0, a.1)
                .cmp(&(b.0, b.1))
                .then_with(|| name_of(&names, a.2, a.3).cmp(name_of(&names, b.2, b.3)))
        });
        // Keep the preferred symbol of each address.
        parsed.dedup_by_key(|e| e.0);
        Ok(KernelSymbols {
            entries: parsed
                .into_iter()
                .map(|(addr, _, start, len)| (addr, start, len))
                .collect(),
            names,
        })
    }

    /// The nearest text symbol at or below `addr`; None below the first symbol.
    pub fn lookup(&self, addr: u64) -> Option<&str> {
        let i = self.entries.partition_point(|e| e.0 <= addr);
        let &(_, start, len) = self.entries[..i].last()?;
        Some(name_of(&self.names, start, len))
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

fn name_of(names: &str, start: u32, len: u32) -> &str {
    let start = start as usize;
    names.get(start..start + len as usize).unwrap_or("")
}

#[cfg(test)]
mod tests {
    use super::*;

    const KALLSYMS_TEXT: &str = "\
ffffffff81000000 T _text
ffffffff81000000 t startup_64
ffffffff81001000 T do_syscall_64
ffffffff81001100 D some_data
ffffffff81002000 W weak_func
ffffffff81003000 t local_func
ffffffffc0a01000 t ext4_fill_super\t[ext4]
";

    #[test]
    fn looks_up_nearest_text_symbol() {
        let k = KernelSymbols::from_reader(KALLSYMS_TEXT.as_bytes()).expect("valid kallsyms");
        assert_eq!(k.len(), 5);
        assert_eq!(k.lookup(0xffffffff80ffffff), None);
        assert_eq!(k.lookup(0xffffffff81000000), Some("_text"));
        assert_eq!(k.lookup(0xffffffff81001050), Some("do_syscall_64"));
        // Data symbols are skipped: an address after `some_data` still names the function.
        assert_eq!(k.lookup(0xffffffff81001200), Some("do_syscall_64"));
        assert_eq!(k.lookup(0xffffffff81002001), Some("weak_func"));
        assert_eq!(k.lookup(0xffffffff81003fff), Some("local_func"));
        assert_eq!(k.lookup(0xffffffffc0a01010), Some("ext4_fill_super"));
    }

    #[test]
    fn hidden_addresses_are_an_error() {
        let text = "0000000000000000 T _text\n0000000000000000 T do_syscall_64\n";
        let err = KernelSymbols::from_reader(text.as_bytes()).expect_err("hidden");
        assert!(matches!(err, Error::KallsymsHidden { .. }));
        assert!(err.to_string().contains("kptr_restrict"));
    }

    #[test]
    fn data_symbols_only_is_an_empty_table_not_hidden_addresses() {
        // Found by tests/fuzz_kallsyms.rs: the text symbols' addresses were checked, and an
        // empty set of them is "all zero".
        let k = KernelSymbols::from_reader("ffffffff81000000 D some_data\n".as_bytes()).expect("not hidden");
        assert!(k.is_empty());
        assert_eq!(k.lookup(0xffffffff81000001), None);
    }

    #[test]
    fn malformed_line_is_reported() {
        let err = KernelSymbols::from_reader("zzzz T x\n".as_bytes()).expect_err("malformed");
        assert!(matches!(err, Error::Kallsyms { line: 1, .. }));
    }

    #[test]
    fn loads_this_kernels_symbols_when_visible() {
        match KernelSymbols::load() {
            Ok(k) => assert!(!k.is_empty()),
            // Without root or with kptr_restrict=2 the addresses are hidden; that is the one
            // error load() may give on a Linux machine.
            Err(err) => assert!(matches!(err, Error::KallsymsHidden { .. }), "{err}"),
        }
    }
}
