//! Per-tenant caps on work in flight (function instances, deploys), so
//! that one tenant's flood of slow requests cannot hold every slot of a
//! shared pool while other tenants are refused.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

/// Work in flight, counted per tenant.
#[derive(Debug, Default)]
pub struct TenantCaps {
    inflight: Mutex<HashMap<String, Arc<AtomicU32>>>,
}

/// One slot of a tenant, released when dropped: an instance's slot goes
/// with the instance, so a streaming guest holds it until it has finished.
#[derive(Debug)]
pub struct TenantSlot(Arc<AtomicU32>);

impl Drop for TenantSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl TenantCaps {
    /// A slot for `tenant` if it has fewer than `cap` instances in flight.
    pub fn try_acquire(&self, tenant: &str, cap: u32) -> Option<TenantSlot> {
        let counter = {
            let mut map = self.inflight.lock().unwrap_or_else(|p| p.into_inner());
            map.entry(tenant.to_owned()).or_default().clone()
        };
        if counter.fetch_add(1, Ordering::AcqRel) >= cap {
            counter.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        Some(TenantSlot(counter))
    }

    /// Slots `tenant` holds.
    pub fn in_flight(&self, tenant: &str) -> u32 {
        let map = self.inflight.lock().unwrap_or_else(|p| p.into_inner());
        map.get(tenant).map_or(0, |c| c.load(Ordering::Acquire))
    }
}

/// The default cap of one tenant: `share` of the pool's `slots`, at least 1.
pub fn default_cap(slots: u32, share: f64) -> u32 {
    ((f64::from(slots) * share.clamp(0.0, 1.0)).floor() as u32).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tenant_at_its_cap_is_refused_while_others_are_not() {
        let caps = TenantCaps::default();
        let held: Vec<TenantSlot> = (0..3).map(|_| caps.try_acquire("a", 3).unwrap()).collect();
        assert!(caps.try_acquire("a", 3).is_none());
        assert!(caps.try_acquire("b", 3).is_some(), "b has its own count");
        drop(held);
        assert_eq!(caps.in_flight("a"), 0);
        assert!(caps.try_acquire("a", 3).is_some());
    }

    #[test]
    fn default_cap_is_a_share_of_the_pool_and_never_zero() {
        assert_eq!(default_cap(1000, 0.25), 250);
        assert_eq!(default_cap(3, 0.1), 1);
        assert_eq!(default_cap(10, 7.0), 10);
    }
}
