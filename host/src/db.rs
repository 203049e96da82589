//! The control plane's SQLite database: tenants, API keys (hashes only),
//! functions and tenant policies.

use std::path::Path;
use std::sync::Mutex;

use rusqlite::{Connection, OptionalExtension, params};

/// Errors from the control-plane database.
#[derive(Debug, thiserror::Error)]
pub enum DbError {
    /// A tenant with this name already exists.
    #[error("tenant `{0}` already exists")]
    TenantExists(String),
    /// SQLite failed.
    #[error("database error: {0}")]
    Sqlite(#[from] rusqlite::Error),
}

/// A deployed function's record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FunctionRow {
    /// Owning tenant.
    pub tenant: String,
    /// Function name.
    pub name: String,
    /// SHA-256 of the component, hex.
    pub digest: String,
    /// Component size in bytes.
    pub size: u64,
    /// Unix time (seconds) of the deploy that created this version.
    pub created: i64,
}

/// The database handle. SQLite calls are short; one connection behind a
/// mutex is enough for the control plane.
pub struct Db {
    conn: Mutex<Connection>,
}

const SCHEMA: &str = "
PRAGMA journal_mode = WAL;
PRAGMA synchronous = FULL;
PRAGMA foreign_keys = ON;
CREATE TABLE IF NOT EXISTS tenants (
    name TEXT PRIMARY KEY,
    created INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS api_keys (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL REFERENCES tenants(name) ON DELETE CASCADE,
    hash BLOB NOT NULL,
    created INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS functions (
    tenant TEXT NOT NULL REFERENCES tenants(name) ON DELETE CASCADE,
    name TEXT NOT NULL,
    digest TEXT NOT NULL,
    size INTEGER NOT NULL,
    created INTEGER NOT NULL,
    PRIMARY KEY (tenant, name)
);
CREATE TABLE IF NOT EXISTS policies (
    tenant TEXT PRIMARY KEY REFERENCES tenants(name) ON DELETE CASCADE,
    policy TEXT NOT NULL
);
";

fn now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

impl Db {
    /// Opens (creating if needed) the database at `path`.
    pub fn open(path: &Path) -> Result<Self, DbError> {
        let conn = Connection::open(path)?;
        conn.execute_batch(SCHEMA)?;
        Ok(Self {
            conn: Mutex::new(conn),
        })
    }

    fn conn(&self) -> std::sync::MutexGuard<'_, Connection> {
        // A panic while holding the lock cannot leave SQLite inconsistent
        // (statements are atomic), so a poisoned lock is still usable.
        self.conn.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Creates a tenant and its first API key (given as id and hash).
    pub fn create_tenant(&self, name: &str, key_id: &str, key_hash: &[u8]) -> Result<(), DbError> {
        let mut conn = self.conn();
        let tx = conn.transaction()?;
        let inserted = tx.execute(
            "INSERT OR IGNORE INTO tenants (name, created) VALUES (?1, ?2)",
            params![name, now()],
        )?;
        if inserted == 0 {
            return Err(DbError::TenantExists(name.to_owned()));
        }
        tx.execute(
            "INSERT INTO api_keys (id, tenant, hash, created) VALUES (?1, ?2, ?3, ?4)",
            params![key_id, name, key_hash, now()],
        )?;
        tx.commit()?;
        Ok(())
    }

    /// The tenant and stored hash of API key `key_id`.
    pub fn api_key(&self, key_id: &str) -> Result<Option<(String, Vec<u8>)>, DbError> {
        Ok(self
            .conn()
            .query_row(
                "SELECT tenant, hash FROM api_keys WHERE id = ?1",
                params![key_id],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .optional()?)
    }

    /// Creates or replaces a function in one transaction; returns the
    /// digest it had before if no row refers to that any more (its file
    /// may go).
    pub fn upsert_function(&self, row: &FunctionRow) -> Result<Option<String>, DbError> {
        let mut conn = self.conn();
        let tx = conn.transaction()?;
        let previous: Option<String> = tx
            .query_row(
                "SELECT digest FROM functions WHERE tenant = ?1 AND name = ?2",
                params![row.tenant, row.name],
                |r| r.get(0),
            )
            .optional()?;
        tx.execute(
            "INSERT INTO functions (tenant, name, digest, size, created)
             VALUES (?1, ?2, ?3, ?4, ?5)
             ON CONFLICT (tenant, name) DO UPDATE SET
               digest = excluded.digest, size = excluded.size, created = excluded.created",
            params![
                row.tenant,
                row.name,
                row.digest,
                row.size as i64,
                row.created
            ],
        )?;
        let unused = match previous {
            Some(old) if !digest_in_use(&tx, &old)? => Some(old),
            _ => None,
        };
        tx.commit()?;
        Ok(unused)
    }

    /// One tenant's function.
    pub fn function(&self, tenant: &str, name: &str) -> Result<Option<FunctionRow>, DbError> {
        Ok(self
            .conn()
            .query_row(
                "SELECT tenant, name, digest, size, created FROM functions
                 WHERE tenant = ?1 AND name = ?2",
                params![tenant, name],
                row_to_function,
            )
            .optional()?)
    }

    /// Functions of one tenant, or of all tenants when `tenant` is `None`,
    /// ordered by tenant and name.
    pub fn functions(&self, tenant: Option<&str>) -> Result<Vec<FunctionRow>, DbError> {
        let conn = self.conn();
        let mut stmt = conn.prepare(
            "SELECT tenant, name, digest, size, created FROM functions
             WHERE ?1 IS NULL OR tenant = ?1 ORDER BY tenant, name",
        )?;
        let rows = stmt.query_map(params![tenant], row_to_function)?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    /// Deletes a function in one transaction: `None` if it did not exist,
    /// else its row and whether any row still refers to its digest.
    pub fn delete_function(
        &self,
        tenant: &str,
        name: &str,
    ) -> Result<Option<(FunctionRow, bool)>, DbError> {
        let mut conn = self.conn();
        let tx = conn.transaction()?;
        let row = tx
            .query_row(
                "SELECT tenant, name, digest, size, created FROM functions
                 WHERE tenant = ?1 AND name = ?2",
                params![tenant, name],
                row_to_function,
            )
            .optional()?;
        let Some(row) = row else {
            return Ok(None);
        };
        tx.execute(
            "DELETE FROM functions WHERE tenant = ?1 AND name = ?2",
            params![tenant, name],
        )?;
        let shared = digest_in_use(&tx, &row.digest)?;
        tx.commit()?;
        Ok(Some((row, shared)))
    }

    /// Every digest some function refers to.
    pub fn digests(&self) -> Result<std::collections::HashSet<String>, DbError> {
        let conn = self.conn();
        let mut stmt = conn.prepare("SELECT DISTINCT digest FROM functions")?;
        let rows = stmt.query_map([], |r| r.get(0))?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    /// Whether tenant `name` exists.
    pub fn tenant_exists(&self, name: &str) -> Result<bool, DbError> {
        Ok(self
            .conn()
            .query_row(
                "SELECT 1 FROM tenants WHERE name = ?1",
                params![name],
                |_| Ok(()),
            )
            .optional()?
            .is_some())
    }

    /// Stores `tenant`'s policy (a JSON document).
    pub fn set_policy(&self, tenant: &str, policy_json: &str) -> Result<(), DbError> {
        self.conn().execute(
            "INSERT INTO policies (tenant, policy) VALUES (?1, ?2)
             ON CONFLICT (tenant) DO UPDATE SET policy = excluded.policy",
            params![tenant, policy_json],
        )?;
        Ok(())
    }

    /// Every stored policy, as (tenant, JSON).
    pub fn policies(&self) -> Result<Vec<(String, String)>, DbError> {
        let conn = self.conn();
        let mut stmt = conn.prepare("SELECT tenant, policy FROM policies ORDER BY tenant")?;
        let rows = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    /// The current Unix time in seconds, as stored in `created` columns.
    pub fn now() -> i64 {
        now()
    }
}

/// Whether any function refers to `digest`.
fn digest_in_use(conn: &Connection, digest: &str) -> rusqlite::Result<bool> {
    Ok(conn
        .query_row(
            "SELECT 1 FROM functions WHERE digest = ?1 LIMIT 1",
            params![digest],
            |_| Ok(()),
        )
        .optional()?
        .is_some())
}

fn row_to_function(r: &rusqlite::Row<'_>) -> rusqlite::Result<FunctionRow> {
    Ok(FunctionRow {
        tenant: r.get(0)?,
        name: r.get(1)?,
        digest: r.get(2)?,
        size: r.get::<_, i64>(3)? as u64,
        created: r.get(4)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn db() -> (tempfile::TempDir, Db) {
        let dir = tempfile::tempdir().unwrap();
        let db = Db::open(&dir.path().join("kiln.db")).unwrap();
        (dir, db)
    }

    #[test]
    fn duplicate_tenant_is_rejected() {
        let (_d, db) = db();
        db.create_tenant("acme", "k1", b"h").unwrap();
        assert!(matches!(
            db.create_tenant("acme", "k2", b"h"),
            Err(DbError::TenantExists(_))
        ));
        assert_eq!(db.api_key("k2").unwrap(), None);
    }

    #[test]
    fn redeploy_replaces_the_function_row() {
        let (_d, db) = db();
        db.create_tenant("acme", "k1", b"h").unwrap();
        let mut row = FunctionRow {
            tenant: "acme".into(),
            name: "f".into(),
            digest: "aa".into(),
            size: 1,
            created: 1,
        };
        assert_eq!(db.upsert_function(&row).unwrap(), None);
        row.digest = "bb".into();
        assert_eq!(
            db.upsert_function(&row).unwrap(),
            Some("aa".into()),
            "aa unused"
        );
        assert_eq!(db.functions(Some("acme")).unwrap(), vec![row.clone()]);
        let (gone, shared) = db.delete_function("acme", "f").unwrap().unwrap();
        assert_eq!((gone, shared), (row, false));
        assert!(db.delete_function("acme", "f").unwrap().is_none());
    }

    #[test]
    fn a_digest_shared_by_two_tenants_stays_in_use_until_both_let_go() {
        let dir = tempfile::tempdir().unwrap();
        let db = Db::open(&dir.path().join("kiln.db")).unwrap();
        let row = |tenant: &str, digest: &str| FunctionRow {
            tenant: tenant.into(),
            name: "f".into(),
            digest: digest.into(),
            size: 1,
            created: 1,
        };
        for (t, k) in [("a", "ka"), ("b", "kb")] {
            db.create_tenant(t, k, b"h").unwrap();
            db.upsert_function(&row(t, "dd")).unwrap();
        }
        assert_eq!(
            db.upsert_function(&row("a", "ee")).unwrap(),
            None,
            "b has dd"
        );
        let (_, shared) = db.delete_function("b", "f").unwrap().unwrap();
        assert!(!shared, "nobody has dd now");
        assert_eq!(db.digests().unwrap(), ["ee".to_owned()].into());
    }
}
