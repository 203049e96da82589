//! A tenant's quotas across the nodes of a cluster: each node reports what
//! its tenants hold and counts what they hold on the others
//! (`App::share_quota_load`), so a tenant's `tokens_per_minute` and
//! `max_concurrent` bound the whole cluster, overdrawn at most by what the
//! nodes admit between two exchanges.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use super::{Gateway, TenantState};
use crate::db::TenantLoad;

impl Gateway {
    /// What each tenant holds of its quotas on this node (tenants holding
    /// nothing left out), for the other nodes of a cluster.
    pub fn local_load(&self) -> Vec<TenantLoad> {
        let now = Instant::now();
        self.tenant_states()
            .into_iter()
            .map(|(tenant, state)| {
                let mut q = state.quota.lock().unwrap_or_else(|p| p.into_inner());
                TenantLoad {
                    tenant,
                    tokens: q.used(now) + q.reserved,
                    inflight: state.inflight.load(Ordering::Acquire),
                }
            })
            .filter(|l| l.tokens > 0 || l.inflight > 0)
            .collect()
    }

    /// Sets what each tenant holds on the other nodes (a tenant left out
    /// holds nothing there).
    pub fn set_remote_load(&self, remote: &[TenantLoad]) {
        for (tenant, state) in self.tenant_states() {
            if !remote.iter().any(|l| l.tenant == tenant) {
                *state.remote.lock().unwrap_or_else(|p| p.into_inner()) = (0, 0);
            }
        }
        for l in remote {
            let state = self.state(&l.tenant);
            *state.remote.lock().unwrap_or_else(|p| p.into_inner()) = (l.tokens, l.inflight);
        }
    }

    /// Every tenant's state, copied out of the map's lock.
    fn tenant_states(&self) -> Vec<(String, Arc<TenantState>)> {
        let map = self.tenants.lock().unwrap_or_else(|p| p.into_inner());
        map.iter().map(|(t, s)| (t.clone(), s.clone())).collect()
    }
}
