//! The webhook's serving certificate judged as the API server judges it: does it chain to the
//! `caBundle` of the ValidatingWebhookConfiguration, is it valid for the Service's DNS name
//! (`<service>.<namespace>.svc`), and for how long (`notAfter`).
//!
//! The chain and name are checked by rustls' WebPKI verifier (the CLI's TLS stack already);
//! the validity period is read from the certificate's DER by the few lines of [`validity`],
//! which walk only as far as `tbsCertificate.validity`, rather than linking an X.509 parser
//! for two timestamps.

use std::sync::Arc;

use rustls::RootCertStore;
use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::ServerCertVerifier;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};

/// What the certificate is worth.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CertVerdict {
    /// `None`: it chains to the CA bundle and names the Service; `Some`: why not.
    pub problem: Option<CertProblem>,
    /// `notAfter`, Unix seconds, when readable.
    pub not_after: Option<i64>,
}

/// Why the API server would refuse the certificate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CertProblem {
    /// What kind of fault: each has its own fix.
    pub kind: CertFault,
    /// The refusal in words, with the verifier's error.
    pub text: String,
}

/// The kinds of [`CertProblem`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CertFault {
    /// Past its `notAfter` (or before its `notBefore`): a new certificate is needed.
    Expired,
    /// Valid, but not for the Service's DNS name.
    WrongName,
    /// Not signed by the caBundle's CA, or the caBundle or certificate cannot be used.
    Untrusted,
}

/// Judges the PEM certificate chain `serving` (leaf first) against the PEM `ca_bundle` for
/// `dns_name` at Unix time `now`.
pub fn judge(serving: &[u8], ca_bundle: &[u8], dns_name: &str, now: i64) -> CertVerdict {
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(serving)
        .filter_map(Result::ok)
        .collect();
    let Some((leaf, intermediates)) = chain.split_first() else {
        return CertVerdict {
            problem: Some(CertProblem {
                kind: CertFault::Untrusted,
                text: "the serving certificate is not PEM (no CERTIFICATE block)".into(),
            }),
            not_after: None,
        };
    };
    let not_after = validity(leaf).map(|(_, after)| after);
    let problem = verify(leaf, intermediates, ca_bundle, dns_name, now).err();
    CertVerdict { problem, not_after }
}

fn verify(
    leaf: &CertificateDer<'static>,
    intermediates: &[CertificateDer<'static>],
    ca_bundle: &[u8],
    dns_name: &str,
    now: i64,
) -> Result<(), CertProblem> {
    let untrusted = |text: String| CertProblem {
        kind: CertFault::Untrusted,
        text,
    };
    let mut roots = RootCertStore::empty();
    for ca in CertificateDer::pem_slice_iter(ca_bundle).filter_map(Result::ok) {
        roots.add(ca).map_err(|e| {
            untrusted(format!(
                "the caBundle holds a certificate that is not a CA: {e}"
            ))
        })?;
    }
    if roots.is_empty() {
        return Err(untrusted("the caBundle holds no PEM certificate".into()));
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let verifier = WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider)
        .build()
        .map_err(|e| untrusted(format!("cannot use the caBundle: {e}")))?;
    let name = ServerName::try_from(dns_name.to_owned()).map_err(|e| CertProblem {
        kind: CertFault::WrongName,
        text: format!("{dns_name:?} is not a DNS name: {e}"),
    })?;
    let now = UnixTime::since_unix_epoch(std::time::Duration::from_secs(
        u64::try_from(now).unwrap_or(0),
    ));
    verifier
        .verify_server_cert(leaf, intermediates, &name, &[], now)
        .map(|_| ())
        .map_err(|e| {
            use rustls::CertificateError as C;
            let (kind, why) = match &e {
                rustls::Error::InvalidCertificate(C::Expired | C::ExpiredContext { .. }) => {
                    (CertFault::Expired, "it has expired".to_owned())
                }
                rustls::Error::InvalidCertificate(
                    C::NotValidYet | C::NotValidYetContext { .. },
                ) => (CertFault::Expired, "it is not valid yet".to_owned()),
                rustls::Error::InvalidCertificate(
                    C::NotValidForName | C::NotValidForNameContext { .. },
                ) => (CertFault::WrongName, format!("it does not name {dns_name}")),
                rustls::Error::InvalidCertificate(C::UnknownIssuer | C::BadSignature) => (
                    CertFault::Untrusted,
                    "it is not signed by the caBundle's CA".to_owned(),
                ),
                other => (CertFault::Untrusted, other.to_string()),
            };
            CertProblem {
                kind,
                text: format!("the API server would refuse the serving certificate: {why} ({e:?})"),
            }
        })
}

/// `(notBefore, notAfter)` of a DER certificate, in Unix seconds.
pub fn validity(der: &[u8]) -> Option<(i64, i64)> {
    let (cert, _) = element(der, 0x30)?;
    let (mut tbs, _) = element(cert, 0x30)?;
    // [0] EXPLICIT version, optional.
    if tbs.first() == Some(&0xa0) {
        tbs = element(tbs, 0xa0)?.1;
    }
    let rest = element(tbs, 0x02)?.1; // serialNumber
    let rest = element(rest, 0x30)?.1; // signature algorithm
    let rest = element(rest, 0x30)?.1; // issuer
    let (validity, _) = element(rest, 0x30)?;
    let (before, rest) = time(validity)?;
    let (after, _) = time(rest)?;
    Some((before, after))
}

/// The content of the DER element of `tag` at the start of `input`, and what follows it.
fn element(input: &[u8], tag: u8) -> Option<(&[u8], &[u8])> {
    let (&t, rest) = input.split_first()?;
    if t != tag {
        return None;
    }
    let (&first, rest) = rest.split_first()?;
    let (len, rest) = if first < 0x80 {
        (usize::from(first), rest)
    } else {
        let n = usize::from(first & 0x7f);
        if n == 0 || n > 4 || rest.len() < n {
            return None;
        }
        let len = rest[..n]
            .iter()
            .fold(0usize, |acc, &b| (acc << 8) | usize::from(b));
        (len, &rest[n..])
    };
    (rest.len() >= len).then(|| rest.split_at(len))
}

/// A UTCTime (`YYMMDDHHMMSSZ`) or GeneralizedTime (`YYYYMMDDHHMMSSZ`) in Unix seconds.
fn time(input: &[u8]) -> Option<(i64, &[u8])> {
    let tag = *input.first()?;
    let (content, rest) = element(input, tag)?;
    let text = std::str::from_utf8(content).ok()?.strip_suffix('Z')?;
    let (year, text) = match tag {
        0x17 => {
            let yy: i64 = text.get(..2)?.parse().ok()?;
            (if yy < 50 { 2000 + yy } else { 1900 + yy }, &text[2..])
        }
        0x18 => (text.get(..4)?.parse().ok()?, &text[4..]),
        _ => return None,
    };
    if text.len() != 10 || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let field = |i: usize| text[i..i + 2].parse::<i64>().ok();
    let (month, day) = (field(0)?, field(2)?);
    let (h, m, s) = (field(4)?, field(6)?, field(8)?);
    let days = days_from_civil(year, month, day);
    Some((days * 86_400 + h * 3600 + m * 60 + s, rest))
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's algorithm).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};

    /// A CA and a serving certificate for `name` signed by it, valid between the two dates
    /// (year, month, day): `(ca_pem, serving_pem)`.
    pub(crate) fn ca_and_serving(
        name: &str,
        not_before: (i32, u8, u8),
        not_after: (i32, u8, u8),
    ) -> (String, String) {
        let ca_key = KeyPair::generate().unwrap();
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params.not_before = rcgen::date_time_ymd(2020, 1, 1);
        ca_params.not_after = rcgen::date_time_ymd(2090, 1, 1);
        let ca_cert = ca_params.self_signed(&ca_key).unwrap();
        let issuer = Issuer::new(ca_params, ca_key);
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(vec![name.to_owned()]).unwrap();
        params.not_before = rcgen::date_time_ymd(not_before.0, not_before.1, not_before.2);
        params.not_after = rcgen::date_time_ymd(not_after.0, not_after.1, not_after.2);
        let cert = params.signed_by(&key, &issuer).unwrap();
        (ca_cert.pem(), cert.pem())
    }

    /// 2026-06-01T00:00:00Z.
    pub(crate) const JUNE_2026: i64 = 1_780_272_000;

    #[test]
    fn dates_convert_to_unix_seconds() {
        assert_eq!(days_from_civil(1970, 1, 1), 0);
        assert_eq!(days_from_civil(2026, 6, 1) * 86_400, JUNE_2026);
        assert_eq!(days_from_civil(2000, 3, 1), 11_017);
    }

    #[test]
    fn validity_is_read_from_the_der() {
        let (_, serving) = ca_and_serving("svc.ns.svc", (2026, 1, 1), (2026, 7, 1));
        let der = CertificateDer::from_pem_slice(serving.as_bytes()).unwrap();
        let (before, after) = validity(&der).unwrap();
        assert_eq!(before, days_from_civil(2026, 1, 1) * 86_400);
        assert_eq!(after, days_from_civil(2026, 7, 1) * 86_400);
        assert_eq!(validity(b"\x30\x03\x02\x01\x00"), None);
    }

    #[test]
    fn a_certificate_of_the_bundle_for_the_service_passes() {
        let (ca, serving) = ca_and_serving("svc.ns.svc", (2026, 1, 1), (2026, 7, 1));
        let v = judge(serving.as_bytes(), ca.as_bytes(), "svc.ns.svc", JUNE_2026);
        assert_eq!(v.problem, None);
        assert_eq!(v.not_after, Some(days_from_civil(2026, 7, 1) * 86_400));
    }

    #[test]
    fn expired_wrong_name_and_wrong_ca_are_refused_each_with_its_kind() {
        let svc = "svc.ns.svc";
        let (_, other_ca_serving) = ca_and_serving(svc, (2026, 1, 1), (2026, 7, 1));
        // (certificate name, validity, signed by the bundle's CA, kind, text)
        let cases = [
            (
                svc,
                ((2025, 1, 1), (2026, 1, 1)),
                true,
                CertFault::Expired,
                "it has expired",
            ),
            (
                svc,
                ((2026, 7, 1), (2027, 1, 1)),
                true,
                CertFault::Expired,
                "not valid yet",
            ),
            (
                "other.ns.svc",
                ((2026, 1, 1), (2026, 7, 1)),
                true,
                CertFault::WrongName,
                "does not name svc.ns.svc",
            ),
            (
                svc,
                ((2026, 1, 1), (2026, 7, 1)),
                false,
                CertFault::Untrusted,
                "not signed by the caBundle's CA",
            ),
        ];
        for (name, (from, to), same_ca, kind, text) in cases {
            let (ca, serving) = ca_and_serving(name, from, to);
            let serving = if same_ca {
                serving
            } else {
                other_ca_serving.clone()
            };
            let p = judge(serving.as_bytes(), ca.as_bytes(), svc, JUNE_2026)
                .problem
                .expect("a problem");
            assert_eq!(p.kind, kind, "{p:?}");
            assert!(p.text.contains(text), "{p:?}");
        }
        let (ca, _) = ca_and_serving(svc, (2026, 1, 1), (2026, 7, 1));
        let p = judge(b"not pem", ca.as_bytes(), svc, JUNE_2026)
            .problem
            .expect("a problem");
        assert_eq!(p.kind, CertFault::Untrusted);
        assert!(p.text.contains("not PEM"), "{p:?}");
    }
}
