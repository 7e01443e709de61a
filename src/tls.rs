//! TLS for the three connections: the SQL connection (tokio-postgres with
//! rustls), the replication connection (pgwire-replication's rustls) and the
//! broker connection (tokio-rustls; lapin's rustls for `check`). All use the
//! ring provider.
//!
//! PostgreSQL follows libpq's `sslmode`:
//!
//! | sslmode | TLS | certificate checked | host name checked |
//! |---|---|---|---|
//! | `disable` | never | - | - |
//! | `prefer` (default) | if the server offers it, else plaintext | no | no |
//! | `require` | always | only if a CA file is set (as libpq) | no |
//! | `verify-ca` | always | yes | no |
//! | `verify-full` | always | yes | yes |
//!
//! The CA is `postgres.ca_file` (or `sslrootcert=` in the URL); without one,
//! the Mozilla roots of `webpki-roots` are trusted. Unix-socket connections
//! never use TLS (libpq ignores `sslmode` for them too).
//!
//! RabbitMQ: `amqps://` URLs use TLS and verify the broker's certificate and
//! host name against the Mozilla roots plus `rabbitmq.ca_file`.
//!
//! Handshake failures are turned into messages that name the setting to
//! change, see [`postgres_failure`] and [`rabbitmq_failure`].

use std::error::Error as StdError;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::{ClientConfig, WebPkiServerVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{CertificateError, DigitallySignedStruct, RootCertStore, SignatureScheme};

/// libpq's `sslmode`, for both PostgreSQL connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SslMode {
    /// Plaintext only.
    Disable,
    /// TLS when the server offers it, without verifying the certificate.
    #[default]
    Prefer,
    /// TLS or fail; the certificate is verified only against a configured CA.
    Require,
    /// TLS, certificate chain verified; the host name is not checked.
    VerifyCa,
    /// TLS, certificate chain and host name verified.
    VerifyFull,
}

impl SslMode {
    /// The accepted spellings, for error messages.
    pub const CHOICES: &'static str = "disable, prefer, require, verify-ca, verify-full";

    /// Parses libpq's spelling (`allow` is read as `prefer`, its closest
    /// equivalent here).
    pub fn parse(s: &str) -> Option<SslMode> {
        Some(match s.trim().to_ascii_lowercase().as_str() {
            "disable" => SslMode::Disable,
            "allow" | "prefer" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" | "verify_ca" => SslMode::VerifyCa,
            "verify-full" | "verify_full" => SslMode::VerifyFull,
            _ => return None,
        })
    }

    /// libpq's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            SslMode::Disable => "disable",
            SslMode::Prefer => "prefer",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        }
    }
}

impl fmt::Display for SslMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What the server's certificate is checked against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verify {
    /// Nothing: encryption without authentication.
    Nothing,
    /// The chain up to a trusted root, any host name.
    Chain,
    /// Chain and host name.
    Full,
}

fn verification(mode: SslMode, has_ca: bool) -> Verify {
    match mode {
        SslMode::Disable | SslMode::Prefer => Verify::Nothing,
        // libpq: "if a root CA file exists, sslmode=require behaves like verify-ca".
        SslMode::Require if has_ca => Verify::Chain,
        SslMode::Require => Verify::Nothing,
        SslMode::VerifyCa => Verify::Chain,
        SslMode::VerifyFull => Verify::Full,
    }
}

// ------------------------------------------------------------------ URLs

/// A `postgres://` URL split into the part tokio-postgres understands and
/// libpq's TLS parameters, which it does not (`verify-ca`, `verify-full`,
/// `sslrootcert`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PgUrl {
    /// The URL without `sslmode` and `sslrootcert`.
    pub url: String,
    /// `sslmode=` as written.
    pub sslmode: Option<String>,
    /// `sslrootcert=`, percent-decoded.
    pub sslrootcert: Option<String>,
}

/// Splits `sslmode` and `sslrootcert` out of the URL's query string.
pub fn split_pg_url(url: &str) -> PgUrl {
    let Some((base, query)) = url.split_once('?') else {
        return PgUrl {
            url: url.to_owned(),
            sslmode: None,
            sslrootcert: None,
        };
    };
    let (mut sslmode, mut sslrootcert) = (None, None);
    let mut kept = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        match percent_decode(k).as_str() {
            "sslmode" => sslmode = Some(percent_decode(v)),
            "sslrootcert" => sslrootcert = Some(percent_decode(v)),
            _ => kept.push(pair),
        }
    }
    let url = if kept.is_empty() {
        base.to_owned()
    } else {
        format!("{base}?{}", kept.join("&"))
    };
    PgUrl {
        url,
        sslmode,
        sslrootcert,
    }
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        if b[i] == b'%' && i + 2 < b.len() {
            if let (Some(h), Some(l)) = (hex(b[i + 1]), hex(b[i + 2])) {
                out.push((h * 16 + l) as u8);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

// ------------------------------------------------------------ certificates

/// Reads a PEM file of CA certificates; the message says what is wrong with
/// the file (the caller names the setting).
pub fn load_ca_file(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    Ok(read_ca_file(path)?.1)
}

/// The file's text and its certificates.
fn read_ca_file(path: &Path) -> Result<(String, Vec<CertificateDer<'static>>), String> {
    let pem = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let certs = CertificateDer::pem_slice_iter(pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{} is not a PEM file: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!(
            "{} holds no PEM certificate (-----BEGIN CERTIFICATE-----)",
            path.display()
        ));
    }
    let mut store = RootCertStore::empty();
    let (added, _) = store.add_parsable_certificates(certs.iter().cloned());
    if added == 0 {
        return Err(format!("{} holds no usable CA certificate", path.display()));
    }
    Ok((pem, certs))
}

/// The roots to verify against: the CA file if given, else webpki-roots.
fn root_store(ca_file: Option<&Path>) -> Result<RootCertStore, String> {
    let mut roots = RootCertStore::empty();
    match ca_file {
        Some(path) => {
            roots.add_parsable_certificates(load_ca_file(path)?);
        }
        None => roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned()),
    }
    Ok(roots)
}

fn provider() -> Arc<CryptoProvider> {
    // pgwire-replication and lapin's connector use the process default;
    // make it ring everywhere (aws-lc-rs may be compiled in as well, and then
    // rustls would refuse to pick one).
    let _ = rustls::crypto::ring::default_provider().install_default();
    Arc::new(rustls::crypto::ring::default_provider())
}

fn client_config(verify: Verify, ca_file: Option<&Path>) -> Result<ClientConfig, String> {
    let provider = provider();
    let builder = ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?;
    let config = match verify {
        Verify::Full => builder
            .with_root_certificates(root_store(ca_file)?)
            .with_no_client_auth(),
        Verify::Chain => {
            let inner = WebPkiServerVerifier::builder_with_provider(
                Arc::new(root_store(ca_file)?),
                provider,
            )
            .build()
            .map_err(|e| e.to_string())?;
            builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(ChainOnly(inner)))
                .with_no_client_auth()
        }
        Verify::Nothing => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(NoVerification(provider)))
            .with_no_client_auth(),
    };
    Ok(config)
}

/// verify-ca: the chain must lead to a trusted root; the names in the
/// certificate are not compared with the host.
#[derive(Debug)]
struct ChainOnly(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
        {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

/// prefer/require without a CA: encrypt, authenticate nothing (as libpq).
/// The handshake signature is still checked, so the connection is bound to
/// the key in whatever certificate the server sent.
#[derive(Debug)]
struct NoVerification(Arc<CryptoProvider>);

impl ServerCertVerifier for NoVerification {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

// ------------------------------------------------------------- PostgreSQL

/// True when every host of the URL is a Unix-socket directory: no TLS there.
fn unix_only(pg: &tokio_postgres::Config) -> bool {
    let hosts = pg.get_hosts();
    !hosts.is_empty()
        && hosts
            .iter()
            .all(|h| matches!(h, tokio_postgres::config::Host::Unix(_)))
}

/// Sets tokio-postgres's `ssl_mode` for `mode` and returns the connector.
pub fn postgres_sql_tls(
    pg: &mut tokio_postgres::Config,
    mode: SslMode,
    ca_file: Option<&Path>,
) -> Result<tokio_postgres_rustls::MakeRustlsConnect, String> {
    use tokio_postgres::config::SslMode as Tp;
    let tp = match mode {
        _ if unix_only(pg) => Tp::Disable,
        SslMode::Disable => Tp::Disable,
        SslMode::Prefer => Tp::Prefer,
        SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => Tp::Require,
    };
    pg.ssl_mode(tp);
    let verify = if tp == Tp::Disable {
        Verify::Nothing
    } else {
        verification(mode, ca_file.is_some())
    };
    let ca_file = if verify == Verify::Nothing {
        None
    } else {
        ca_file
    };
    Ok(tokio_postgres_rustls::MakeRustlsConnect::new(
        client_config(verify, ca_file)?,
    ))
}

/// pgwire-replication's TLS settings for `mode`, connecting to `host:port`
/// (`host` `None`: a Unix socket).
///
/// pgwire-replication 0.5's verify-ca still compares the host name with the
/// certificate (it waits for rustls's `NotValidForName`, which rustls now
/// reports as `NotValidForNameContext`). So where only the chain is to be
/// verified, a short probe connection reads the server's certificate first,
/// verifying its chain, and if the certificate does not name `host`, one of
/// the names it does list is given to pgwire-replication as the name to
/// check: a certificate signed by the trusted CA passes, as verify-ca says.
pub async fn postgres_replication_tls_for(
    mode: SslMode,
    ca_file: Option<&Path>,
    host: Option<&str>,
    port: u16,
) -> pgwire_replication::TlsConfig {
    let tls = postgres_replication_tls(mode, ca_file, host);
    match host {
        Some(host) if tls.mode == pgwire_replication::SslMode::VerifyCa => {
            let probe = certificate_name_for(host, port, ca_file);
            match tokio::time::timeout(std::time::Duration::from_secs(10), probe).await {
                Ok(Some(name)) => tls.with_sni_hostname(name),
                // No TLS, an untrusted chain...: the real connection says so.
                _ => tls,
            }
        }
        _ => tls,
    }
}

/// A name the certificate of the server at `host:port` lists, when it does
/// not list `host` and its chain is trusted; `None` otherwise.
async fn certificate_name_for(host: &str, port: u16, ca_file: Option<&Path>) -> Option<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio_postgres::tls::{MakeTlsConnect, TlsConnect};

    let mut tcp = tokio::net::TcpStream::connect((host, port)).await.ok()?;
    // SSLRequest: length 8, code 80877103.
    tcp.write_all(&[0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f])
        .await
        .ok()?;
    let mut answer = [0u8; 1];
    tcp.read_exact(&mut answer).await.ok()?;
    if answer[0] != b'S' {
        return None;
    }
    let provider = provider();
    let inner = WebPkiServerVerifier::builder_with_provider(
        Arc::new(root_store(ca_file).ok()?),
        provider.clone(),
    )
    .build()
    .ok()?;
    let seen: Seen = Arc::new(std::sync::Mutex::new(None));
    let config = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .ok()?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(Recording {
            inner: ChainOnly(inner),
            seen: seen.clone(),
        }))
        .with_no_client_auth();
    let mut make = tokio_postgres_rustls::MakeRustlsConnect::new(config);
    let connect =
        MakeTlsConnect::<tokio::net::TcpStream>::make_tls_connect(&mut make, host).ok()?;
    let stream = connect.connect(tcp).await.ok()?;
    drop(stream);
    let (der, name_matched): (Vec<u8>, bool) = seen.lock().ok()?.take()?;
    if name_matched {
        return None;
    }
    certificate_names(&der).into_iter().next()
}

/// The DNS names and IP addresses of a certificate's subjectAltName, as
/// names rustls accepts (a wildcard `*.x` as `outbox-relay.x`).
fn certificate_names(der: &[u8]) -> Vec<String> {
    use x509_cert::der::Decode;
    use x509_cert::ext::pkix::SubjectAltName;
    use x509_cert::ext::pkix::name::GeneralName;
    let Ok(cert) = x509_cert::Certificate::from_der(der) else {
        return Vec::new();
    };
    let Ok(Some((_, san))) = cert.tbs_certificate.get::<SubjectAltName>() else {
        return Vec::new();
    };
    san.0
        .iter()
        .filter_map(|n| match n {
            GeneralName::DnsName(d) => {
                let d = d.as_str();
                Some(match d.strip_prefix("*.") {
                    Some(rest) => format!("outbox-relay.{rest}"),
                    None => d.to_owned(),
                })
            }
            GeneralName::IpAddress(ip) => match ip.as_bytes().len() {
                4 => {
                    let b: [u8; 4] = ip.as_bytes().try_into().ok()?;
                    Some(std::net::Ipv4Addr::from(b).to_string())
                }
                16 => {
                    let b: [u8; 16] = ip.as_bytes().try_into().ok()?;
                    Some(std::net::Ipv6Addr::from(b).to_string())
                }
                _ => None,
            },
            _ => None,
        })
        .filter(|n| ServerName::try_from(n.clone()).is_ok())
        .collect()
}

/// Verifies like `inner` and keeps the certificate, and whether it names
/// the host, for [`certificate_name_for`].
#[derive(Debug)]
struct Recording {
    inner: ChainOnly,
    seen: Seen,
}

/// The certificate a probe saw, and whether it named the host.
type Seen = Arc<std::sync::Mutex<Option<(Vec<u8>, bool)>>>;

impl ServerCertVerifier for Recording {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let full = self.inner.0.verify_server_cert(
            end_entity,
            intermediates,
            server_name,
            ocsp_response,
            now,
        );
        let verified = self.inner.verify_server_cert(
            end_entity,
            intermediates,
            server_name,
            ocsp_response,
            now,
        )?;
        if let Ok(mut seen) = self.seen.lock() {
            *seen = Some((end_entity.to_vec(), full.is_ok()));
        }
        Ok(verified)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// pgwire-replication's TLS settings for `mode`, connecting to `host`
/// (`None`: a Unix socket); see [`postgres_replication_tls_for`].
pub fn postgres_replication_tls(
    mode: SslMode,
    ca_file: Option<&Path>,
    host: Option<&str>,
) -> pgwire_replication::TlsConfig {
    use pgwire_replication::TlsConfig;
    let Some(host) = host else {
        return TlsConfig::disabled();
    };
    let ca: Option<PathBuf> = ca_file.map(Path::to_path_buf);
    match (mode, verification(mode, ca.is_some())) {
        (SslMode::Disable, _) => TlsConfig::disabled(),
        (SslMode::Prefer, _) => TlsConfig {
            mode: pgwire_replication::SslMode::Prefer,
            ..TlsConfig::default()
        },
        (_, Verify::Nothing) => TlsConfig::require(),
        (_, Verify::Chain) => TlsConfig::verify_ca(ca),
        (_, Verify::Full) => {
            let tls = TlsConfig::verify_full(ca);
            // pgwire-replication refuses verify-full with an IP address
            // unless told the name to check: the address itself, which
            // rustls then matches against the certificate's IP SANs.
            if host.parse::<std::net::IpAddr>().is_ok() {
                tls.with_sni_hostname(host)
            } else {
                tls
            }
        }
    }
}

// -------------------------------------------------------------- RabbitMQ

/// lapin's TLS settings: the CA file's certificates are trusted in addition
/// to the Mozilla roots.
pub fn rabbitmq_tls(ca_file: Option<&Path>) -> Result<lapin::tcp::OwnedTLSConfig, String> {
    provider();
    let cert_chain = match ca_file {
        Some(path) => Some(read_ca_file(path)?.0),
        None => None,
    };
    Ok(lapin::tcp::OwnedTLSConfig {
        identity: None,
        cert_chain,
    })
}

/// The relay's own AMQP connection's TLS settings: the Mozilla roots, and
/// the CA file's certificates besides, as for `check` (lapin).
pub fn rabbitmq_client_config(ca_file: Option<&Path>) -> Result<Arc<ClientConfig>, String> {
    let provider = provider();
    let mut roots = RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    if let Some(path) = ca_file {
        roots.add_parsable_certificates(read_ca_file(path)?.1);
    }
    let config = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(Arc::new(config))
}

// -------------------------------------------------------------- failures

/// Why a TLS handshake failed, as far as the operator is concerned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TlsFailure {
    /// The chain does not lead to a trusted root.
    Untrusted(String),
    /// The certificate is not for the host connected to.
    WrongHost(String),
    /// The certificate is expired or not yet valid.
    Expired(String),
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
            if let Some(io) = e.downcast_ref::<std::io::Error>() {
                if let Some(r) = io.get_ref().and_then(|i| i.downcast_ref::<rustls::Error>()) {
                    return Some(TlsFailure::from_rustls(r));
                }
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

/// The message for a failed TLS handshake with PostgreSQL (`url` already
/// redacted), naming what to change.
pub fn postgres_failure(f: &TlsFailure, url: &str, mode: SslMode) -> String {
    let what = format!("TLS handshake with PostgreSQL ({url}) failed");
    match f {
        TlsFailure::Untrusted(d) => format!(
            "{what}: certificate not trusted ({d}); set postgres.ca_file to the CA that signed \
             the server certificate, or lower postgres.sslmode (now {mode}; require encrypts \
             without verifying)"
        ),
        TlsFailure::WrongHost(d) => format!(
            "{what}: the server certificate is not for this host ({d}); connect with a host name \
             the certificate lists in postgres.url, or set postgres.sslmode = \"verify-ca\" \
             (now {mode}) to skip the host name check"
        ),
        TlsFailure::Expired(d) => format!(
            "{what}: the server certificate is not valid now ({d}); renew it, or lower \
             postgres.sslmode (now {mode})"
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sslmode_spellings() {
        for m in [
            SslMode::Disable,
            SslMode::Prefer,
            SslMode::Require,
            SslMode::VerifyCa,
            SslMode::VerifyFull,
        ] {
            assert_eq!(SslMode::parse(m.as_str()), Some(m));
        }
        assert_eq!(SslMode::parse("VERIFY-FULL"), Some(SslMode::VerifyFull));
        assert_eq!(SslMode::parse("allow"), Some(SslMode::Prefer));
        assert_eq!(SslMode::parse("verify"), None);
        assert_eq!(SslMode::default(), SslMode::Prefer);
    }

    #[test]
    fn url_tls_parameters_are_split_out() {
        let u = split_pg_url(
            "postgres://u:p@db:5432/app?sslmode=verify-full&application_name=x&sslrootcert=%2Fetc%2Fca.pem",
        );
        assert_eq!(u.url, "postgres://u:p@db:5432/app?application_name=x");
        assert_eq!(u.sslmode.as_deref(), Some("verify-full"));
        assert_eq!(u.sslrootcert.as_deref(), Some("/etc/ca.pem"));

        let u = split_pg_url("postgres://db/app?sslmode=require");
        assert_eq!(u.url, "postgres://db/app");
        assert_eq!(u.sslmode.as_deref(), Some("require"));
        assert_eq!(u.sslrootcert, None);

        let u = split_pg_url("postgres://db/app");
        assert_eq!(u.url, "postgres://db/app");
        assert_eq!(u.sslmode, None);
        assert_eq!(percent_decode("a%2"), "a%2");
        assert_eq!(percent_decode("%41%zz"), "A%zz");
    }

    #[test]
    fn what_each_mode_verifies() {
        assert_eq!(verification(SslMode::Prefer, true), Verify::Nothing);
        assert_eq!(verification(SslMode::Require, false), Verify::Nothing);
        assert_eq!(verification(SslMode::Require, true), Verify::Chain);
        assert_eq!(verification(SslMode::VerifyCa, false), Verify::Chain);
        assert_eq!(verification(SslMode::VerifyFull, false), Verify::Full);

        use pgwire_replication::SslMode as P;
        let ca = Path::new("/ca.pem");
        let t = |m, ca, host| postgres_replication_tls(m, ca, host);
        assert_eq!(t(SslMode::Disable, None, Some("h")).mode, P::Disable);
        assert_eq!(t(SslMode::Prefer, Some(ca), Some("h")).mode, P::Prefer);
        assert_eq!(t(SslMode::Require, None, Some("h")).mode, P::Require);
        assert_eq!(t(SslMode::Require, Some(ca), Some("h")).mode, P::VerifyCa);
        assert_eq!(t(SslMode::VerifyFull, None, None).mode, P::Disable);
        let full = t(SslMode::VerifyFull, Some(ca), Some("127.0.0.1"));
        assert_eq!(full.mode, P::VerifyFull);
        assert_eq!(full.sni_hostname.as_deref(), Some("127.0.0.1"));
        assert_eq!(full.ca_pem_path.as_deref(), Some(ca));
        assert_eq!(
            t(SslMode::VerifyFull, None, Some("db.example")).sni_hostname,
            None
        );
    }

    #[test]
    fn failures_are_classified_and_name_the_setting() {
        let untrusted =
            TlsFailure::from_text("TLS handshake failed: invalid peer certificate: UnknownIssuer");
        assert!(matches!(untrusted, TlsFailure::Untrusted(_)));
        let m = postgres_failure(&untrusted, "postgres://h/db", SslMode::VerifyFull);
        assert!(m.contains("certificate not trusted"), "{m}");
        assert!(
            m.contains("postgres.ca_file") && m.contains("postgres.sslmode"),
            "{m}"
        );
        assert_eq!(
            TlsFailure::from_text("server does not support TLS (SSLRequest rejected)"),
            TlsFailure::NoServerTls
        );
        let io = std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            rustls::Error::InvalidCertificate(CertificateError::UnknownIssuer),
        );
        let f = TlsFailure::find(&io).unwrap();
        assert!(f.is_permanent());
        assert!(rabbitmq_failure(&f, "amqps://h").contains("rabbitmq.ca_file"));
        let plain = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset");
        assert_eq!(TlsFailure::find(&plain), None);
    }

    #[test]
    fn bad_ca_files_are_explained() {
        let dir = std::env::temp_dir().join(format!("outbox-relay-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let missing = dir.join("missing.pem");
        assert!(load_ca_file(&missing).unwrap_err().contains("cannot read"));
        let empty = dir.join("empty.pem");
        std::fs::write(&empty, "not a certificate\n").unwrap();
        assert!(
            load_ca_file(&empty)
                .unwrap_err()
                .contains("no PEM certificate")
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
