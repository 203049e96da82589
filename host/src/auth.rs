//! API keys and the admin token: generated at random, stored as SHA-256
//! hashes, compared in constant time.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use rand::Rng;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// A freshly minted API key: `kiln_<id>_<secret>`. Only its hash is stored.
#[derive(Debug, Clone)]
pub struct NewKey {
    /// The public lookup id.
    pub id: String,
    /// The whole key, shown to the tenant once.
    pub key: String,
    /// SHA-256 of the whole key.
    pub hash: [u8; 32],
}

/// SHA-256 of `s`.
pub fn hash(s: &str) -> [u8; 32] {
    Sha256::digest(s.as_bytes()).into()
}

/// Mints a new API key.
pub fn new_key() -> NewKey {
    let mut rng = rand::rng();
    let id: [u8; 6] = rng.random();
    let secret: [u8; 24] = rng.random();
    let id = hex::encode(id);
    let key = format!("kiln_{id}_{}", hex::encode(secret));
    NewKey {
        hash: hash(&key),
        id,
        key,
    }
}

/// The lookup id of a presented key, if it has the right shape.
pub fn key_id(key: &str) -> Option<&str> {
    let rest = key.strip_prefix("kiln_")?;
    let (id, secret) = rest.split_once('_')?;
    (id.len() == 12 && secret.len() == 48).then_some(id)
}

/// Whether `presented` hashes to `stored`, in constant time.
pub fn verify(presented: &str, stored: &[u8]) -> bool {
    hash(presented).ct_eq(stored).into()
}

/// The admin token, and whether it was generated just now (so it should be
/// shown once).
#[derive(Debug, Clone)]
pub struct AdminToken {
    /// The token.
    pub token: String,
    /// True when this start generated it.
    pub generated: bool,
}

/// Keys' stored rows (tenant, hash) by key id, so that checking a known
/// key reads no database: a request's check would otherwise wait on the
/// database (on PostgreSQL, behind every other node's statement on the one
/// connection). A key's row never changes once made (keys are neither
/// revoked nor moved), so a kept row is never stale. Only rows found are
/// kept, so a key made on another node is found on first use. Bounded:
/// past [`KEYS_KEPT`] rows it starts again empty. At most
/// [`KEY_LOOKUPS`] ids not kept are looked up at once: a flood of made-up
/// keys (each well formed, each new) is refused without the database,
/// rather than queueing every node's statements behind it.
#[derive(Default)]
pub struct KeyCache {
    rows: Mutex<HashMap<String, (String, Vec<u8>)>>,
    lookups: AtomicUsize,
}

/// The most key rows a [`KeyCache`] keeps.
pub const KEYS_KEPT: usize = 65_536;

/// The most keys not kept that a [`KeyCache`] looks up at once.
pub const KEY_LOOKUPS: usize = 16;

/// One of a [`KeyCache`]'s lookups, given back when dropped.
struct LookupSlot<'a>(&'a AtomicUsize);

impl Drop for LookupSlot<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl KeyCache {
    /// The tenant owning `key`, if it is valid: from the kept row of its
    /// id, else from `lookup` (the database), whose row is kept if found;
    /// `busy()` when [`KEY_LOOKUPS`] lookups are under way already.
    pub fn tenant<E>(
        &self,
        key: &str,
        lookup: impl FnOnce(&str) -> Result<Option<(String, Vec<u8>)>, E>,
        busy: impl FnOnce() -> E,
    ) -> Result<Option<String>, E> {
        let Some(id) = key_id(key) else {
            return Ok(None);
        };
        let kept = self.rows().get(id).cloned();
        let row = match kept {
            Some(row) => row,
            None => match self.looked_up(id, lookup, busy)? {
                Some(row) => {
                    let mut rows = self.rows();
                    if rows.len() >= KEYS_KEPT {
                        rows.clear();
                    }
                    rows.insert(id.to_owned(), row.clone());
                    row
                }
                None => return Ok(None),
            },
        };
        Ok(verify(key, &row.1).then_some(row.0))
    }

    fn looked_up<E>(
        &self,
        id: &str,
        lookup: impl FnOnce(&str) -> Result<Option<(String, Vec<u8>)>, E>,
        busy: impl FnOnce() -> E,
    ) -> Result<Option<(String, Vec<u8>)>, E> {
        let _slot = LookupSlot(&self.lookups);
        if self.lookups.fetch_add(1, Ordering::AcqRel) >= KEY_LOOKUPS {
            return Err(busy());
        }
        lookup(id)
    }

    fn rows(&self) -> std::sync::MutexGuard<'_, HashMap<String, (String, Vec<u8>)>> {
        self.rows.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Reads `<data-dir>/admin-token`, or generates it with mode 0600.
pub fn load_or_create_admin_token(data_dir: &Path) -> std::io::Result<AdminToken> {
    let path = data_dir.join("admin-token");
    match std::fs::read_to_string(&path) {
        Ok(t) if !t.trim().is_empty() => {
            return Ok(AdminToken {
                token: t.trim().to_owned(),
                generated: false,
            });
        }
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let secret: [u8; 32] = rand::rng().random();
    let token = format!("kiln_admin_{}", hex::encode(secret));
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create(true).truncate(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        opts.mode(0o600);
    }
    use std::io::Write;
    let mut f = opts.open(&path)?;
    f.write_all(token.as_bytes())?;
    f.sync_all()?;
    Ok(AdminToken {
        token,
        generated: true,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn minted_key_verifies_and_others_do_not() {
        let k = new_key();
        assert_eq!(key_id(&k.key), Some(k.id.as_str()));
        assert!(verify(&k.key, &k.hash));
        let mut wrong = k.key.clone();
        wrong.pop();
        wrong.push('x');
        assert!(!verify(&wrong, &k.hash));
        assert_eq!(key_id("kiln_short_x"), None);
    }

    #[test]
    fn a_known_key_is_checked_without_the_database_and_unknown_ids_always_ask_it() {
        let cache = KeyCache::default();
        let k = new_key();
        let row = (String::from("acme"), k.hash.to_vec());
        let asked = std::cell::Cell::new(0);
        let lookup = |id: &str| {
            asked.set(asked.get() + 1);
            Ok::<_, ()>((id == k.id).then(|| row.clone()))
        };
        assert_eq!(cache.tenant(&k.key, lookup, || ()), Ok(Some("acme".into())));
        assert_eq!(cache.tenant(&k.key, lookup, || ()), Ok(Some("acme".into())));
        assert_eq!(asked.get(), 1, "the second check read the database");
        // A wrong secret under a known id is refused from the kept row.
        let mut wrong = k.key.clone();
        wrong.pop();
        wrong.push(if k.key.ends_with('0') { '1' } else { '0' });
        assert_eq!(cache.tenant(&wrong, lookup, || ()), Ok(None));
        assert_eq!(asked.get(), 1);
        // An id not found is asked again each time: a key made meanwhile
        // (on another node) must be found.
        let other = new_key();
        assert_eq!(cache.tenant(&other.key, lookup, || ()), Ok(None));
        assert_eq!(cache.tenant(&other.key, lookup, || ()), Ok(None));
        assert_eq!(asked.get(), 3);
        // A database error is the caller's, and nothing is kept.
        assert_eq!(
            cache.tenant(&other.key, |_| Err("down"), || "busy"),
            Err("down")
        );
        // Malformed keys never reach the database.
        assert_eq!(cache.tenant("kiln_short_x", lookup, || ()), Ok(None));
        assert_eq!(asked.get(), 3);
    }

    #[test]
    fn past_its_lookups_under_way_an_unknown_key_is_refused_without_the_database() {
        let cache = std::sync::Arc::new(KeyCache::default());
        let known = new_key();
        let row = (String::from("acme"), known.hash.to_vec());
        let found = |_: &str| Ok::<_, &str>(Some(row.clone()));
        assert_eq!(
            cache.tenant(&known.key, found, || "busy"),
            Ok(Some("acme".into()))
        );
        // KEY_LOOKUPS lookups wait on a slow database.
        let (entered, release) = (
            std::sync::mpsc::channel(),
            std::sync::Barrier::new(KEY_LOOKUPS + 1),
        );
        let release = std::sync::Arc::new(release);
        let waiting: Vec<_> = (0..KEY_LOOKUPS)
            .map(|_| {
                let (cache, entered, release) = (cache.clone(), entered.0.clone(), release.clone());
                std::thread::spawn(move || {
                    let slow = |_: &str| {
                        entered.send(()).unwrap();
                        release.wait();
                        Ok::<_, &str>(None)
                    };
                    cache.tenant(&new_key().key, slow, || "busy")
                })
            })
            .collect();
        for _ in 0..KEY_LOOKUPS {
            entered.1.recv().unwrap();
        }
        let never = |_: &str| -> Result<Option<(String, Vec<u8>)>, &str> { panic!("asked") };
        assert_eq!(cache.tenant(&new_key().key, never, || "busy"), Err("busy"));
        // A kept key still passes.
        assert_eq!(
            cache.tenant(&known.key, never, || "busy"),
            Ok(Some("acme".into()))
        );
        release.wait();
        for w in waiting {
            assert_eq!(w.join().unwrap(), Ok(None));
        }
        let none = |_: &str| Ok::<_, &str>(None);
        assert_eq!(
            cache.tenant(&new_key().key, none, || "busy"),
            Ok(None),
            "slots back"
        );
    }

    #[test]
    fn admin_token_is_generated_once_with_private_mode() {
        let dir = tempfile::tempdir().unwrap();
        let first = load_or_create_admin_token(dir.path()).unwrap();
        assert!(first.generated);
        let again = load_or_create_admin_token(dir.path()).unwrap();
        assert!(!again.generated);
        assert_eq!(first.token, again.token);
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(dir.path().join("admin-token"))
                .unwrap()
                .permissions()
                .mode();
            assert_eq!(mode & 0o777, 0o600);
        }
    }
}
