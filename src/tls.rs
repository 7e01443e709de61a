//! TLS for the three connections: the SQL connection (tokio-postgres with
//! rustls), the replication connection (pgwire-replication's rustls) and the
//! broker connection (tokio-rustls; lapin's rustls for `check`). All use the
//! ring provider.
//!
//! PostgreSQL follows libpq's `sslmode`, and refuses what libpq refuses:
//!
//! | sslmode | TLS | certificate checked | host name checked |
//! |---|---|---|---|
//! | `disable` | never | - | - |
//! | `prefer` (default) | if the server offers it, else plaintext | no | no |
//! | `require` | always | only if a CA file is set (as libpq) | no |
//! | `verify-ca` | always | yes, against the CA file only | no |
//! | `verify-full` | always | yes, against the CA file only | yes |
//!
//! The CA is `postgres.ca_file` (or `sslrootcert=` in the URL). There is no
//! fallback to public roots: `verify-ca` and `verify-full` without a CA file
//! are refused when the configuration is loaded, because "any certificate a
//! public CA signed" is something anyone can obtain for a domain of their
//! own. The one exception is libpq's `sslrootcert=system`: the system's CA
//! bundle ([`system_ca_bundle`]), allowed only with `verify-full` (and its
//! default then), so a public certificate must at least name the host.
//! Unix-socket connections never use TLS (libpq ignores `sslmode` there too).
//!
//! RabbitMQ: `amqps://` URLs use TLS and verify the broker's certificate and
//! host name against `rabbitmq.ca_file` alone when it is set (a private CA
//! pins the broker), else against the system's CA bundle.
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

use crate::pgurl::PgTarget;

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

/// Where OpenSSL (and so libpq's `sslrootcert=system`) finds the system's
/// CA bundle on the common distributions: Debian and Ubuntu, Fedora and
/// RHEL, openSUSE, Alpine.
const SYSTEM_BUNDLES: &[&str] = &[
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/pki/tls/certs/ca-bundle.crt",
    "/etc/ssl/ca-bundle.pem",
    "/etc/ssl/cert.pem",
];

/// The system's CA bundle: `SSL_CERT_FILE` when set (as OpenSSL reads it),
/// else the first of the distributions' bundle files that exists.
pub fn system_ca_bundle(ssl_cert_file: Option<&str>) -> Option<PathBuf> {
    if let Some(f) = ssl_cert_file.filter(|f| !f.is_empty()) {
        return Some(PathBuf::from(f));
    }
    SYSTEM_BUNDLES
        .iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
}

/// The roots to verify against: the CA file's certificates, and nothing
/// else.
fn root_store(ca_file: &Path) -> Result<RootCertStore, String> {
    let mut roots = RootCertStore::empty();
    roots.add_parsable_certificates(load_ca_file(ca_file)?);
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
    // Refused when the configuration was loaded; never fall back to public
    // roots here.
    let ca = || {
        ca_file.ok_or_else(|| {
            "verifying the server certificate needs a CA file (postgres.ca_file)".to_owned()
        })
    };
    let config = match verify {
        Verify::Full => builder
            .with_root_certificates(root_store(ca()?)?)
            .with_no_client_auth(),
        Verify::Chain => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(chain_only(ca()?, provider)?))
            .with_no_client_auth(),
        Verify::Nothing => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(NoVerification(provider)))
            .with_no_client_auth(),
    };
    Ok(config)
}

fn chain_only(ca_file: &Path, provider: Arc<CryptoProvider>) -> Result<ChainOnly, String> {
    let inner =
        WebPkiServerVerifier::builder_with_provider(Arc::new(root_store(ca_file)?), provider)
            .build()
            .map_err(|e| e.to_string())?;
    Ok(ChainOnly(inner))
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

/// pgwire-replication's TLS settings for `mode`, connecting to `target`.
///
/// pgwire-replication 0.5's verify-ca still compares the host name with the
/// certificate (it waits for rustls's `NotValidForName`, which rustls now
/// reports as `NotValidForNameContext`). So where only the chain is to be
/// verified, a short probe connection reads the server's certificate first,
/// verifying its chain against the CA file, and if the certificate does not
/// name the host, one of the names it does list is given to
/// pgwire-replication as the name to check: a certificate signed by the
/// configured CA passes, as verify-ca says, and no other does (the real
/// connection verifies the chain again, against the same CA file).
pub async fn postgres_replication_tls_for(
    mode: SslMode,
    ca_file: Option<&Path>,
    target: &PgTarget,
) -> Result<pgwire_replication::TlsConfig, String> {
    let tls = postgres_replication_tls(mode, ca_file, target)?;
    match (target, ca_file) {
        (PgTarget::Tcp { name, addr, port }, Some(ca))
            if tls.mode == pgwire_replication::SslMode::VerifyCa =>
        {
            let probe = certificate_name_for(name, addr, *port, ca);
            Ok(
                match tokio::time::timeout(std::time::Duration::from_secs(10), probe).await {
                    Ok(Some(name)) => tls.with_sni_hostname(name),
                    // No TLS, an untrusted chain...: the real connection says so.
                    _ => tls,
                },
            )
        }
        _ => Ok(tls),
    }
}

/// A name the certificate of the server at `addr:port` lists, when it does
/// not list `name` and its chain leads to `ca_file`; `None` otherwise.
async fn certificate_name_for(name: &str, addr: &str, port: u16, ca_file: &Path) -> Option<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio_postgres::tls::{MakeTlsConnect, TlsConnect};

    let mut tcp = tokio::net::TcpStream::connect((addr, port)).await.ok()?;
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
    let seen: Seen = Arc::new(std::sync::Mutex::new(None));
    let config = ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .ok()?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(Recording {
            inner: chain_only(ca_file, provider).ok()?,
            seen: seen.clone(),
        }))
        .with_no_client_auth();
    let mut make = tokio_postgres_rustls::MakeRustlsConnect::new(config);
    let connect =
        MakeTlsConnect::<tokio::net::TcpStream>::make_tls_connect(&mut make, name).ok()?;
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

/// pgwire-replication's TLS settings for `mode`, connecting to `target`;
/// see [`postgres_replication_tls_for`]. The name checked (and sent as SNI)
/// is always the URL's host name, also when `hostaddr` says where to
/// connect, exactly as for the SQL connection.
pub fn postgres_replication_tls(
    mode: SslMode,
    ca_file: Option<&Path>,
    target: &PgTarget,
) -> Result<pgwire_replication::TlsConfig, String> {
    use pgwire_replication::TlsConfig;
    let PgTarget::Tcp { name, .. } = target else {
        return Ok(TlsConfig::disabled());
    };
    let ca: Option<PathBuf> = ca_file.map(Path::to_path_buf);
    let tls = match (mode, verification(mode, ca.is_some())) {
        (SslMode::Disable, _) => return Ok(TlsConfig::disabled()),
        (SslMode::Prefer, _) => TlsConfig {
            mode: pgwire_replication::SslMode::Prefer,
            ..TlsConfig::default()
        },
        (_, Verify::Nothing) => TlsConfig::require(),
        // pgwire-replication would fall back to the Mozilla roots: never.
        (_, Verify::Chain | Verify::Full) if ca.is_none() => {
            return Err(format!(
                "sslmode={mode} needs a CA file to verify the server certificate \
                 (postgres.ca_file)"
            ));
        }
        (_, Verify::Chain) => TlsConfig::verify_ca(ca),
        (_, Verify::Full) => TlsConfig::verify_full(ca),
    };
    Ok(tls.with_sni_hostname(name.as_str()))
}

// -------------------------------------------------------------- RabbitMQ

// lapin opens amqps:// URLs in plaintext when its TLS is not compiled in
// (no root-set feature, no `rustls-common`): this name exists only with it,
// so dropping the feature from Cargo.toml is a compile error, not a silent
// downgrade.
#[allow(unused_imports)]
use amq_protocol_tcp::RustlsConnectorConfig as _;

/// lapin's TLS settings, for `check`: the certificates of `roots` (the CA
/// file, or the system bundle) and nothing else. lapin is built without a
/// bundled root set, so these are all it trusts.
pub fn rabbitmq_tls(roots: &Path) -> Result<lapin::tcp::OwnedTLSConfig, String> {
    provider();
    Ok(lapin::tcp::OwnedTLSConfig {
        identity: None,
        cert_chain: Some(read_ca_file(roots)?.0),
    })
}

/// The relay's own AMQP connection's TLS settings: the certificates of
/// `roots` (the CA file, or the system bundle) and nothing else.
pub fn rabbitmq_client_config(roots: &Path) -> Result<Arc<ClientConfig>, String> {
    let config = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(root_store(roots)?)
        .with_no_client_auth();
    Ok(Arc::new(config))
}

/// A TLS handshake with the broker at `host:port`, trusting `roots` as the
/// relay's own client does. `check` runs it before lapin, whose TLS errors
/// do not say why the broker was refused.
pub async fn rabbitmq_handshake(host: &str, port: u16, roots: &Path) -> std::io::Result<()> {
    use std::io::{Error, ErrorKind};
    let config =
        rabbitmq_client_config(roots).map_err(|e| Error::new(ErrorKind::InvalidInput, e))?;
    let name = ServerName::try_from(host.to_owned())
        .map_err(|e| Error::new(ErrorKind::InvalidInput, e))?;
    let tcp = tokio::net::TcpStream::connect((host, port)).await?;
    tokio_rustls::TlsConnector::from(config)
        .connect(name, tcp)
        .await
        .map(drop)
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
    fn what_each_mode_verifies() {
        assert_eq!(verification(SslMode::Prefer, true), Verify::Nothing);
        assert_eq!(verification(SslMode::Require, false), Verify::Nothing);
        assert_eq!(verification(SslMode::Require, true), Verify::Chain);
        assert_eq!(verification(SslMode::VerifyCa, false), Verify::Chain);
        assert_eq!(verification(SslMode::VerifyFull, false), Verify::Full);

        use pgwire_replication::SslMode as P;
        let ca = Path::new("/ca.pem");
        let tcp = |name: &str, addr: &str| PgTarget::Tcp {
            name: name.into(),
            addr: addr.into(),
            port: 5432,
        };
        let h = tcp("h", "h");
        let unix = PgTarget::Unix {
            dir: "/run/postgresql".into(),
            port: 5432,
        };
        let t = |m, ca, target: &PgTarget| postgres_replication_tls(m, ca, target).unwrap();
        assert_eq!(t(SslMode::Disable, None, &h).mode, P::Disable);
        assert_eq!(t(SslMode::Prefer, Some(ca), &h).mode, P::Prefer);
        assert_eq!(t(SslMode::Require, None, &h).mode, P::Require);
        assert_eq!(t(SslMode::Require, Some(ca), &h).mode, P::VerifyCa);
        assert_eq!(t(SslMode::VerifyFull, Some(ca), &unix).mode, P::Disable);
        let full = t(
            SslMode::VerifyFull,
            Some(ca),
            &tcp("127.0.0.1", "127.0.0.1"),
        );
        assert_eq!(full.mode, P::VerifyFull);
        assert_eq!(full.sni_hostname.as_deref(), Some("127.0.0.1"));
        assert_eq!(full.ca_pem_path.as_deref(), Some(ca));
        // hostaddr: the name checked is the URL's host, not the address.
        let by_addr = t(
            SslMode::VerifyFull,
            Some(ca),
            &tcp("db.example", "10.1.2.3"),
        );
        assert_eq!(by_addr.sni_hostname.as_deref(), Some("db.example"));
        // Never the public roots: verifying without a CA file is an error,
        // on the replication connection as on the SQL connection.
        for mode in [SslMode::VerifyCa, SslMode::VerifyFull] {
            let e = postgres_replication_tls(mode, None, &h).unwrap_err();
            assert!(e.contains("postgres.ca_file"), "{e}");
            let e = client_config(verification(mode, false), None).unwrap_err();
            assert!(e.contains("postgres.ca_file"), "{e}");
        }
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
