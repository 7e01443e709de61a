//! What each broker refusal means for the relay: the one table.
//!
//! | broker says | where | relay does |
//! |---|---|---|
//! | 312 NO_ROUTE | `basic.return`, one message | publish again `rabbitmq.unroutable_retries` times with backoff, then dead-letter |
//! | `basic.nack` | one message | publish again with backoff; after 10 nacks, dead-letter |
//! | 404 NOT_FOUND to the passive declare before a templated exchange's first event | control channel | dead-letter that exchange's events (with a dead-letter exchange; looked for again a minute later) |
//! | 404 NOT_FOUND "no exchange", 403 ACCESS_REFUSED "access to exchange" | `channel.close`, a templated exchange | open the channel again, publish again what waited, and dead-letter that exchange's events (with a dead-letter exchange; the name is tried again a minute later), else stop |
//! | 406 PRECONDITION_FAILED "message size … larger than … max size N" | `channel.close`, one message | learn N: bodies above it are dead-lettered without the body (with a dead-letter exchange), else stop |
//! | 406 (other), 501 FRAME_ERROR, 502 SYNTAX_ERROR, 503 COMMAND_INVALID, 505 UNEXPECTED_FRAME, 540 NOT_IMPLEMENTED | `channel.close` / `connection.close` | reconnect and replay one message at a time past where the session failed; after 3 such failures with the same message alone in flight, dead-letter it bare (no body, no user headers) |
//! | 403 ACCESS_REFUSED "cannot publish to internal exchange" | `channel.close`, a templated exchange | as "access to exchange" above |
//! | 403 ACCESS_REFUSED, 404 (other) | either | stop: credentials, permissions or exchange to fix |
//! | 530 NOT_ALLOWED "vhost … is down", "connection limit … is reached" | either | reconnect with backoff |
//! | 530 NOT_ALLOWED (other: "vhost … not found", "access to vhost … refused") | either | stop: vhost or permissions to fix |
//! | 320 CONNECTION_FORCED, 506 RESOURCE_ERROR, 541 INTERNAL_ERROR, any other, a lost connection | either | reconnect with backoff and replay |
//! | not AMQP at all (TLS, HTTP) on the port | handshake | stop: fix `rabbitmq.url` (`amqps://` for a TLS port) |
//!
//! Dead letters carry `x-outbox-error` saying why. Without
//! `rabbitmq.dead_letter_exchange`, a per-message refusal stops the relay
//! with the event's id instead.

/// What one refusal means.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Disposition {
    /// Reconnect and replay.
    Transient,
    /// The operator must change something.
    Stop,
    /// A templated exchange rendered to a name the broker does not have.
    MissingExchange(String),
    /// An exchange the relay's user may not write to.
    RefusedExchange(String),
    /// The broker takes bodies of at most this many bytes.
    BodyLimit(usize),
    /// Blamed on the oldest unconfirmed message.
    HeadOfWindow,
}

/// The row of the table for a `channel.close` (`channel`) or a
/// `connection.close` with `code` and `text`.
pub fn disposition(channel: bool, code: u16, text: &str) -> Disposition {
    match code {
        403 if !channel => Disposition::Stop,
        // The routing key refused by topic permissions: the operator's to
        // fix (blamed on one message at a time, a permission that refuses
        // every key would send the whole stream to the dead-letter
        // exchange). Read first: the key is quoted in the text, and a
        // row's key could quote the texts below.
        403 if refused_text(text).starts_with("access to topic '") => Disposition::Stop,
        403 => match refused_exchange(text).or_else(|| internal_exchange(text)) {
            Some(x) => Disposition::RefusedExchange(x),
            None => Disposition::Stop,
        },
        // "vhost 'v' is down", "connection limit (n) is reached": wait;
        // "vhost v not found", "access to vhost 'v' refused": fix it.
        530 if passing(text) => Disposition::Transient,
        530 => Disposition::Stop,
        404 => match missing_exchange(text) {
            Some(x) if channel => Disposition::MissingExchange(x),
            _ => Disposition::Stop,
        },
        406 => match body_limit(text) {
            Some(n) => Disposition::BodyLimit(n),
            None => Disposition::HeadOfWindow,
        },
        501 | 502 | 503 | 505 | 540 => Disposition::HeadOfWindow,
        _ => Disposition::Transient,
    }
}

/// A 530 that passes: "vhost V is down", "connection limit (N) is reached
/// for vhost 'V'", "User connection limit (N) is reached". Read without
/// the names the broker quotes (a vhost named 'ratelimit' is no limit).
fn passing(text: &str) -> bool {
    let mut plain = String::with_capacity(text.len());
    for (i, part) in text.split('\'').enumerate() {
        if i % 2 == 0 {
            plain.push_str(part);
        }
    }
    plain.trim_end().ends_with(" is down")
        || (plain.contains("limit (") && plain.contains(") is reached"))
}

/// "NOT_FOUND - no exchange 'X' in vhost 'V'": X. A text the broker cut
/// short is not guessed at.
fn missing_exchange(text: &str) -> Option<String> {
    let rest = text.split_once("no exchange '")?.1;
    let end = rest.rfind("' in vhost")?;
    Some(rest[..end].to_owned())
}

/// What a 403 says after its "ACCESS_REFUSED - " and the permission it
/// names, if it names one ("write access to ...", or "access to ..." as
/// RabbitMQ 3 says it).
fn refused_text(text: &str) -> &str {
    let said = text.strip_prefix("ACCESS_REFUSED - ").unwrap_or(text);
    match said.split_once(' ') {
        Some(("write" | "read" | "configure", rest)) => rest,
        _ => said,
    }
}

/// "ACCESS_REFUSED - write access to exchange 'X' in vhost 'V' refused for
/// user 'U'": X.
fn refused_exchange(text: &str) -> Option<String> {
    exchange_after(text, "access to exchange '")
}

/// "ACCESS_REFUSED - cannot publish to internal exchange 'X' in vhost
/// 'V'": X (an exchange only other exchanges may send to; a passive
/// declare does not tell).
fn internal_exchange(text: &str) -> Option<String> {
    exchange_after(text, "cannot publish to internal exchange '")
}

/// The exchange a 403's text quotes right after `opening`, up to
/// "' in vhost" (the last one: the name may hold the words).
fn exchange_after(text: &str, opening: &str) -> Option<String> {
    let rest = refused_text(text).strip_prefix(opening)?;
    let end = rest.rfind("' in vhost")?;
    Some(rest[..end].to_owned())
}

/// "PRECONDITION_FAILED - message size 2000000 is larger than configured
/// max size 1048576": 1048576.
fn body_limit(text: &str) -> Option<usize> {
    let rest = text.split_once("message size ")?.1;
    let rest = rest.split_once("larger than")?.1;
    let rest = rest.split_once("max size ")?.1;
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table() {
        let d = |code, text| disposition(true, code, text);
        assert_eq!(
            d(
                406,
                "PRECONDITION_FAILED - message size 2000000 is larger than configured max size 1048576"
            ),
            Disposition::BodyLimit(1_048_576)
        );
        assert_eq!(
            d(
                406,
                "PRECONDITION_FAILED - message size 9 is larger than max size 8"
            ),
            Disposition::BodyLimit(8)
        );
        assert_eq!(
            d(406, "PRECONDITION_FAILED - invalid expiration"),
            Disposition::HeadOfWindow
        );
        assert_eq!(
            d(404, "NOT_FOUND - no exchange 'a' in vhost '/'"),
            Disposition::MissingExchange("a".into())
        );
        assert_eq!(
            disposition(false, 404, "NOT_FOUND - no exchange 'a' in vhost '/'"),
            Disposition::Stop
        );
        assert_eq!(
            d(404, "NOT_FOUND - no exchange 'a-very-long..."),
            Disposition::Stop
        );
        assert_eq!(d(403, "ACCESS_REFUSED"), Disposition::Stop);
        let refused = "ACCESS_REFUSED - access to exchange 'x' in vhost '/' refused for user 'u'";
        assert_eq!(d(403, refused), Disposition::RefusedExchange("x".into()));
        assert_eq!(disposition(false, 403, refused), Disposition::Stop);
        let refused =
            "ACCESS_REFUSED - write access to exchange 'x' in vhost '/' refused for user 'u'";
        assert_eq!(d(403, refused), Disposition::RefusedExchange("x".into()));
        let internal = "ACCESS_REFUSED - cannot publish to internal exchange 'x' in vhost '/'";
        assert_eq!(d(403, internal), Disposition::RefusedExchange("x".into()));
        // A routing key refused by topic permissions stops the relay,
        // whatever the key quotes.
        for (key, permission) in [
            ("a.b", "write "),
            ("access to exchange 'evil", ""),
            ("x' in vhost '/", ""),
        ] {
            let topic = format!(
                "ACCESS_REFUSED - {permission}access to topic '{key}' in exchange 'x' in vhost \
                 '/' refused for user 'u'"
            );
            assert_eq!(disposition(true, 403, &topic), Disposition::Stop, "{topic}");
        }
        assert_eq!(
            d(
                403,
                "ACCESS_REFUSED - configure access to exchange 'x' refused"
            ),
            Disposition::Stop
        );
        for passing in [
            "NOT_ALLOWED - vhost v is down",
            "NOT_ALLOWED - connection limit (10) is reached for vhost 'v'",
            "NOT_ALLOWED - Connection refused for user 'u'. User connection limit (5) is reached",
        ] {
            assert_eq!(d(530, passing), Disposition::Transient, "{passing}");
        }
        for lasting in [
            "NOT_ALLOWED - access to vhost 'ratelimit' refused for user 'relay'",
            "NOT_ALLOWED - access to vhost 'is down' refused for user 'relay'",
            "NOT_ALLOWED - vhost a-limit-b not found",
            "NOT_ALLOWED - vhost is down now not found",
        ] {
            assert_eq!(d(530, lasting), Disposition::Stop, "{lasting}");
        }
        for code in [501, 502, 503, 505, 540] {
            assert_eq!(d(code, ""), Disposition::HeadOfWindow, "{code}");
        }
        for code in [320, 506, 541, 999] {
            assert_eq!(d(code, ""), Disposition::Transient, "{code}");
        }
    }
}
