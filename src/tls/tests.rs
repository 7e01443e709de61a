//! TLS settings, certificate names and failure messages.

use super::*;
use crate::pgurl::PgTarget;

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
        let e = client_config(verification(mode, false), None, None).unwrap_err();
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

/// The peer's certificate alert is about the relay's own certificate: an
/// expired client certificate is not told as the server's.
#[test]
fn a_refused_client_certificate_is_not_blamed_on_the_server() {
    use rustls::AlertDescription;
    for alert in [
        AlertDescription::CertificateExpired,
        AlertDescription::UnknownCA,
        AlertDescription::CertificateRequired,
        AlertDescription::BadCertificate,
    ] {
        let io = std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            rustls::Error::AlertReceived(alert),
        );
        let f = TlsFailure::find(&io).unwrap();
        assert!(
            matches!(f, TlsFailure::ClientCertRefused(_)),
            "{alert:?}: {f:?}"
        );
        assert!(f.is_permanent());
        let text = format!(
            "TLS handshake failed: {}",
            rustls::Error::AlertReceived(alert)
        );
        assert_eq!(TlsFailure::from_text(&text), f, "{text}");
        let m = postgres_failure(&f, "postgres://h/db", SslMode::VerifyFull);
        assert!(
            m.contains("client certificate") && m.contains("postgres.cert_file"),
            "{m}"
        );
        assert!(!m.contains("server certificate"), "{m}");
        let m = rabbitmq_failure(&f, "amqps://h");
        assert!(
            m.contains("client certificate") && m.contains("rabbitmq.cert_file"),
            "{m}"
        );
        assert!(!m.contains("broker certificate"), "{m}");
    }
    // Other alerts stay protocol failures; the server's own expired
    // certificate stays the server's.
    let f = TlsFailure::from_text("TLS handshake failed: received fatal alert: HandshakeFailure");
    assert!(matches!(f, TlsFailure::Protocol(_)), "{f:?}");
    let f = TlsFailure::from_text("TLS handshake failed: invalid peer certificate: Expired");
    assert!(matches!(f, TlsFailure::Expired(_)), "{f:?}");
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

/// A client certificate is read again at every connect; a pair that cannot
/// be used right then (a key replaced after its certificate, read in
/// between) falls back to the pair read before, and only a first read
/// fails.
#[test]
fn a_client_certificate_falls_back_to_the_pair_read_before() {
    let dir = tempfile::tempdir().unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = rcgen::CertificateParams::new(vec!["relay".to_owned()])
        .unwrap()
        .self_signed(&key)
        .unwrap();
    let (c, k) = (dir.path().join("c.pem"), dir.path().join("k.pem"));
    std::fs::write(&c, cert.pem()).unwrap();
    std::fs::write(&k, key.serialize_pem()).unwrap();
    let client = ClientCert::new(c.clone(), k.clone());
    client.check().unwrap();
    let builder = || {
        ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(RootCertStore::empty())
    };
    // Another key, not the certificate's: fresh reads fail, connects
    // present the pair read before.
    std::fs::write(&k, rcgen::KeyPair::generate().unwrap().serialize_pem()).unwrap();
    assert!(client.fresh().is_err());
    let config = with_client_cert(builder(), Some(&client)).unwrap();
    assert!(config.client_auth_cert_resolver.has_certs());
    // Never read well: an error naming the files.
    let never = ClientCert::new(c.clone(), k.clone());
    let e = with_client_cert(builder(), Some(&never)).unwrap_err();
    assert!(e.contains("k.pem") && e.contains("usable"), "{e}");
}
