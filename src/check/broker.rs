//! The RabbitMQ checks: every node reachable and logged in, the exchanges exist.

use super::{CHECK_TIMEOUT, Line};
use crate::config::Config;
use crate::config::shown_url;
use crate::tls::TlsFailure;
use lapin::Connection;
use lapin::ConnectionProperties;
use lapin::ExchangeKind;
use lapin::options::ExchangeDeclareOptions;
use lapin::protocol::AMQPErrorKind;
use lapin::protocol::AMQPHardError;
use lapin::protocol::AMQPSoftError;
use lapin::types::FieldTable;
use std::time::Duration;

/// What the broker check says about an AMQP error.
pub(super) fn describe_amqp_error(e: &lapin::Error, user: &str, vhost: &str) -> String {
    match e.kind() {
        lapin::ErrorKind::ProtocolError(p) => match p.kind() {
            AMQPErrorKind::Soft(AMQPSoftError::ACCESSREFUSED) => format!(
                "the broker refused user {user:?} ({}): fix the user name or password \
                 in rabbitmq.url (or OUTBOX_RELAY_RABBITMQ_URL)",
                p.get_message()
            ),
            AMQPErrorKind::Hard(AMQPHardError::NOTALLOWED) => format!(
                "user {user:?} may not use vhost {vhost:?} ({}): create the vhost or grant \
                 access (rabbitmqctl set_permissions -p '{vhost}' '{user}' '.*' '.*' '.*'), or fix the \
                 vhost in rabbitmq.url",
                p.get_message()
            ),
            _ => format!("the broker refused the connection ({p})"),
        },
        lapin::ErrorKind::IOError(io) => {
            let what = if io.kind() == std::io::ErrorKind::ConnectionRefused {
                "connection refused".to_owned()
            } else {
                format!("cannot connect ({io})")
            };
            format!("{what}: is RabbitMQ running, and are the host and port in rabbitmq.url right?")
        }
        _ => e.to_string(),
    }
}

/// A warning when `url` is plain `amqp://` to a host other than this
/// machine: AMQP logs in with SASL PLAIN, so the password crosses the
/// network as it is, and every event with it.
pub(super) fn broker_in_the_clear(url: &str) -> Option<Line> {
    let uri = crate::sink::parse_amqp_url(url).ok()?;
    if uri.scheme != lapin::uri::AMQPScheme::AMQP {
        return None;
    }
    let host = uri.authority.host.as_str();
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let local = host.eq_ignore_ascii_case("localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback());
    (!local).then(|| {
        Line::warn(
            format!("rabbitmq.url {}", shown_url(url)),
            "plain AMQP: the broker password (SASL PLAIN) and every event cross the network \
             in the clear; use amqps:// (with rabbitmq.ca_file for a private CA)",
        )
    })
}

pub(super) async fn broker_connect(cfg: &Config, url: &str) -> (Line, Option<Connection>) {
    let what = format!("RabbitMQ reachable at {}", shown_url(url));
    let uri = match crate::sink::parse_amqp_url(url) {
        Ok(u) => u,
        Err(_) => return (Line::fail(what, crate::redact::NOT_A_URL), None),
    };
    let (user, vhost) = (uri.authority.userinfo.username.clone(), uri.vhost.clone());
    let props = ConnectionProperties::default().with_connection_name("outbox-relay check".into());
    // The same TLS set-up as the relay's own connection (amqps:// only).
    // `ca_file` is set for every amqps:// URL (the configured CA, or the
    // system bundle); lapin then trusts it alone.
    let tls = match cfg
        .rabbitmq
        .ca_file
        .as_deref()
        .map(crate::tls::rabbitmq_tls)
    {
        Some(Ok(t)) => t,
        Some(Err(e)) => return (Line::fail(what, format!("rabbitmq.ca_file: {e}")), None),
        None => lapin::tcp::OwnedTLSConfig::default(),
    };
    if let Some(roots) = cfg.rabbitmq.ca_file.as_deref()
        && uri.scheme == lapin::uri::AMQPScheme::AMQPS
    {
        let host = uri.authority.host.as_str();
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let port = uri.authority.port;
        let shake = crate::tls::rabbitmq_handshake(host, port, roots);
        if let Ok(Err(e)) = tokio::time::timeout(CHECK_TIMEOUT, shake).await
            && let Some(f) = TlsFailure::find(&e).filter(TlsFailure::is_permanent)
        {
            let msg = crate::tls::rabbitmq_failure(&f, &shown_url(url));
            return (Line::fail(what, msg), None);
        }
    }
    let builder = match lapin::DefaultConnectionBuilder::new() {
        Ok(b) => b
            .with_uri(uri.clone())
            .with_properties(props)
            .with_tls_config(tls),
        Err(e) => return (Line::fail(what, e.to_string()), None),
    };
    let conn = match tokio::time::timeout(CHECK_TIMEOUT, builder.connect()).await {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => {
            return (
                Line::fail(what, describe_amqp_error(&e, &user, &vhost)),
                None,
            );
        }
        Err(_) => {
            return (
                Line::fail(
                    what,
                    format!(
                        "no answer within {} s: is the host and port in rabbitmq.url a RabbitMQ broker?",
                        CHECK_TIMEOUT.as_secs()
                    ),
                ),
                None,
            );
        }
    };
    // The relay publishes on a channel of its own: open one too.
    match tokio::time::timeout(CHECK_TIMEOUT, conn.create_channel()).await {
        Ok(Ok(ch)) => {
            let _ = tokio::time::timeout(Duration::from_secs(5), ch.close(200, "ok".into())).await;
            (
                Line::ok(what, format!("logged in as {user}, vhost {vhost}")),
                Some(conn),
            )
        }
        Ok(Err(e)) => (
            Line::fail(
                what,
                format!(
                    "logged in, but opening a channel failed: {}",
                    describe_amqp_error(&e, &user, &vhost)
                ),
            ),
            None,
        ),
        Err(_) => (
            Line::fail(
                what,
                format!(
                    "logged in, but opening a channel got no answer within {} s",
                    CHECK_TIMEOUT.as_secs()
                ),
            ),
            None,
        ),
    }
}

pub(super) async fn exchanges(cfg: &Config, conn: &Connection) -> Vec<Line> {
    let mut lines = Vec::new();
    // Each exchange once, whichever outboxes share it.
    let mut seen: Vec<String> = Vec::new();
    let mut once = |name: String| {
        let new = !seen.contains(&name);
        seen.push(name);
        new
    };
    for o in &cfg.outboxes {
        let key = if cfg.outboxes.len() > 1 {
            format!("{} or rabbitmq.exchange", o.key_of("exchange"))
        } else {
            "rabbitmq.exchange".to_owned()
        };
        match o.exchange.as_literal() {
            Some("") if once(String::new()) => lines.push(Line::ok(
                "exchange \"\"",
                "the default exchange always exists",
            )),
            Some(name) if once(name.to_owned()) => {
                lines.push(exchange(conn, name, "exchange", &key).await);
            }
            Some(_) => {}
            None => {
                let text: String = (o.exchange.parts().iter())
                    .map(|p| match p {
                        crate::template::Part::Literal(s) => {
                            s.replace('{', "{{").replace('}', "}}")
                        }
                        crate::template::Part::Column(c) => format!("{{{c}}}"),
                    })
                    .collect();
                if once(format!("template {text}")) {
                    lines.push(Line::warn(
                        format!("exchange template {text:?}"),
                        "depends on each row's columns, so it cannot be checked statically: make \
                         sure every exchange it can name exists",
                    ));
                }
            }
        }
    }
    for o in &cfg.outboxes {
        if let Some(dlx) = &o.dead_letter_exchange
            && once(format!("dlx {dlx}"))
        {
            let key = if cfg.outboxes.len() > 1 {
                format!(
                    "{} or rabbitmq.dead_letter_exchange",
                    o.key_of("dead_letter_exchange")
                )
            } else {
                "rabbitmq.dead_letter_exchange".to_owned()
            };
            lines.push(exchange(conn, dlx, "dead-letter exchange", &key).await);
        }
    }
    lines
}

/// Passive declare of `name` on a throwaway channel (a failed passive
/// declare closes the channel it ran on).
pub(super) async fn exchange(conn: &Connection, name: &str, role: &str, key: &str) -> Line {
    let what = format!("{role} {name:?}");
    let res = tokio::time::timeout(CHECK_TIMEOUT, async {
        let ch = conn.create_channel().await?;
        ch.exchange_declare(
            name.into(),
            ExchangeKind::Topic,
            ExchangeDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
        let _ = ch.close(200, "ok".into()).await;
        Ok::<(), lapin::Error>(())
    })
    .await;
    match res {
        Ok(Ok(())) => Line::ok(what, "exists"),
        Ok(Err(e)) => match e.kind() {
            lapin::ErrorKind::ProtocolError(p)
                if matches!(p.kind(), AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND)) =>
            {
                Line::fail(
                    what,
                    format!(
                        "does not exist on the broker ({key}): declare it (e.g. a durable topic \
                         exchange), or fix {key}"
                    ),
                )
            }
            lapin::ErrorKind::ProtocolError(p)
                if matches!(p.kind(), AMQPErrorKind::Soft(AMQPSoftError::ACCESSREFUSED)) =>
            {
                Line::fail(
                    what,
                    format!(
                        "access refused ({}): grant the user permissions on it, or fix {key}",
                        p.get_message()
                    ),
                )
            }
            _ => Line::fail(what, format!("could not be checked: {e}")),
        },
        Err(_) => Line::fail(
            what,
            format!(
                "could not be checked: no answer within {} s",
                CHECK_TIMEOUT.as_secs()
            ),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::check::Level;

    #[test]
    fn plain_amqp_off_this_machine_is_a_warning_that_shows_no_password() {
        let line = broker_in_the_clear("amqp://relay:s3cret@mq.internal:5672/v").unwrap();
        assert_eq!(line.level, Level::Warn);
        let text = line.to_string();
        assert!(text.contains("in the clear"), "{text}");
        assert!(!text.contains("s3cret"), "{text}");
        for quiet in [
            "amqps://relay:s3cret@mq.internal:5671/v",
            "amqp://relay:s3cret@127.0.0.1:5672/v",
            "amqp://relay:s3cret@[::1]:5672/v",
            "amqp://relay:s3cret@localhost:5672/v",
            "not a url",
        ] {
            assert!(broker_in_the_clear(quiet).is_none(), "{quiet}");
        }
    }
}
