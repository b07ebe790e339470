//! Certificates for TLS upstreams in the tests and benches: a CA made for the test and a
//! server certificate it signed, written as PEM files for the scripted upstream
//! (`--tls-cert`, `--tls-key`) and haltd (`--upstream-ca-file`).

use std::{fs, path::PathBuf};

use anyhow::{Context, Result};
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};

use crate::temp_dir;

/// A test CA and a server certificate, as files; removed on drop.
#[derive(Debug)]
pub struct TestPki {
    dir: PathBuf,
    /// The CA certificate (PEM): what haltd trusts with `--upstream-ca-file`.
    pub ca: PathBuf,
    /// The server's certificate chain (PEM, the leaf only).
    pub cert: PathBuf,
    /// The server's private key (PKCS#8 PEM).
    pub key: PathBuf,
}

impl TestPki {
    /// A new CA named `name` and a server certificate it signed for `sans` (DNS names or IP
    /// addresses).
    pub fn new(name: &str, sans: &[&str]) -> Result<Self> {
        let dir = temp_dir("tls")?;
        let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(DnType::CommonName, format!("haltd test CA {name}"));
        let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate()?)
            .context("making the CA")?;
        let key = KeyPair::generate()?;
        let sans: Vec<String> = sans.iter().map(|s| (*s).to_owned()).collect();
        let leaf = CertificateParams::new(sans)?
            .signed_by(&key, &ca)
            .context("signing the server certificate")?;
        let pki = TestPki {
            ca: dir.join("ca.pem"),
            cert: dir.join("server.pem"),
            key: dir.join("server.key"),
            dir,
        };
        fs::write(&pki.ca, ca.pem())?;
        fs::write(&pki.cert, leaf.pem())?;
        fs::write(&pki.key, key.serialize_pem())?;
        Ok(pki)
    }

    /// The scripted upstream's flags that make it serve this certificate.
    pub fn upstream_args(&self) -> Vec<String> {
        vec![
            "--tls-cert".into(),
            self.cert.display().to_string(),
            "--tls-key".into(),
            self.key.display().to_string(),
        ]
    }
}

impl Drop for TestPki {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.dir);
    }
}
