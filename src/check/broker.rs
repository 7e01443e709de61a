//! The RabbitMQ checks: every node reachable and logged in, the exchanges
//! exist. They connect with the relay's own client ([`AmqpSink`]), as a
//! session does, so that what `check` finds is what `run` will meet.

use super::{CHECK_TIMEOUT, Line};
use crate::config::Config;
use crate::config::shown_url;
use crate::sink::wire::WireError;
use crate::sink::{AmqpSink, SinkError};
use amq_protocol::uri::SASLMechanism;

/// What the broker check says about a failure to connect as `user` to
/// `vhost`.
/// `e`, a failed connect, with what to fix; `password_key` is the
/// setting the password comes from when not the URL (`password_file`).
pub(super) fn describe_amqp_error(
    e: &SinkError,
    user: &str,
    vhost: &str,
    password_key: Option<&str>,
) -> String {
    let no_answer = || {
        format!(
            "no answer within {} s: is the host and port in rabbitmq.url a RabbitMQ broker?",
            CHECK_TIMEOUT.as_secs()
        )
    };
    let SinkError::Amqp { source, .. } = e else {
        return match e {
            SinkError::Timeout(_) => no_answer(),
            // Names rabbitmq.ca_file, or says what the certificate lacks.
            SinkError::Tls(why) => why.clone(),
            other => other.to_string(),
        };
    };
    match source {
        WireError::ConnectionClosed { code: 403, text } => format!(
            "the broker refused user {user:?} ({text}): fix the user name in rabbitmq.url (or \
             OUTBOX_RELAY_RABBITMQ_URL) or the password in {}",
            password_key.unwrap_or("the same URL")
        ),
        WireError::ConnectionClosed { code: 530, text } => format!(
            "user {user:?} may not use vhost {vhost:?} ({text}): create the vhost or grant \
             access (rabbitmqctl set_permissions -p '{vhost}' '{user}' '.*' '.*' '.*'), or fix \
             the vhost in rabbitmq.url"
        ),
        WireError::Io(io) => {
            let what = if io.kind() == std::io::ErrorKind::ConnectionRefused {
                "connection refused".to_owned()
            } else {
                format!("cannot connect ({io})")
            };
            format!("{what}: is RabbitMQ running, and are the host and port in rabbitmq.url right?")
        }
        WireError::Eof => format!(
            "the connection closed during the handshake ({source}): is the host and port in \
             rabbitmq.url a RabbitMQ broker?"
        ),
        other => format!("the broker refused the connection ({other})"),
    }
}

/// A warning when `url` is plain `amqp://` to a host other than this
/// machine: AMQP logs in with SASL PLAIN, so the password crosses the
/// network as it is, and every event with it.
pub(super) fn broker_in_the_clear(url: &str) -> Option<Line> {
    let uri = crate::amqpurl::parse_amqp_url(url).ok()?;
    if uri.scheme != amq_protocol::uri::AMQPScheme::AMQP {
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

/// Connects to node `node` of `rabbitmq.url` as a session does (TLS, login,
/// vhost, the publishing channel in confirm mode).
pub(super) async fn broker_connect(cfg: &Config, node: usize) -> (Line, Option<AmqpSink>) {
    let url = cfg.rabbitmq.urls[node].expose();
    let what = format!("RabbitMQ reachable at {}", shown_url(url));
    let uri = match crate::amqpurl::parse_amqp_url(url) {
        Ok(u) => u,
        Err(_) => return (Line::fail(what, crate::redact::NOT_A_URL), None),
    };
    let external = uri.query.auth_mechanism == Some(SASLMechanism::External);
    let (user, vhost) = (uri.authority.userinfo.username, uri.vhost);
    let open = AmqpSink::open_node(&cfg.rabbitmq, node, "outbox-relay check");
    let failed = match tokio::time::timeout(CHECK_TIMEOUT, open).await {
        Ok(Ok(sink)) => {
            let who = if external {
                "with the client certificate (SASL EXTERNAL)".to_owned()
            } else {
                format!("as {user}")
            };
            let line = Line::ok(what, format!("logged in {who}, vhost {vhost}"));
            return (line, Some(sink));
        }
        Ok(Err(e)) => e.without_rotation(),
        Err(_) => SinkError::Timeout("connecting to RabbitMQ"),
    };
    if external
        && let SinkError::Amqp {
            source: WireError::ConnectionClosed { code: 403, text },
            ..
        } = &failed
    {
        let why = format!(
            "the broker refused the client certificate ({text}): its common name (or what \
             the broker's ssl_cert_login_from names) must be a broker user with access to vhost \
             {vhost:?}, and the certificate signed by a CA in the broker's \
             ssl_options.cacertfile (rabbitmq.cert_file)"
        );
        return (Line::fail(what, why), None);
    }
    let password_key = cfg.rabbitmq.urls[node].password_key();
    let mut why = describe_amqp_error(&failed, &user, &vhost, password_key);
    // A broker that refuses a client certificate under TLS 1.3 may just
    // reset the connection after the handshake: the alert is not seen
    // (the connect says so in what it was doing).
    if let SinkError::Amqp {
        what: crate::sink::CLOSED_WITH_CERT,
        ..
    } = &failed
    {
        why.push_str(
            " Or the broker refused the relay's client certificate and closed the \
             connection: check that rabbitmq.cert_file is valid now and signed by a CA in the \
             broker's ssl_options.cacertfile.",
        );
    }
    (Line::fail(what, why), None)
}

pub(super) async fn exchanges(cfg: &Config, sink: &mut AmqpSink) -> Vec<Line> {
    let mut lines = Vec::new();
    let mut looking = Looking {
        sink,
        unanswered: None,
    };
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
                lines.push(looking.exchange(name, "exchange", &key).await);
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
            lines.push(looking.exchange(dlx, "dead-letter exchange", &key).await);
        }
    }
    lines
}

/// Exchanges looked for on one connection.
struct Looking<'a> {
    sink: &'a mut AmqpSink,
    /// A check that got no answer leaves its question out on the
    /// connection: the next would be refused for it, so none is asked.
    unanswered: Option<String>,
}

impl Looking<'_> {
    /// Passive declare of `name` (on a channel of its own: a failed
    /// passive declare closes the channel it ran on).
    async fn exchange(&mut self, name: &str, role: &str, key: &str) -> Line {
        let what = format!("{role} {name:?}");
        if let Some(earlier) = self.unanswered.as_deref() {
            return Line::fail(
                what,
                format!("could not be checked: the broker did not answer the check of {earlier:?}"),
            );
        }
        let res = tokio::time::timeout(CHECK_TIMEOUT, self.sink.check_exchange(name)).await;
        match res {
            Ok(Ok(())) => Line::ok(what, "exists"),
            Ok(Err(SinkError::NoExchange(_))) => Line::fail(
                what,
                format!(
                    "does not exist on the broker ({key}): declare it (e.g. a durable topic \
                 exchange), or fix {key}"
                ),
            ),
            Ok(Err(SinkError::Amqp {
                source: WireError::ChannelClosed { code: 403, text },
                ..
            })) => Line::fail(
                what,
                format!("access refused ({text}): grant the user permissions on it, or fix {key}"),
            ),
            Ok(Err(SinkError::Timeout(_))) | Err(_) => {
                self.unanswered = Some(name.to_owned());
                Line::fail(
                    what,
                    format!(
                        "could not be checked: no answer within {} s",
                        CHECK_TIMEOUT.as_secs()
                    ),
                )
            }
            Ok(Err(e)) => Line::fail(what, format!("could not be checked: {e}")),
        }
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
