//! Serving certificate from PEM files, reloaded when the files change.
//!
//! cert-manager and Secret volumes rotate the certificate by replacing the files (a Secret
//! volume swaps a `..data` symlink, so both files change at once). On every TLS handshake the
//! resolver compares the files' identity (device, inode, size, mtime) with what it loaded; when
//! they differ it reloads. Invariants:
//! - a handshake always gets a certificate whose key matches it: a half-rotated pair (new
//!   certificate, old key) or an unreadable file keeps the previous pair, and the reload is
//!   retried on the next handshake;
//! - the first load must succeed, so the server never starts without a certificate.

use std::fs::Metadata;
use std::io::BufReader;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use prometheus_client::metrics::counter::Counter;
use rustls::ServerConfig;
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use tracing::{info, warn};

/// Why the certificate or key could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read.
    #[error("reading {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The certificate file holds no PEM `CERTIFICATE` block.
    #[error(
        "{path}: no PEM CERTIFICATE block found (expected a PEM certificate chain, leaf first)"
    )]
    NoCertificate {
        /// The file.
        path: PathBuf,
    },
    /// The key file holds no PEM private key.
    #[error("{path}: no PEM private key found (expected PKCS#8, PKCS#1 RSA or SEC1 EC)")]
    NoKey {
        /// The file.
        path: PathBuf,
    },
    /// The key is of an unsupported type, or does not belong to the certificate.
    #[error("{key}: key unusable with {cert}: {source}")]
    Key {
        /// The certificate file.
        cert: PathBuf,
        /// The key file.
        key: PathBuf,
        /// What rustls said.
        #[source]
        source: rustls::Error,
    },
    /// rustls refused the server configuration.
    #[error("building the TLS configuration: {0}")]
    Config(#[source] rustls::Error),
}

/// Identity of the two files as last loaded; any change triggers a reload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stamp {
    cert: FileStamp,
    key: FileStamp,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileStamp {
    dev: u64,
    ino: u64,
    len: u64,
    mtime_ns: i128,
}

impl FileStamp {
    fn of(meta: &Metadata) -> Self {
        Self {
            dev: meta.dev(),
            ino: meta.ino(),
            len: meta.len(),
            mtime_ns: i128::from(meta.mtime()) * 1_000_000_000 + i128::from(meta.mtime_nsec()),
        }
    }
}

#[derive(Debug)]
struct Loaded {
    stamp: Option<Stamp>,
    key: Arc<CertifiedKey>,
}

/// A [`ResolvesServerCert`] that serves the pair in two PEM files and follows their rotation.
#[derive(Debug)]
pub struct ReloadingCert {
    cert_path: PathBuf,
    key_path: PathBuf,
    loaded: Mutex<Loaded>,
    reloads: Counter,
    reload_failures: Counter,
}

impl ReloadingCert {
    /// Loads the pair; fails if it cannot, so the server never starts without a certificate.
    ///
    /// `reloads` and `reload_failures` count later rotations (see [`crate::metrics`]).
    pub fn load(
        cert_path: &Path,
        key_path: &Path,
        reloads: Counter,
        reload_failures: Counter,
    ) -> Result<Self, TlsError> {
        let stamp = stamp(cert_path, key_path);
        let key = load_pair(cert_path, key_path)?;
        Ok(Self {
            cert_path: cert_path.to_owned(),
            key_path: key_path.to_owned(),
            loaded: Mutex::new(Loaded { stamp, key }),
            reloads,
            reload_failures,
        })
    }

    /// The pair to serve now, reloaded first if the files changed since the last load.
    pub fn current(&self) -> Arc<CertifiedKey> {
        let mut loaded = self.loaded.lock().unwrap_or_else(PoisonError::into_inner);
        let now = stamp(&self.cert_path, &self.key_path);
        if now.is_some() && now != loaded.stamp {
            match load_pair(&self.cert_path, &self.key_path) {
                Ok(key) => {
                    *loaded = Loaded { stamp: now, key };
                    self.reloads.inc();
                    info!(cert = %self.cert_path.display(), "serving certificate reloaded");
                }
                Err(error) => {
                    // Keep serving the previous pair; `loaded.stamp` is left as it was so the
                    // next handshake tries again (the other half of a rotation may be late).
                    self.reload_failures.inc();
                    warn!(%error, "serving certificate changed but cannot be loaded; keeping the previous one");
                }
            }
        }
        Arc::clone(&loaded.key)
    }

    /// A rustls server configuration that resolves its certificate through `self`, offering
    /// HTTP/2 and HTTP/1.1 (the API server prefers HTTP/2).
    pub fn server_config(self: Arc<Self>) -> Result<Arc<ServerConfig>, TlsError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(TlsError::Config)?
            .with_no_client_auth()
            .with_cert_resolver(self);
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(Arc::new(config))
    }
}

impl ResolvesServerCert for ReloadingCert {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current())
    }
}

fn stamp(cert: &Path, key: &Path) -> Option<Stamp> {
    Some(Stamp {
        cert: FileStamp::of(&std::fs::metadata(cert).ok()?),
        key: FileStamp::of(&std::fs::metadata(key).ok()?),
    })
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        path: path.to_owned(),
        source,
    })
}

fn load_pair(cert_path: &Path, key_path: &Path) -> Result<Arc<CertifiedKey>, TlsError> {
    let cert_pem = read(cert_path)?;
    let key_pem = read(key_path)?;
    let chain = rustls_pemfile::certs(&mut BufReader::new(cert_pem.as_slice()))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|source| TlsError::Read {
            path: cert_path.to_owned(),
            source,
        })?;
    if chain.is_empty() {
        return Err(TlsError::NoCertificate {
            path: cert_path.to_owned(),
        });
    }
    let key = rustls_pemfile::private_key(&mut BufReader::new(key_pem.as_slice()))
        .map_err(|source| TlsError::Read {
            path: key_path.to_owned(),
            source,
        })?
        .ok_or_else(|| TlsError::NoKey {
            path: key_path.to_owned(),
        })?;
    let key_error = |source| TlsError::Key {
        cert: cert_path.to_owned(),
        key: key_path.to_owned(),
        source,
    };
    let signer = rustls::crypto::ring::sign::any_supported_type(&key).map_err(key_error)?;
    let certified = CertifiedKey::new(chain, signer);
    certified.keys_match().map_err(key_error)?;
    Ok(Arc::new(certified))
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Pair {
        cert: String,
        key: String,
    }

    fn generate(name: &str) -> Pair {
        let c = rcgen::generate_simple_self_signed(vec![name.to_owned()]).unwrap();
        Pair {
            cert: c.cert.pem(),
            key: c.signing_key.serialize_pem(),
        }
    }

    fn leaf(k: &CertifiedKey) -> Vec<u8> {
        k.cert[0].to_vec()
    }

    /// Replaces a file by rename, as the kubelet does for Secret volumes: the new file has a
    /// new inode, so the change is seen even within one mtime tick.
    fn replace(dir: &Path, name: &str, text: &str) {
        let tmp = dir.join(format!(".{name}.tmp"));
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(&tmp, dir.join(name)).unwrap();
    }

    fn write(dir: &Path, p: &Pair) {
        replace(dir, "tls.crt", &p.cert);
        replace(dir, "tls.key", &p.key);
    }

    fn resolver(dir: &Path) -> Result<ReloadingCert, TlsError> {
        ReloadingCert::load(
            &dir.join("tls.crt"),
            &dir.join("tls.key"),
            Counter::default(),
            Counter::default(),
        )
    }

    #[test]
    fn rotation_is_picked_up_and_a_half_rotation_keeps_the_old_pair() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (generate("a.example"), generate("b.example"));
        write(dir.path(), &a);
        let r = resolver(dir.path()).unwrap();
        let first = leaf(&r.current());
        assert_eq!(first, leaf(&r.current()), "unchanged files, same pair");

        // Only the certificate rotated: its key does not match, keep serving A.
        replace(dir.path(), "tls.crt", &b.cert);
        assert_eq!(leaf(&r.current()), first);
        assert_eq!(r.reload_failures.get(), 1);

        // The key follows: now B is served.
        replace(dir.path(), "tls.key", &b.key);
        let second = leaf(&r.current());
        assert_ne!(second, first);
        assert_eq!(r.reloads.get(), 1);

        // Files vanish (volume remount): keep B.
        std::fs::remove_file(dir.path().join("tls.key")).unwrap();
        assert_eq!(leaf(&r.current()), second);
    }

    #[test]
    fn a_bad_first_load_is_an_error_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let err = resolver(dir.path()).unwrap_err().to_string();
        assert!(
            err.starts_with("reading ") && err.contains("tls.crt"),
            "{err}"
        );

        std::fs::write(dir.path().join("tls.crt"), "garbage").unwrap();
        std::fs::write(dir.path().join("tls.key"), "garbage").unwrap();
        let err = resolver(dir.path()).unwrap_err().to_string();
        assert!(err.contains("no PEM CERTIFICATE block"), "{err}");

        let a = generate("a.example");
        std::fs::write(dir.path().join("tls.crt"), &a.cert).unwrap();
        let err = resolver(dir.path()).unwrap_err().to_string();
        assert!(err.contains("no PEM private key"), "{err}");

        std::fs::write(dir.path().join("tls.key"), generate("b.example").key).unwrap();
        let err = resolver(dir.path()).unwrap_err().to_string();
        assert!(err.contains("key unusable"), "{err}");
    }
}
