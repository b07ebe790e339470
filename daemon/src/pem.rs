//! PEM files for TLS, read the one way haltd reads them: the certificate chain of
//! `--tls-cert`, the private key of `--tls-key` (`client_tls.rs`) and the trust anchors of
//! `--upstream-ca-file` (`upstream/tls.rs`). An unreadable file and a file with no certificate
//! in it are errors naming the file, so both flags fail alike. Reads files: call it at start
//! or on SIGHUP, never on the data plane.

use std::path::{Path, PathBuf};

use rustls::pki_types::{pem::PemObject as _, CertificateDer, PrivateKeyDer};

/// Why a PEM file gave nothing usable.
#[derive(Debug, thiserror::Error)]
pub enum PemError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: rustls::pki_types::pem::Error,
    },
    #[error("{path} holds no PEM certificate")]
    NoCert { path: PathBuf },
}

impl PemError {
    fn read(path: &Path) -> impl FnOnce(rustls::pki_types::pem::Error) -> Self + '_ {
        move |source| PemError::Read {
            path: path.to_owned(),
            source,
        }
    }
}

/// Every certificate of `path`, in file order (a chain: leaf first); at least one.
pub fn certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, PemError> {
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(PemError::read(path))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(PemError::read(path))?;
    if certs.is_empty() {
        return Err(PemError::NoCert {
            path: path.to_owned(),
        });
    }
    Ok(certs)
}

/// The first private key of `path` (PKCS#8, PKCS#1 or SEC1).
pub fn private_key(path: &Path) -> Result<PrivateKeyDer<'static>, PemError> {
    PrivateKeyDer::from_pem_file(path).map_err(PemError::read(path))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_file_and_a_file_without_a_certificate_name_the_file() {
        let dir = std::env::temp_dir().join(format!("haltd-pem-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let missing = dir.join("missing.pem");
        let e = certificates(&missing).expect_err("missing");
        assert!(matches!(e, PemError::Read { .. }), "{e}");
        assert!(e.to_string().contains("missing.pem"), "{e}");
        let empty = dir.join("empty.pem");
        std::fs::write(&empty, "not a certificate\n").expect("write");
        let e = certificates(&empty).expect_err("empty");
        assert!(matches!(e, PemError::NoCert { .. }), "{e}");
        assert!(private_key(&empty).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
