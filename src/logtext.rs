//! Row-derived text (ids, exchanges, routing keys) as logs and error
//! messages show it: control characters escaped, so that a row cannot
//! write a line of its own into a text log (`\n`, `\r`) or steer a
//! terminal, and cut to [`MAX_CHARS`] characters with the full size said
//! after it, so that a 10 MB id costs a short line.

use std::fmt;

/// Characters of row-derived text shown at most.
pub const MAX_CHARS: usize = 200;

/// Displays row-derived text escaped and capped (see the module).
#[derive(Debug, Clone, Copy)]
pub struct Shown<'a>(pub &'a str);

impl fmt::Display for Shown<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use fmt::Write;
        for (n, c) in self.0.chars().enumerate() {
            if n == MAX_CHARS {
                return write!(f, "…({} bytes)", self.0.len());
            }
            // Line and paragraph separators end a line in some viewers;
            // bidirectional overrides reorder what a terminal shows.
            if c.is_control()
                || matches!(c, '\u{2028}' | '\u{2029}' | '\u{202a}'..='\u{202e}')
                || matches!(c, '\u{2066}'..='\u{2069}')
            {
                for e in c.escape_default() {
                    f.write_char(e)?;
                }
            } else {
                f.write_char(c)?;
            }
        }
        Ok(())
    }
}

/// [`Shown`] as a string: what errors that outlive the row keep of it.
pub fn shown(s: &str) -> String {
    Shown(s).to_string()
}

/// As [`shown`] for bytes that may be huge or not UTF-8: only a prefix is
/// read (invalid UTF-8 replaced), and the size said is the whole one.
pub fn shown_bytes(v: &[u8]) -> String {
    // A character is at most 4 bytes: this prefix holds what is shown.
    let prefix = &v[..v.len().min(4 * MAX_CHARS)];
    let text = String::from_utf8_lossy(prefix);
    let kept: String = text.chars().take(MAX_CHARS).collect();
    let s = shown(&kept);
    if prefix.len() < v.len() || kept.len() < text.len() {
        return format!("{s}…({} bytes)", v.len());
    }
    s
}

/// The text log's writer: one call per log line (as tracing-subscriber
/// writes them), with every line break but the last written as `\n` or
/// `\r`. Whatever a message or field holds, one event is one line.
pub struct OneLine<W>(pub W);

impl<W: std::io::Write> std::io::Write for OneLine<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let body = buf.strip_suffix(b"\n").unwrap_or(buf);
        if !body.iter().any(|b| matches!(b, b'\n' | b'\r')) {
            self.0.write_all(buf)?;
            return Ok(buf.len());
        }
        let mut out = Vec::with_capacity(buf.len() + 16);
        for &b in body {
            match b {
                b'\n' => out.extend_from_slice(b"\\n"),
                b'\r' => out.extend_from_slice(b"\\r"),
                b => out.push(b),
            }
        }
        out.extend_from_slice(&buf[body.len()..]);
        self.0.write_all(&out)?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.0.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_control_characters_and_caps_the_length() {
        assert_eq!(shown("a\nFAKE\r\u{1b}[2J\tb"), "a\\nFAKE\\r\\u{1b}[2J\\tb");
        assert_eq!(shown("plain-id 42 é"), "plain-id 42 é");
        assert_eq!(
            shown("a\u{2028}b\u{202e}c\u{2066}\u{b}"),
            "a\\u{2028}b\\u{202e}c\\u{2066}\\u{b}"
        );
        let long = "x".repeat(10_000_000);
        let s = shown(&long);
        assert_eq!(s, format!("{}…(10000000 bytes)", "x".repeat(MAX_CHARS)));
        assert_eq!(shown(&"é".repeat(MAX_CHARS)).chars().count(), MAX_CHARS);
        let b = shown_bytes(long.as_bytes());
        assert_eq!(b, s, "the whole size, from a prefix");
        assert_eq!(shown_bytes(b"id\n\xff"), "id\\n\u{fffd}");
    }

    #[test]
    fn one_event_is_one_line() {
        use std::io::Write;
        let mut w = OneLine(Vec::new());
        w.write_all(b"a\nFAKE LOG LINE\r\n").unwrap();
        w.write_all(b"plain\n").unwrap();
        assert_eq!(w.0, b"a\\nFAKE LOG LINE\\r\nplain\n");
    }
}
