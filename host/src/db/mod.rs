//! The control plane's database: tenants, API keys (hashes only),
//! functions and tenant policies. SQLite in the data directory by default;
//! PostgreSQL (`--database postgres://...`) for nodes that share one. Both
//! take their schema from one migration tool (refinery, `host/migrations/`).

mod postgres;
mod sqlite;

use std::ops::Deref;
use std::path::Path;

/// Errors from the control-plane database.
#[derive(Debug, thiserror::Error)]
pub enum DbError {
    /// A tenant with this name already exists.
    #[error("tenant `{0}` already exists")]
    TenantExists(String),
    /// SQLite failed.
    #[error("database error: {0}")]
    Sqlite(#[from] rusqlite::Error),
    /// PostgreSQL failed.
    #[error("database error: {0}")]
    Postgres(#[from] ::postgres::Error),
    /// Bringing the schema up to date failed.
    #[error("migrating the database: {0}")]
    Migration(String),
    /// The PostgreSQL connection's thread is gone.
    #[error("the database connection closed")]
    Closed,
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

/// What the control plane keeps, whichever database keeps it.
pub trait Store: Send + Sync {
    /// Creates a tenant and its first API key (given as id and hash).
    fn create_tenant(&self, name: &str, key_id: &str, key_hash: &[u8]) -> Result<(), DbError>;
    /// The tenant and stored hash of API key `key_id`.
    fn api_key(&self, key_id: &str) -> Result<Option<(String, Vec<u8>)>, DbError>;
    /// Creates or replaces a function in one transaction; returns the
    /// digest it had before if no row refers to that any more (its file
    /// may go).
    fn upsert_function(&self, row: &FunctionRow) -> Result<Option<String>, DbError>;
    /// One tenant's function.
    fn function(&self, tenant: &str, name: &str) -> Result<Option<FunctionRow>, DbError>;
    /// Functions of one tenant, or of all tenants when `tenant` is `None`,
    /// ordered by tenant and name.
    fn functions(&self, tenant: Option<&str>) -> Result<Vec<FunctionRow>, DbError>;
    /// Deletes a function in one transaction: `None` if it did not exist,
    /// else its row and whether any row still refers to its digest.
    fn delete_function(
        &self,
        tenant: &str,
        name: &str,
    ) -> Result<Option<(FunctionRow, bool)>, DbError>;
    /// Every digest some function refers to.
    fn digests(&self) -> Result<std::collections::HashSet<String>, DbError>;
    /// Whether tenant `name` exists.
    fn tenant_exists(&self, name: &str) -> Result<bool, DbError>;
    /// Stores `tenant`'s policy (a JSON document).
    fn set_policy(&self, tenant: &str, policy_json: &str) -> Result<(), DbError>;
    /// Every stored policy, as (tenant, JSON).
    fn policies(&self) -> Result<Vec<(String, String)>, DbError>;
}

/// The database handle.
pub struct Db(Box<dyn Store>);

impl Db {
    /// Opens (creating if needed) the SQLite database at `path`.
    pub fn open(path: &Path) -> Result<Self, DbError> {
        Ok(Self(Box::new(sqlite::Sqlite::open(path)?)))
    }

    /// Connects to the PostgreSQL database at `url`
    /// (`postgres://user@host:port/db`), bringing its schema up to date.
    pub fn connect(url: &str) -> Result<Self, DbError> {
        Ok(Self(Box::new(postgres::Postgres::connect(url)?)))
    }

    /// The current Unix time in seconds, as stored in `created` columns.
    pub fn now() -> i64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs() as i64)
            .unwrap_or(0)
    }
}

impl Deref for Db {
    type Target = dyn Store;

    fn deref(&self) -> &Self::Target {
        &*self.0
    }
}
