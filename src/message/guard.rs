//! What a templated exchange may render to. A row chooses its exchange
//! only within the template: never the default exchange (`""`, which
//! delivers straight into the queue the routing key names, past every
//! binding), never the broker's own `amq.*`, never more than
//! [`MAX_RENDERED`] bytes or characters outside AMQP's set for exchange
//! names (the broker's refusal must name it whole), and, with
//! `rabbitmq.exchange_pattern`, only names that match it in full. A
//! literal exchange is the operator's choice and not checked.

use super::{Name, RenderError};
use crate::logtext::shown;

/// The checks of a templated exchange (none for a literal one).
#[derive(Debug, Clone)]
pub struct ExchangeGuard {
    /// The config key of the template, for messages.
    pub key: String,
    /// `rabbitmq.exchange_pattern`, anchored at both ends.
    pub pattern: Option<regex::Regex>,
}

/// The broker's own exchanges.
const RESERVED: &str = "amq.";

/// The longest name a template may render to. The broker names a refused
/// exchange in its reply, which it cuts at 255 bytes with the vhost (and,
/// for a 403, the user) in it; a name cut off could not be learnt, and its
/// row would stop the relay on every replay. 127 bytes leaves room for a
/// vhost and a user of 58 bytes together.
pub const MAX_RENDERED: usize = 127;

/// The characters of an exchange name in AMQP 0-9-1 (letters, digits, `-`,
/// `_`, `.`, `:`): nothing a reply quotes a name with, so the name the
/// broker refused reads back exactly.
fn amqp_name_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':')
}

impl ExchangeGuard {
    /// `Ok` when `name`, rendered for event `id`, may be published to.
    /// No allocation unless a pattern is set and the name is in pieces.
    pub(super) fn check(&self, name: &Name<'_>, id: &str) -> Result<(), RenderError> {
        let refuse = |why: String| RenderError::ExchangeRefused {
            id: shown(id),
            exchange: shown(&name.parts().concat()),
            key: self.key.clone(),
            why,
        };
        if name.len == 0 {
            return Err(refuse(
                "the default exchange delivers straight to the queue the routing key names".into(),
            ));
        }
        if starts_with(name.parts(), RESERVED) {
            return Err(refuse("amq.* exchanges are the broker's own".into()));
        }
        if name.len > MAX_RENDERED {
            return Err(refuse(format!(
                "it is {} bytes long, over the {MAX_RENDERED} a templated exchange may have",
                name.len
            )));
        }
        if !name.parts().iter().all(|p| p.bytes().all(amqp_name_byte)) {
            return Err(refuse(
                "it has characters other than letters, digits, '-', '_', '.' and ':'".into(),
            ));
        }
        if let Some(p) = &self.pattern {
            let matched = match name.parts() {
                [one] => p.is_match(one),
                parts => p.is_match(&parts.concat()),
            };
            if !matched {
                return Err(refuse(format!(
                    "it does not match rabbitmq.exchange_pattern ({:?})",
                    pattern_text(p)
                )));
            }
        }
        Ok(())
    }
}

/// The pattern as configured, without the anchors added to it.
fn pattern_text(p: &regex::Regex) -> &str {
    let s = p.as_str();
    s.strip_prefix("^(?:")
        .and_then(|s| s.strip_suffix(")$"))
        .unwrap_or(s)
}

/// Whether the concatenation of `parts` starts with `prefix`.
fn starts_with(parts: &[&str], prefix: &str) -> bool {
    let mut want = prefix.as_bytes();
    for part in parts {
        let n = part.len().min(want.len());
        if part.as_bytes()[..n] != want[..n] {
            return false;
        }
        want = &want[n..];
        if want.is_empty() {
            return true;
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_across_pieces() {
        assert!(starts_with(&["am", "q.x"], "amq."));
        assert!(starts_with(&["", "amq.", ""], "amq."));
        assert!(!starts_with(&["am", "x."], "amq."));
        assert!(!starts_with(&["amq"], "amq."));
        assert!(!starts_with(&[], "amq."));
    }

    #[test]
    fn refuses_the_default_exchange_amq_and_what_the_pattern_does_not_match() {
        let guard = |p: Option<&str>| ExchangeGuard {
            key: "rabbitmq.exchange".into(),
            pattern: p.map(|p| regex::Regex::new(&format!("^(?:{p})$")).unwrap()),
        };
        let g = guard(None);
        let e = g.check(&Name::literal(""), "1").unwrap_err().to_string();
        assert!(
            e.contains("default exchange") && e.contains("rabbitmq.exchange"),
            "{e}"
        );
        let e = g
            .check(&Name::literal("am").join("q.topic"), "1")
            .unwrap_err();
        assert!(e.to_string().contains("\"amq.topic\""), "{e}");
        assert!(g.check(&Name::literal("orders"), "1").is_ok());
        // A name the broker's refusal could not quote whole.
        let long = "x".repeat(MAX_RENDERED + 1);
        let e = g.check(&Name::literal(&long), "1").unwrap_err();
        assert!(e.to_string().contains("bytes long"), "{e}");
        assert!(g.check(&Name::literal(&long[1..]), "1").is_ok());
        for bad in ["a' in vhost '/", "a b", "a/b", "a\nb"] {
            let e = g.check(&Name::literal(bad), "1").unwrap_err();
            assert!(
                e.to_string().contains("characters other than"),
                "{bad}: {e}"
            );
        }
        assert!(g.check(&Name::literal("Orders-v2_eu:1.x"), "1").is_ok());
        let g = guard(Some("app\\.[a-z]+"));
        assert!(g.check(&Name::literal("app.").join("orders"), "1").is_ok());
        let e = g.check(&Name::literal("app.orders2"), "1").unwrap_err();
        assert!(
            e.to_string()
                .contains("rabbitmq.exchange_pattern (\"app\\\\.[a-z]+\")"),
            "{e}"
        );
        // Matched in full, not in part.
        assert!(g.check(&Name::literal("xapp.orders"), "1").is_err());
    }
}
