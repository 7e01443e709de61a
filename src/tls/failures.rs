//! TLS handshake failures, told as what to change.

use super::SslMode;
use rustls::CertificateError;
use std::error::Error as StdError;

/// Why a TLS handshake failed, as far as the operator is concerned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TlsFailure {
    /// The chain does not lead to a trusted root.
    Untrusted(String),
    /// The certificate is not for the host connected to.
    WrongHost(String),
    /// The certificate is expired or not yet valid.
    Expired(String),
    /// The peer refused our client certificate (or the lack of one): it
    /// sent a certificate alert (an expired or untrusted certificate,
    /// none where one is required).
    ClientCertRefused(String),
    /// The server does not speak TLS at all.
    NoServerTls,
    /// Our side could not set TLS up (an unreadable CA file...).
    Config(String),
    /// The TLS layer refused the peer for another reason (an alert, a
    /// protocol mismatch such as TLS to a plaintext port).
    Protocol(String),
    /// A failure that may be the network's (a reset during the handshake).
    Other(String),
}

impl TlsFailure {
    fn from_rustls(e: &rustls::Error) -> TlsFailure {
        let detail = e.to_string();
        match e {
            rustls::Error::InvalidCertificate(c) => match c {
                CertificateError::UnknownIssuer
                | CertificateError::BadSignature
                | CertificateError::UnknownRevocationStatus => TlsFailure::Untrusted(detail),
                CertificateError::NotValidForName
                | CertificateError::NotValidForNameContext { .. } => TlsFailure::WrongHost(detail),
                CertificateError::Expired
                | CertificateError::ExpiredContext { .. }
                | CertificateError::NotValidYet
                | CertificateError::NotValidYetContext { .. } => TlsFailure::Expired(detail),
                _ => TlsFailure::Protocol(detail),
            },
            rustls::Error::AlertReceived(a) if about_our_certificate(&format!("{a:?}")) => {
                TlsFailure::ClientCertRefused(detail)
            }
            _ => TlsFailure::Protocol(detail),
        }
    }

    /// Classifies an error message (pgwire-replication reports TLS
    /// failures as text).
    pub fn from_text(msg: &str) -> TlsFailure {
        let detail = msg
            .trim_start_matches("TLS handshake failed: ")
            .trim()
            .to_owned();
        if msg.contains("SSLRequest rejected") || msg.contains("server does not support TLS") {
            TlsFailure::NoServerTls
        } else if msg.contains("TLS config error") {
            TlsFailure::Config(detail)
        } else if let Some((_, alert)) = msg.split_once("received fatal alert: ")
            && about_our_certificate(alert)
        {
            // Before "expired": an alert saying CertificateExpired is
            // about our certificate, not the server's.
            TlsFailure::ClientCertRefused(detail)
        } else if msg.contains("UnknownIssuer") || msg.contains("BadSignature") {
            TlsFailure::Untrusted(detail)
        } else if msg.contains("not valid for name") || msg.contains("NotValidForName") {
            TlsFailure::WrongHost(detail)
        } else if msg.contains("expired")
            || msg.contains("Expired")
            || msg.contains("not valid yet")
        {
            TlsFailure::Expired(detail)
        } else if msg.contains("invalid peer certificate")
            || msg.contains("alert")
            || msg.contains("corrupt message")
            || msg.contains("peer misbehaved")
            || msg.contains("peer is incompatible")
        {
            TlsFailure::Protocol(detail)
        } else {
            TlsFailure::Other(detail)
        }
    }

    /// Finds a TLS failure in an error and its sources: a rustls error
    /// (also inside an `io::Error`), or tokio-postgres's "server does not
    /// support TLS".
    pub fn find(err: &(dyn StdError + 'static)) -> Option<TlsFailure> {
        let mut cur: Option<&(dyn StdError + 'static)> = Some(err);
        while let Some(e) = cur {
            if let Some(r) = e.downcast_ref::<rustls::Error>() {
                return Some(TlsFailure::from_rustls(r));
            }
            if let Some(io) = e.downcast_ref::<std::io::Error>()
                && let Some(r) = io.get_ref().and_then(|i| i.downcast_ref::<rustls::Error>())
            {
                return Some(TlsFailure::from_rustls(r));
            }
            if e.to_string() == "server does not support TLS" {
                return Some(TlsFailure::NoServerTls);
            }
            cur = e.source();
        }
        None
    }

    /// A failure that retrying will not fix.
    pub fn is_permanent(&self) -> bool {
        !matches!(self, TlsFailure::Other(_))
    }
}

/// Whether a TLS alert the peer sent (its name as rustls writes it) is a
/// complaint about the certificate we sent, or did not send.
fn about_our_certificate(alert: &str) -> bool {
    const ALERTS: [&str; 7] = [
        "BadCertificate",
        "UnsupportedCertificate",
        "CertificateRevoked",
        "CertificateExpired",
        "CertificateUnknown",
        "UnknownCA",
        "CertificateRequired",
    ];
    let name = alert.trim().split(|c: char| !c.is_alphanumeric()).next();
    name.is_some_and(|n| ALERTS.contains(&n))
}

/// The message for a failed TLS handshake with PostgreSQL (`url` already
/// redacted), naming what to change.
pub fn postgres_failure(f: &TlsFailure, url: &str, mode: SslMode) -> String {
    let what = format!("TLS handshake with PostgreSQL ({url}) failed");
    match f {
        TlsFailure::Untrusted(d) => format!(
            "{what}: certificate not trusted ({d}); set postgres.ca_file to the CA that signed \
             the server certificate (postgres.sslmode is {mode}: a certificate from any other CA, \
             public or not, is refused)"
        ),
        TlsFailure::WrongHost(d) => format!(
            "{what}: the server certificate is not for this host ({d}); connect with a host name \
             the certificate lists in postgres.url (hostaddr= in the URL can still say which \
             address to connect to), or have the server's certificate issued for this name \
             (sslmode now {mode})"
        ),
        TlsFailure::Expired(d) => format!(
            "{what}: the server certificate is not valid now ({d}); renew it \
             (postgres.sslmode is {mode})"
        ),
        TlsFailure::ClientCertRefused(d) => format!(
            "{what}: the server refused the relay's client certificate, or the lack of one \
             ({d}); set postgres.cert_file and key_file (or sslcert= and sslkey= in \
             postgres.url) to a certificate that is valid now and signed by a CA the server \
             trusts (its ssl_ca_file); if it is, look at the server's clock and its \
             ssl_crl_file"
        ),
        TlsFailure::NoServerTls => format!(
            "{what}: the server does not accept TLS connections (ssl = off); enable ssl on the \
             server, or set postgres.sslmode = \"prefer\" or \"disable\" (now {mode})"
        ),
        TlsFailure::Config(d) | TlsFailure::Protocol(d) | TlsFailure::Other(d) => {
            format!("{what}: {d}; check postgres.sslmode (now {mode}) and postgres.ca_file")
        }
    }
}

/// The server refused a plaintext connection ("no pg_hba.conf entry ...,
/// no encryption"): the message says to turn TLS on; `None` for other errors.
pub fn postgres_wants_tls(server_message: &str, url: &str, mode: SslMode) -> Option<String> {
    server_message.contains("no encryption").then(|| {
        format!(
            "connecting to PostgreSQL ({url}): {server_message}; the server accepts only TLS \
             connections here: set postgres.sslmode to prefer, require, verify-ca or verify-full \
             (now {mode})"
        )
    })
}

/// The message for a failed TLS handshake with RabbitMQ (`url` already
/// redacted), naming what to change.
pub fn rabbitmq_failure(f: &TlsFailure, url: &str) -> String {
    let what = format!("TLS handshake with RabbitMQ ({url}) failed");
    match f {
        TlsFailure::Untrusted(d) => format!(
            "{what}: certificate not trusted ({d}); set rabbitmq.ca_file to the CA that signed \
             the broker certificate"
        ),
        TlsFailure::WrongHost(d) => format!(
            "{what}: the broker certificate is not for this host ({d}); use a host name in \
             rabbitmq.url that the certificate lists"
        ),
        TlsFailure::Expired(d) => {
            format!("{what}: the broker certificate is not valid now ({d}); renew it")
        }
        TlsFailure::ClientCertRefused(d) => format!(
            "{what}: the broker refused the relay's client certificate, or the lack of one \
             ({d}); set rabbitmq.cert_file and key_file to a certificate that is valid now and \
             signed by a CA the broker trusts (its ssl_options.cacertfile); if it is, look at \
             the broker's clock and its CRL settings"
        ),
        TlsFailure::NoServerTls
        | TlsFailure::Config(_)
        | TlsFailure::Protocol(_)
        | TlsFailure::Other(_) => {
            let d = match f {
                TlsFailure::Config(d) | TlsFailure::Protocol(d) | TlsFailure::Other(d) => {
                    d.as_str()
                }
                _ => "the broker does not speak TLS",
            };
            format!(
                "{what}: {d}; check that rabbitmq.url names the broker's TLS port (amqps://, \
                 usually 5671) and rabbitmq.ca_file"
            )
        }
    }
}
