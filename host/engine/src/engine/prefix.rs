//! Prefix-cache keys. Every full page of a sequence is named by a hash that
//! covers a salt, the hash of the page before it and the page's own tokens,
//! so equal hashes mean equal whole prefixes under the same salt.
//!
//! The salt is derived by the server from the tenant and the model (never
//! supplied by a client or guest), so two tenants sending identical prompts
//! get disjoint hashes and can never share, or probe, each other's pages.

use sha2::{Digest, Sha256};

/// The name of one full page of tokens in the prefix cache.
pub type PageHash = u128;

/// A per-(tenant, model) secret mixed into every page hash.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Salt([u8; 32]);

impl std::fmt::Debug for Salt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The salt is a secret: never print it.
        f.write_str("Salt(..)")
    }
}

impl Salt {
    /// The salt of `tenant` on `model`, keyed by the server's `secret`.
    pub fn derive(secret: &[u8; 32], model: &str, tenant: &str) -> Self {
        let mut h = Sha256::new();
        h.update(b"kiln prefix salt v1");
        h.update(secret);
        // Length-prefixed, so ("ab", "c") and ("a", "bc") differ.
        for part in [model, tenant] {
            h.update((part.len() as u64).to_le_bytes());
            h.update(part.as_bytes());
        }
        Self(h.finalize().into())
    }

    /// A salt from raw bytes (tests and benchmarks).
    pub fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }
}

/// The hash of the page holding `tokens`, after the page hashed `prev`.
pub fn page_hash(salt: &Salt, prev: Option<PageHash>, tokens: &[u32]) -> PageHash {
    let mut h = Sha256::new();
    h.update(salt.0);
    match prev {
        Some(p) => {
            h.update([1]);
            h.update(p.to_le_bytes());
        }
        None => h.update([0]),
    }
    for t in tokens {
        h.update(t.to_le_bytes());
    }
    let digest = h.finalize();
    let mut first = [0u8; 16];
    first.copy_from_slice(&digest[..16]);
    PageHash::from_le_bytes(first)
}

/// Extends `hashes` so that it names every full page of `tokens`.
pub fn extend_hashes(hashes: &mut Vec<PageHash>, salt: &Salt, tokens: &[u32], page_size: usize) {
    let full = tokens.len() / page_size;
    for i in hashes.len()..full {
        let prev = i.checked_sub(1).map(|j| hashes[j]);
        hashes.push(page_hash(
            salt,
            prev,
            &tokens[i * page_size..(i + 1) * page_size],
        ));
    }
}

/// The hashes of every full page of `tokens`.
pub fn page_hashes(salt: &Salt, tokens: &[u32], page_size: usize) -> Vec<PageHash> {
    let mut v = Vec::with_capacity(tokens.len() / page_size);
    extend_hashes(&mut v, salt, tokens, page_size);
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_chain_over_the_whole_prefix_and_depend_on_the_salt() {
        let secret = [7u8; 32];
        let a = Salt::derive(&secret, "m", "tenant-a");
        let b = Salt::derive(&secret, "m", "tenant-b");
        let tokens: Vec<u32> = (0..40).collect();
        let ha = page_hashes(&a, &tokens, 16);
        assert_eq!(ha.len(), 2, "only full pages are named");
        assert_eq!(ha, page_hashes(&a, &tokens[..33], 16));
        let hb = page_hashes(&b, &tokens, 16);
        assert!(ha.iter().all(|h| !hb.contains(h)), "salts separate tenants");
        // Same second page after a different first page: a different hash.
        let mut other = tokens.clone();
        other[0] = 99;
        let ho = page_hashes(&a, &other, 16);
        assert_ne!(ha[1], ho[1]);
        assert_ne!(
            Salt::derive(&secret, "ab", "c"),
            Salt::derive(&secret, "a", "bc")
        );
    }
}
