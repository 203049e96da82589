//! Nodes that share a control plane: each applies the changes the others
//! publish (deploys, deletes, policies) to its own routes and policies, so
//! a deploy answered on one node is served by every node within moments.

use std::sync::mpsc::RecvTimeoutError;
use std::sync::{Arc, Weak};
use std::time::Duration;

use super::{App, Route};
use crate::db::{Change, DbError, Subscription};
use crate::serving::policy::TenantPolicy;

impl App {
    /// Applies one change another node published (or this node: applying
    /// its own again changes nothing).
    pub fn apply(&self, change: &Change) -> Result<(), DbError> {
        match change {
            Change::Function { tenant, name } => {
                let row = self.db.function(tenant, name)?;
                let key = (tenant.clone(), name.clone());
                // In the order deploys take them.
                let guard = self.components.lock();
                let mut routes = self.routes_mut();
                let before = routes.get(&key).map(|r| r.row.digest.clone());
                match row {
                    Some(row) if routes.get(&key).is_some_and(|r| r.row == row) => {}
                    Some(row) => {
                        routes.insert(key, Arc::new(Route::new(row)));
                    }
                    None => {
                        if routes.remove(&key).is_some() {
                            self.metrics.forget_function(tenant, name);
                        }
                    }
                }
                // A component no route here uses any more: its file (fetched
                // when first called here) and compiled code go, as they do on
                // the node that made the change.
                if let Some(old) = before
                    && !routes.values().any(|r| r.row.digest == old)
                {
                    drop(routes);
                    if self.components.path(&old).exists() {
                        self.components.remove(&guard, &old);
                    }
                    self.runtime.forget(&old);
                }
            }
            Change::Policy { tenant } => {
                let _write = self.policy_writes.lock().unwrap_or_else(|p| p.into_inner());
                for (t, json) in self.db.policies()? {
                    if t == *tenant {
                        self.set_stored_policy(&t, &json);
                    }
                }
            }
            Change::Resync => {
                let rows = self.db.functions(None)?;
                let mut routes = self.routes_mut();
                let mut next = std::collections::HashMap::new();
                for row in rows {
                    let key = (row.tenant.clone(), row.name.clone());
                    let route = match routes.remove(&key) {
                        Some(r) if r.row == row => r,
                        _ => Arc::new(Route::new(row)),
                    };
                    next.insert(key, route);
                }
                *routes = next;
                drop(routes);
                let _write = self.policy_writes.lock().unwrap_or_else(|p| p.into_inner());
                for (t, json) in self.db.policies()? {
                    self.set_stored_policy(&t, &json);
                }
            }
        }
        Ok(())
    }

    fn set_stored_policy(&self, tenant: &str, json: &str) {
        match serde_json::from_str::<TenantPolicy>(json) {
            Ok(p) => self.ai.set_policy(tenant, p),
            Err(e) => tracing::error!("stored policy of tenant `{tenant}`: {e}"),
        }
    }

    /// Trades quota figures with the other nodes: records what this
    /// node's tenants hold, and counts what they hold elsewhere.
    pub fn share_quota_load(&self) -> Result<(), DbError> {
        let remote = self.db.share_load(&self.node_id, &self.ai.local_load())?;
        self.ai.set_remote_load(&remote);
        Ok(())
    }

    /// Whether this node shares its control plane (and quotas) with others.
    pub fn is_clustered(&self) -> bool {
        self.db.shared()
    }

    /// The changes other nodes publish, once: the caller follows them.
    pub fn take_subscription(&self) -> Option<Subscription> {
        self.subscription
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
    }
}

/// Applies `sub`'s changes to `app` on a thread of its own until the app
/// is gone.
pub fn follow(app: Weak<App>, sub: Subscription) {
    let spawned = std::thread::Builder::new()
        .name("kiln-follow".into())
        .spawn(move || {
            loop {
                let change = match sub.changes.recv_timeout(Duration::from_millis(250)) {
                    Ok(c) => Some(c),
                    Err(RecvTimeoutError::Timeout) => None,
                    Err(RecvTimeoutError::Disconnected) => return,
                };
                let Some(app) = app.upgrade() else { return };
                if let Some(change) = change
                    && let Err(e) = app.apply(&change)
                {
                    // The listener resyncs when its connection comes back.
                    tracing::warn!("applying {change:?}: {e}");
                }
            }
        });
    if let Err(e) = spawned {
        tracing::error!("following control-plane changes: {e}");
    }
}

/// How often a node trades quota figures with the others: a quota may be
/// overdrawn by what the cluster admits within about this long.
pub const QUOTA_SYNC: Duration = Duration::from_millis(200);

/// Trades `app`'s quota figures every [`QUOTA_SYNC`] on a thread of its
/// own until the app is gone.
pub fn share_quotas(app: Weak<App>) {
    let spawned = std::thread::Builder::new()
        .name("kiln-quotas".into())
        .spawn(move || {
            while let Some(app) = app.upgrade() {
                if let Err(e) = app.share_quota_load() {
                    tracing::warn!("sharing quota figures: {e}");
                }
                drop(app);
                std::thread::sleep(QUOTA_SYNC);
            }
        });
    if let Err(e) = spawned {
        tracing::error!("sharing quota figures: {e}");
    }
}
