//! The embedded control plane: one SQLite file in the data directory.

use std::path::Path;
use std::sync::Mutex;

use rusqlite::{Connection, OptionalExtension, params};

use super::{Db, DbError, FunctionRow, Store};

mod embedded {
    refinery::embed_migrations!("migrations/sqlite");
}

/// One connection behind a mutex: the control plane's statements are
/// short.
pub(super) struct Sqlite {
    conn: Mutex<Connection>,
}

const PRAGMAS: &str = "
PRAGMA journal_mode = WAL;
PRAGMA synchronous = FULL;
PRAGMA foreign_keys = ON;
";

fn now() -> i64 {
    Db::now()
}

impl Sqlite {
    /// Opens (creating if needed) the database at `path` and migrates it.
    pub(super) fn open(path: &Path) -> Result<Self, DbError> {
        let mut conn = Connection::open(path)?;
        conn.execute_batch(PRAGMAS)?;
        embedded::migrations::runner()
            .run(&mut conn)
            .map_err(|e| DbError::Migration(e.to_string()))?;
        Ok(Self {
            conn: Mutex::new(conn),
        })
    }

    fn conn(&self) -> std::sync::MutexGuard<'_, Connection> {
        // A panic while holding the lock cannot leave SQLite inconsistent
        // (statements are atomic), so a poisoned lock is still usable.
        self.conn.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Store for Sqlite {
    fn create_tenant(&self, name: &str, key_id: &str, key_hash: &[u8]) -> Result<(), DbError> {
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

    fn api_key(&self, key_id: &str) -> Result<Option<(String, Vec<u8>)>, DbError> {
        Ok(self
            .conn()
            .query_row(
                "SELECT tenant, hash FROM api_keys WHERE id = ?1",
                params![key_id],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .optional()?)
    }

    fn upsert_function(
        &self,
        row: &FunctionRow,
        max_functions: u32,
    ) -> Result<Option<String>, DbError> {
        let mut conn = self.conn();
        let tx = conn.transaction()?;
        let previous: Option<String> = tx
            .query_row(
                "SELECT digest FROM functions WHERE tenant = ?1 AND name = ?2",
                params![row.tenant, row.name],
                |r| r.get(0),
            )
            .optional()?;
        if previous.is_none() {
            let count = "SELECT COUNT(*) FROM functions WHERE tenant = ?1";
            let n: i64 = tx.query_row(count, params![row.tenant], |r| r.get(0))?;
            super::within_cap(&row.tenant, n, max_functions)?;
        }
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

    fn function(&self, tenant: &str, name: &str) -> Result<Option<FunctionRow>, DbError> {
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

    fn functions(&self, tenant: Option<&str>) -> Result<Vec<FunctionRow>, DbError> {
        let conn = self.conn();
        let mut stmt = conn.prepare(
            "SELECT tenant, name, digest, size, created FROM functions
             WHERE ?1 IS NULL OR tenant = ?1 ORDER BY tenant, name",
        )?;
        let rows = stmt.query_map(params![tenant], row_to_function)?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    fn delete_function(
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

    fn digests(&self) -> Result<std::collections::HashSet<String>, DbError> {
        let conn = self.conn();
        let mut stmt = conn.prepare("SELECT DISTINCT digest FROM functions")?;
        let rows = stmt.query_map([], |r| r.get(0))?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    fn tenant_exists(&self, name: &str) -> Result<bool, DbError> {
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

    fn set_policy(&self, tenant: &str, policy_json: &str) -> Result<(), DbError> {
        self.conn().execute(
            "INSERT INTO policies (tenant, policy) VALUES (?1, ?2)
             ON CONFLICT (tenant) DO UPDATE SET policy = excluded.policy",
            params![tenant, policy_json],
        )?;
        Ok(())
    }

    fn policies(&self) -> Result<Vec<(String, String)>, DbError> {
        let conn = self.conn();
        let mut stmt = conn.prepare("SELECT tenant, policy FROM policies ORDER BY tenant")?;
        let rows = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?;
        Ok(rows.collect::<Result<_, _>>()?)
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
