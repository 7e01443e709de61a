//! What a templated exchange may render to. A row chooses its exchange
//! only within the template: never the default exchange (`""`, which
//! delivers straight into the queue the routing key names, past every
//! binding), never the broker's own `amq.*`, and, with
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
