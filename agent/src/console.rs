//! What pgscope prints for a person: every line goes through here, so that
//! - text that came from outside (query texts, symbol and file names, database names, error
//!   messages of the server) cannot drive the terminal: control characters, C1 controls and
//!   bidirectional overrides are printed escaped (`\x1b`, `\u{202e}`), never raw;
//! - a closed pipe (`pgscope trace … | head`) ends printing quietly instead of panicking, and
//!   the files the run was asked to write are still written.
//!
//! Use `out!` for stdout and `note!` for stderr, like `println!` and `eprintln!` (the module
//! is declared first, with `#[macro_use]`, so every module has them).

use std::borrow::Cow;
use std::fmt::Write as _;
use std::io::{self, Write};
use std::sync::atomic::{AtomicBool, Ordering};

/// `text` with every character that could control a terminal escaped. Newlines are kept (they
/// only end lines); everything else that is not printable text is shown as `\xNN` (ASCII) or
/// `\u{…}` (the rest).
pub fn escape(text: &str) -> Cow<'_, str> {
    if !text.chars().any(controls_terminal) {
        return Cow::Borrowed(text);
    }
    let mut escaped = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if !controls_terminal(c) {
            escaped.push(c);
        } else if c.is_ascii() {
            let _ = write!(escaped, "\\x{:02x}", c as u32);
        } else {
            let _ = write!(escaped, "\\u{{{:x}}}", c as u32);
        }
    }
    Cow::Owned(escaped)
}

/// Whether a character must not reach a terminal raw: C0 controls but the newline (ESC starts
/// every escape sequence; BEL, BS, CR and TAB rewrite what is shown), DEL, C1 controls (U+009B
/// is a one-character CSI on some terminals), and the Unicode format characters that reorder
/// or hide text (bidirectional overrides and isolates, line and paragraph separators).
pub fn controls_terminal(c: char) -> bool {
    match c {
        '\n' => false,
        '\u{0}'..='\u{1f}' | '\u{7f}'..='\u{9f}' => true,
        // Bidirectional marks, embeddings, overrides and isolates ("Trojan Source").
        '\u{061c}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}' => true,
        // Line and paragraph separators: a new line the reader does not see coming.
        '\u{2028}' | '\u{2029}' => true,
        _ => false,
    }
}

/// Which stream a line goes to.
#[derive(Clone, Copy)]
pub enum Stream {
    Out,
    Err,
}

/// Set once a stream's reader is gone: later lines are dropped without trying.
static STDOUT_CLOSED: AtomicBool = AtomicBool::new(false);
static STDERR_CLOSED: AtomicBool = AtomicBool::new(false);

/// Prints `text` escaped and a newline to `stream`. Printing is best effort: a reader that went
/// away (EPIPE) or a full disk must not end a trace before its files are written.
pub fn print_line(stream: Stream, text: &str) {
    let line = format!("{}\n", escape(text));
    match stream {
        Stream::Out => write_or_close(&mut io::stdout().lock(), &STDOUT_CLOSED, &line),
        Stream::Err => write_or_close(&mut io::stderr().lock(), &STDERR_CLOSED, &line),
    }
}

fn write_or_close(writer: &mut impl Write, closed: &AtomicBool, line: &str) {
    if closed.load(Ordering::Relaxed) {
        return;
    }
    let written = writer.write_all(line.as_bytes()).and_then(|()| writer.flush());
    if let Err(error) = written {
        // Nobody reads any more (or cannot be written to): stop trying, keep working.
        closed.store(true, Ordering::Relaxed);
        if error.kind() != io::ErrorKind::BrokenPipe {
            tracing::debug!("printing stopped: {error}");
        }
    }
}

/// Whether stderr still takes output (the live view writes to it directly).
pub fn stderr_open() -> bool {
    !STDERR_CLOSED.load(Ordering::Relaxed)
}

/// Marks stderr closed after a failed direct write (the live view's redraws).
pub fn stderr_failed() {
    STDERR_CLOSED.store(true, Ordering::Relaxed);
}

/// `println!` for the operator: escaped, and quiet when stdout is closed.
macro_rules! out {
    () => {
        $crate::console::print_line($crate::console::Stream::Out, "")
    };
    ($($arg:tt)*) => {
        $crate::console::print_line($crate::console::Stream::Out, &format!($($arg)*))
    };
}

/// `eprintln!` for the operator: escaped, and quiet when stderr is closed.
macro_rules! note {
    () => {
        $crate::console::print_line($crate::console::Stream::Err, "")
    };
    ($($arg:tt)*) => {
        $crate::console::print_line($crate::console::Stream::Err, &format!($($arg)*))
    };
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn escapes_what_drives_a_terminal() {
        assert_eq!(escape("a\u{1b}[2Jb"), "a\\x1b[2Jb");
        assert_eq!(escape("\u{7}\r\t\u{7f}"), "\\x07\\x0d\\x09\\x7f");
        assert_eq!(escape("x\u{9b}31m\u{202e}cba"), "x\\u{9b}31m\\u{202e}cba");
        assert_eq!(escape("one\ntwo"), "one\ntwo");
        assert_eq!(escape("SELECT 'é' ─ 漢字 🐘"), "SELECT 'é' ─ 漢字 🐘");
    }

    #[test]
    fn a_broken_pipe_stops_printing_quietly() {
        struct Closed;
        impl Write for Closed {
            fn write(&mut self, _: &[u8]) -> io::Result<usize> {
                Err(io::ErrorKind::BrokenPipe.into())
            }
            fn flush(&mut self) -> io::Result<()> {
                Ok(())
            }
        }
        let closed = AtomicBool::new(false);
        write_or_close(&mut Closed, &closed, "line\n");
        assert!(closed.load(Ordering::Relaxed));
        // Later lines are dropped without a write (Closed would fail them again).
        write_or_close(&mut Closed, &closed, "more\n");
    }

    proptest! {
        #[test]
        fn escaped_text_has_no_terminal_control(text in any::<String>()) {
            let escaped = escape(&text);
            prop_assert!(!escaped.chars().any(controls_terminal));
            prop_assert!(!escaped.contains('\x1b'), "raw ESC in {:?}", escaped);
        }

        #[test]
        fn printable_text_is_unchanged(text in "[^\\p{Cc}\\p{Cf}\u{2028}\u{2029}]*") {
            prop_assert_eq!(escape(&text), text.as_str());
        }

        #[test]
        fn lines_are_kept(lines in proptest::collection::vec("[a-z\u{1b}\u{202e} ]{0,12}", 1..6)) {
            let text = lines.join("\n");
            prop_assert_eq!(escape(&text).lines().count(), text.lines().count());
        }
    }
}
