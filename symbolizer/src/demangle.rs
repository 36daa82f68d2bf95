//! Symbol names as people read them. Postgres is C and needs none of this, but what it loads
//! need not be: an extension or a library written in C++ (PostGIS' GEOS, JIT's LLVM) or Rust
//! (pgrx extensions) shows up in the profiles with its mangled names (`_ZN4geos4geom…`), and a
//! DBA cannot tell what a few lines of those are doing. C++ names (Itanium ABI, `_Z…`) are
//! shown without their parameters and return types — overloads fold into one function, as a
//! flamegraph wants — and Rust names (legacy and v0) without their hashes.
//!
//! The names come from the profiled processes' ELF files: outside input. Demangling is bounded
//! (a recursion limit, a length limit) and never fails: a name it cannot read is kept as is.

use cpp_demangle::{DemangleOptions, ParseOptions, Symbol};

/// How deep a C++ name's grammar may nest: real names stay in the tens; crafted ones would
/// exhaust the stack.
const RECURSION_LIMIT: u32 = 96;

/// Names longer than this are kept mangled: no function's name is, and demangling a long
/// crafted one costs time per frame.
const MAX_MANGLED_LEN: usize = 4096;

/// The demangled form of `name`, or None when it is not a C++ or Rust symbol (or cannot be
/// read as one).
pub fn demangled(name: &str) -> Option<String> {
    if name.len() > MAX_MANGLED_LEN {
        return None;
    }
    if let Ok(rust) = rustc_demangle::try_demangle(name) {
        // `{:#}` leaves the hash out.
        return Some(format!("{rust:#}"));
    }
    if !name.starts_with("_Z") {
        return None;
    }
    let symbol =
        Symbol::new_with_options(name, &ParseOptions::default().recursion_limit(RECURSION_LIMIT)).ok()?;
    let options = DemangleOptions::new()
        .no_params()
        .no_return_type()
        .recursion_limit(RECURSION_LIMIT);
    symbol.demangle(&options).ok().filter(|text| !text.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn cpp_and_rust_names_are_demangled_and_c_names_left_alone() {
        assert_eq!(
            demangled("_ZN4geos4geom8Geometry12intersectionEPKS1_").as_deref(),
            Some("geos::geom::Geometry::intersection")
        );
        assert_eq!(
            demangled("_ZNSt6vectorIiSaIiEE9push_backERKi").as_deref(),
            Some("std::vector<int, std::allocator<int> >::push_back")
        );
        assert_eq!(
            demangled("_ZN4core3fmt5write17h0123456789abcdefE").as_deref(),
            Some("core::fmt::write")
        );
        assert_eq!(
            demangled("_RNvCs1234_7mycrate4main").as_deref(),
            Some("mycrate::main")
        );
        for c_name in [
            "ExecInterpExpr",
            "pgss_store",
            "_bt_getroot",
            "postgres+0x2ff300",
            "_Z",
        ] {
            assert_eq!(demangled(c_name), None, "{c_name}");
        }
    }

    proptest! {
        // Any bytes a symbol table may hold: no panic, no stack overflow, a bounded answer.
        #[test]
        fn any_name_is_demangled_or_kept(name in "(_Z|_ZN|_R)?[A-Za-z0-9_$.]{0,300}") {
            if let Some(text) = demangled(&name) {
                prop_assert!(!text.is_empty());
            }
        }

        #[test]
        fn deeply_nested_templates_are_bounded(depth in 1usize..2000) {
            let name = format!("_Z1f{}", "I1a".repeat(depth)) + &"E".repeat(depth);
            let _ = demangled(&name);
        }
    }
}
