//! `{column}` templates for the exchange and the routing key.
//!
//! A template is parsed once at start-up into literal and placeholder parts;
//! per event, rendering is a walk over those parts into a reused buffer.

/// One part of a template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Part {
    /// Copied as is.
    Literal(String),
    /// Replaced by the value of the named column (or column role, see
    /// [`crate::config::OutboxColumns::resolve`]).
    Column(String),
}

/// A parsed template such as `{aggregate_type}.{event_type}`. `{{` and `}}`
/// stand for literal braces. The default is the empty template.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Template {
    parts: Vec<Part>,
}

impl Template {
    /// Parses `s`; the error says what is wrong with it.
    pub fn parse(s: &str) -> Result<Template, String> {
        let mut parts = Vec::new();
        let mut lit = String::new();
        let mut chars = s.chars().peekable();
        while let Some(c) = chars.next() {
            match c {
                '{' if chars.peek() == Some(&'{') => {
                    chars.next();
                    lit.push('{');
                }
                '}' if chars.peek() == Some(&'}') => {
                    chars.next();
                    lit.push('}');
                }
                '{' => {
                    let mut name = String::new();
                    loop {
                        match chars.next() {
                            Some('}') => break,
                            Some(c) if c.is_alphanumeric() || c == '_' => name.push(c),
                            Some(c) => {
                                return Err(format!(
                                    "unexpected {c:?} in placeholder of {s:?}; placeholders are {{column_name}}"
                                ));
                            }
                            None => return Err(format!("unclosed {{ in {s:?}")),
                        }
                    }
                    if name.is_empty() {
                        return Err(format!("empty placeholder {{}} in {s:?}"));
                    }
                    if !lit.is_empty() {
                        parts.push(Part::Literal(std::mem::take(&mut lit)));
                    }
                    parts.push(Part::Column(name));
                }
                '}' => {
                    return Err(format!(
                        "unmatched }} in {s:?} (write }}}} for a literal brace)"
                    ));
                }
                c => lit.push(c),
            }
        }
        if !lit.is_empty() {
            parts.push(Part::Literal(lit));
        }
        Ok(Template { parts })
    }

    /// The parts, in order.
    pub fn parts(&self) -> &[Part] {
        &self.parts
    }

    /// True when the template renders to the empty string whatever the row.
    pub fn is_empty(&self) -> bool {
        self.parts.is_empty()
    }

    /// The text, when the template has no placeholder.
    pub fn as_literal(&self) -> Option<&str> {
        match self.parts.as_slice() {
            [] => Some(""),
            [Part::Literal(s)] => Some(s),
            _ => None,
        }
    }

    /// Placeholders, in order.
    pub fn columns(&self) -> impl Iterator<Item = &str> {
        self.parts.iter().filter_map(|p| match p {
            Part::Column(c) => Some(c.as_str()),
            Part::Literal(_) => None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_placeholders_and_literals() {
        let t = Template::parse("{aggregate_type}.{event_type}").unwrap();
        assert_eq!(
            t.parts(),
            &[
                Part::Column("aggregate_type".into()),
                Part::Literal(".".into()),
                Part::Column("event_type".into())
            ]
        );
        assert_eq!(t.as_literal(), None);
        assert_eq!(
            Template::parse("outbox").unwrap().as_literal(),
            Some("outbox")
        );
        assert_eq!(
            Template::parse("a{{b}}").unwrap().as_literal(),
            Some("a{b}")
        );
    }

    #[test]
    fn rejects_malformed() {
        for s in ["{", "{}", "}", "{a.b}", "x{y"] {
            assert!(Template::parse(s).is_err(), "{s}");
        }
    }
}
