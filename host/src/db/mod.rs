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
    /// A function was to refer to a component whose bytes another node's
    /// delete removed meanwhile: store them again, then retry.
    #[error("component {0} was removed meanwhile by a delete on another node; deploy again")]
    ComponentGone(String),
    /// The tenant has as many functions as it may; a new name is refused.
    #[error(
        "tenant `{tenant}` already has {cap} functions deployed, its cap; delete one or ask the \
         operator to raise the tenant policy's `max_functions`"
    )]
    FunctionsExceeded {
        /// The tenant.
        tenant: String,
        /// Its cap on functions.
        cap: u32,
    },
}

/// Whether a tenant with `deployed` functions may add one under its cap
/// of `max_functions` ([`DbError::FunctionsExceeded`] if not).
pub fn within_cap(tenant: &str, deployed: i64, max_functions: u32) -> Result<(), DbError> {
    if deployed >= i64::from(max_functions) {
        return Err(DbError::FunctionsExceeded {
            tenant: tenant.to_owned(),
            cap: max_functions,
        });
    }
    Ok(())
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

/// A change one node made to the control plane that the others must see.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// A function was deployed, replaced or deleted.
    Function {
        /// Its tenant.
        tenant: String,
        /// Its name.
        name: String,
    },
    /// A tenant's policy was set.
    Policy {
        /// The tenant.
        tenant: String,
    },
    /// Changes may have been missed (the listener connected again):
    /// reload everything.
    Resync,
}

impl Change {
    /// The change as a notification's payload (names hold no tabs).
    pub fn encode(&self) -> String {
        match self {
            Change::Function { tenant, name } => format!("f\t{tenant}\t{name}"),
            Change::Policy { tenant } => format!("p\t{tenant}"),
            Change::Resync => "r".into(),
        }
    }

    /// The change a payload names, if it names one.
    pub fn decode(payload: &str) -> Option<Self> {
        let mut parts = payload.split('\t');
        let change = match (parts.next()?, parts.next(), parts.next()) {
            ("f", Some(tenant), Some(name)) => Change::Function {
                tenant: tenant.into(),
                name: name.into(),
            },
            ("p", Some(tenant), None) => Change::Policy {
                tenant: tenant.into(),
            },
            ("r", None, None) => Change::Resync,
            _ => return None,
        };
        Some(change)
    }
}

/// Changes other nodes publish, as they arrive; dropping it stops the
/// listening.
pub struct Subscription {
    /// The changes.
    pub changes: std::sync::mpsc::Receiver<Change>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Drop for Subscription {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// What the control plane keeps, whichever database keeps it.
pub trait Store: Send + Sync {
    /// Creates a tenant and its first API key (given as id and hash).
    fn create_tenant(&self, name: &str, key_id: &str, key_hash: &[u8]) -> Result<(), DbError>;
    /// The tenant and stored hash of API key `key_id`.
    fn api_key(&self, key_id: &str) -> Result<Option<(String, Vec<u8>)>, DbError>;
    /// Creates or replaces a function in one transaction; returns the
    /// digest it had before if no row refers to that any more (its file
    /// may go). Where the database keeps components' bytes, fails with
    /// [`DbError::ComponentGone`] if the row's are not there, and holds
    /// them against [`Store::forget_component`] until it commits. A new
    /// name is refused with [`DbError::FunctionsExceeded`] when the tenant
    /// already has `max_functions`.
    fn upsert_function(
        &self,
        row: &FunctionRow,
        max_functions: u32,
    ) -> Result<Option<String>, DbError>;
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
    /// Keeps a component's bytes where every node can fetch them. A
    /// database of one node keeps none: its data dir has them.
    fn put_component(&self, _digest: &str, _bytes: &[u8]) -> Result<(), DbError> {
        Ok(())
    }
    /// A component's bytes, if the database keeps them.
    fn component(&self, _digest: &str) -> Result<Option<Vec<u8>>, DbError> {
        Ok(None)
    }
    /// Forgets a component's bytes unless a function still refers to them.
    fn forget_component(&self, _digest: &str) -> Result<(), DbError> {
        Ok(())
    }
    /// Tells the other nodes about `change` (no one else to tell: nothing).
    fn publish(&self, _change: &Change) -> Result<(), DbError> {
        Ok(())
    }
    /// The changes other nodes publish, if the database carries them.
    fn subscribe(&self) -> Option<Subscription> {
        None
    }
    /// Whether other nodes share this database (and so its quotas).
    fn shared(&self) -> bool {
        false
    }
    /// Records what `node`'s tenants hold of their quotas and returns
    /// what the other live nodes' tenants hold, summed by tenant.
    fn share_load(&self, _node: &str, _load: &[TenantLoad]) -> Result<Vec<TenantLoad>, DbError> {
        Ok(Vec::new())
    }
}

/// What a tenant holds of its quotas on one node, or on several.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TenantLoad {
    /// The tenant.
    pub tenant: String,
    /// Tokens charged in the last minute plus tokens reserved.
    pub tokens: u64,
    /// Model calls in flight.
    pub inflight: u32,
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

#[cfg(test)]
mod tests {
    use super::Change;

    #[test]
    fn changes_survive_their_payloads_and_junk_is_refused() {
        for c in [
            Change::Function {
                tenant: "acme".into(),
                name: "f-1".into(),
            },
            Change::Policy {
                tenant: "acme".into(),
            },
            Change::Resync,
        ] {
            assert_eq!(Change::decode(&c.encode()), Some(c));
        }
        for junk in ["", "f\tacme", "p", "x\ty", "r\textra"] {
            assert_eq!(Change::decode(junk), None, "{junk:?}");
        }
    }
}
