//! `amqp://` and `amqps://` URLs, read once for everything that needs their
//! parts: the AMQP client connecting, the configuration checking them,
//! `check` naming the node, and the redaction of their passwords.

/// Parses `rabbitmq.url`. amq-protocol-uri reads the host with
/// `Url::domain`, which is `None` for an IPv6 literal, and then puts
/// "localhost" in its place (`amqp://[2001:db8::7]/` would connect to this
/// machine): the host is taken from the URL here (an IPv6 address without
/// its brackets, as sockets and TLS server names want it).
pub(crate) fn parse_amqp_url(url: &str) -> Result<amq_protocol::uri::AMQPUri, String> {
    let mut uri: amq_protocol::uri::AMQPUri = url.parse()?;
    let parsed = url::Url::parse(url).map_err(|e| e.to_string())?;
    match parsed.host() {
        Some(url::Host::Domain(_)) | None => {}
        Some(url::Host::Ipv4(ip)) => uri.authority.host = ip.to_string(),
        Some(url::Host::Ipv6(ip)) => uri.authority.host = ip.to_string(),
    }
    Ok(uri)
}

#[cfg(test)]
mod tests {
    use super::parse_amqp_url;

    #[test]
    fn an_ip_address_in_the_url_is_the_host_connected_to() {
        let host = |u: &str| parse_amqp_url(u).unwrap().authority.host;
        assert_eq!(host("amqp://u:p@10.0.0.5:5673/v"), "10.0.0.5");
        assert_eq!(host("amqp://[::1]/"), "::1");
        assert_eq!(host("amqps://[2001:db8::7]:5671/%2f"), "2001:db8::7");
        assert_eq!(host("amqp://rabbit.example/"), "rabbit.example");
        assert_eq!(host("amqp://rabbit%2dx.example/"), "rabbit-x.example");
        let uri = parse_amqp_url("amqp://u:p@127.0.0.2:5999/v?frame_max=4096").unwrap();
        assert_eq!(uri.authority.port, 5999);
        assert_eq!(uri.vhost, "v");
        assert_eq!(uri.query.frame_max, Some(4096));
    }
}
