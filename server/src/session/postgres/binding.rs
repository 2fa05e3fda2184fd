//! Channel binding for SCRAM-SHA-256-PLUS: RFC 5929's
//! `tls-server-end-point` of the server's certificate, computed as
//! PostgreSQL computes it on its side.

/// RFC 5929's `tls-server-end-point` of a server certificate (DER): its
/// hash by its signature's hash function, SHA-256 for MD5 and SHA-1, as
/// PostgreSQL computes it on its side. None for a signature with no such
/// hash (Ed25519, RSASSA-PSS) or one ring lacks (SHA-224): no binding is
/// offered then, and `channel_binding=require` refuses the connection.
pub(super) fn server_end_point(certificate: &[u8]) -> Option<Vec<u8>> {
    const RSA: [u8; 8] = [0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x01];
    const ECDSA_SHA1: [u8; 7] = [0x2a, 0x86, 0x48, 0xce, 0x3d, 0x04, 0x01];
    const ECDSA_SHA2: [u8; 7] = [0x2a, 0x86, 0x48, 0xce, 0x3d, 0x04, 0x03];
    use ring::digest::{SHA256, SHA384, SHA512};
    let oid = signature_algorithm(certificate)?;
    let hash = match oid {
        [rsa @ .., n] if *rsa == RSA => match n {
            0x04 | 0x05 | 0x0b => &SHA256, // md5, sha1, sha256 WithRSAEncryption
            0x0c => &SHA384,
            0x0d => &SHA512,
            _ => return None,
        },
        _ if oid == ECDSA_SHA1 => &SHA256,
        [ecdsa @ .., n] if *ecdsa == ECDSA_SHA2 => match n {
            0x02 => &SHA256,
            0x03 => &SHA384,
            0x04 => &SHA512,
            _ => return None,
        },
        _ => return None,
    };
    Some(ring::digest::digest(hash, certificate).as_ref().to_vec())
}

/// The OID of a certificate's `signatureAlgorithm` (the outer one, after
/// the signed part), read from its DER without trusting any length.
fn signature_algorithm(certificate: &[u8]) -> Option<&[u8]> {
    let (0x30, certificate, _) = der_element(certificate)? else { return None };
    let (0x30, _signed, rest) = der_element(certificate)? else { return None };
    let (0x30, algorithm, _) = der_element(rest)? else { return None };
    let (0x06, oid, _) = der_element(algorithm)? else { return None };
    Some(oid)
}

/// A DER element at the start of `der`: its tag, its content, and what
/// follows it.
fn der_element(der: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, rest) = der.split_first()?;
    let (&first, rest) = rest.split_first()?;
    let (len, rest) = if first < 0x80 {
        (usize::from(first), rest)
    } else {
        let n = usize::from(first & 0x7f);
        if n == 0 || n > 4 || rest.len() < n {
            return None;
        }
        let (len, rest) = rest.split_at(n);
        (len.iter().fold(0, |acc, b| (acc << 8) | usize::from(*b)), rest)
    };
    (rest.len() >= len).then(|| (tag, &rest[..len], &rest[len..]))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn self_signed(algorithm: &'static rcgen::SignatureAlgorithm) -> Vec<u8> {
        let key = rcgen::KeyPair::generate_for(algorithm).unwrap();
        let params = rcgen::CertificateParams::new(vec!["db.example".to_owned()]).unwrap();
        params.self_signed(&key).unwrap().der().to_vec()
    }

    /// The end point is the certificate's hash by its signature's hash
    /// function, as PostgreSQL computes it.
    #[test]
    fn the_end_point_is_hashed_as_the_certificate_is_signed() {
        use ring::digest::{SHA256, SHA384, digest};
        for (algorithm, hash) in [(&rcgen::PKCS_ECDSA_P256_SHA256, &SHA256), (&rcgen::PKCS_ECDSA_P384_SHA384, &SHA384)]
        {
            let der = self_signed(algorithm);
            assert_eq!(server_end_point(&der), Some(digest(hash, &der).as_ref().to_vec()), "{algorithm:?}");
        }
        // Ed25519 has no hash of its own: no binding.
        assert_eq!(server_end_point(&self_signed(&rcgen::PKCS_ED25519)), None);
    }

    /// A certificate cut short or garbled anywhere yields no end point,
    /// and no panic.
    #[test]
    fn a_broken_certificate_has_no_end_point() {
        let der = self_signed(&rcgen::PKCS_ECDSA_P256_SHA256);
        for n in 0..der.len() {
            assert_eq!(server_end_point(&der[..n]), None, "cut at {n}");
        }
        for i in 0..der.len() {
            let mut garbled = der.clone();
            garbled[i] ^= 0xff;
            let _ = server_end_point(&garbled);
        }
        assert_eq!(server_end_point(&[0x30, 0x84, 0xff, 0xff, 0xff, 0xff]), None);
        assert_eq!(server_end_point(&[0x30, 0x80]), None);
    }
}
