//! The component files on disk, named by digest and shared by every
//! function (of any tenant) that deploys the same bytes.
//!
//! A file is written and synced, with its directory, before any database
//! row refers to it, and removed only after the last row that referred to
//! it is gone; a crash between the two leaves an orphan file, which the
//! next start removes. So every row's file exists, even after SIGKILL or a
//! power cut.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

/// The directory of component files and the lock that orders changes to
/// it with the rows that refer to its files.
#[derive(Debug)]
pub struct ComponentStore {
    dir: PathBuf,
    lock: Mutex<()>,
}

/// Held while a deploy or delete changes files and rows together.
pub struct StoreGuard<'a>(#[allow(dead_code)] MutexGuard<'a, ()>);

impl ComponentStore {
    /// The store in `dir`, created if needed.
    pub fn open(dir: PathBuf) -> std::io::Result<Self> {
        std::fs::create_dir_all(&dir)?;
        Ok(Self {
            dir,
            lock: Mutex::new(()),
        })
    }

    /// Orders this change after every other deploy and delete in flight.
    pub fn lock(&self) -> StoreGuard<'_> {
        StoreGuard(self.lock.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// The file of `digest`.
    pub fn path(&self, digest: &str) -> PathBuf {
        self.dir.join(format!("{digest}.wasm"))
    }

    /// Stores `bytes` as `digest`'s file, durably, unless it is there.
    pub fn put(&self, _guard: &StoreGuard<'_>, digest: &str, bytes: &[u8]) -> std::io::Result<()> {
        let path = self.path(digest);
        if path.exists() {
            return Ok(());
        }
        write_durably(&self.dir, &path, bytes)
    }

    /// Removes `digest`'s file (no row refers to it any more).
    pub fn remove(&self, _guard: &StoreGuard<'_>, digest: &str) {
        if let Err(e) = std::fs::remove_file(self.path(digest)) {
            tracing::warn!(digest, "removing an unused component failed: {e}");
        }
    }

    /// Removes files no row refers to (`in_use` says which digests rows
    /// refer to) and temporary files a crash left behind; returns how many.
    pub fn collect_orphans(&self, in_use: impl Fn(&str) -> bool) -> std::io::Result<usize> {
        let _guard = self.lock();
        let mut removed = 0;
        for entry in std::fs::read_dir(&self.dir)? {
            let path = entry?.path();
            let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
                continue;
            };
            let orphan = match name.strip_suffix(".wasm") {
                Some(digest) => !in_use(digest),
                None => name.contains(".tmp"),
            };
            if orphan {
                std::fs::remove_file(&path)?;
                removed += 1;
            }
        }
        Ok(removed)
    }
}

/// Writes `path` through a temporary file: synced, renamed into place, and
/// the directory synced, so the name never points at partial bytes.
pub fn write_durably(dir: &Path, path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let tmp = path.with_extension(format!("tmp{}-{n}", std::process::id()));
    let written = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written?;
    std::fs::File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn orphans_and_temporary_files_are_collected_and_used_files_kept() {
        let dir = tempfile::tempdir().unwrap();
        let store = ComponentStore::open(dir.path().to_owned()).unwrap();
        {
            let g = store.lock();
            store.put(&g, "aa", b"one").unwrap();
            store.put(&g, "bb", b"two").unwrap();
        }
        std::fs::write(dir.path().join("cc.tmp77-0"), b"torn").unwrap();
        assert_eq!(store.collect_orphans(|d| d == "aa").unwrap(), 2);
        let mut left: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        left.sort();
        assert_eq!(left, ["aa.wasm"]);
        assert_eq!(std::fs::read(store.path("aa")).unwrap(), b"one");
    }
}
