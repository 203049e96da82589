//! Per-tenant caps on function instances in flight, so that one tenant's
//! flood of slow requests cannot hold every slot of the shared instance
//! pool while other tenants are refused; and per-tenant queues for
//! deploys.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Instances in flight, counted per tenant.
#[derive(Debug, Default)]
pub struct InstanceCaps {
    inflight: Mutex<HashMap<String, Arc<AtomicU32>>>,
}

/// One instance slot of a tenant, released when dropped (with the
/// instance, so a streaming guest holds its slot until it has finished).
#[derive(Debug)]
pub struct InstanceSlot(Arc<AtomicU32>);

impl Drop for InstanceSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl InstanceCaps {
    /// A slot for `tenant` if it has fewer than `cap` instances in flight.
    pub fn try_acquire(&self, tenant: &str, cap: u32) -> Option<InstanceSlot> {
        let counter = {
            let mut map = self.inflight.lock().unwrap_or_else(|p| p.into_inner());
            map.entry(tenant.to_owned()).or_default().clone()
        };
        if counter.fetch_add(1, Ordering::AcqRel) >= cap {
            counter.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        Some(InstanceSlot(counter))
    }

    /// Instances `tenant` has in flight.
    pub fn in_flight(&self, tenant: &str) -> u32 {
        let map = self.inflight.lock().unwrap_or_else(|p| p.into_inner());
        map.get(tenant).map_or(0, |c| c.load(Ordering::Acquire))
    }
}

/// Per-tenant slots a caller waits for (deploys), a fixed number each.
#[derive(Debug)]
pub struct TenantQueues {
    cap: u32,
    slots: Mutex<HashMap<String, Arc<Semaphore>>>,
}

impl TenantQueues {
    /// `cap` slots for each tenant.
    pub fn new(cap: u32) -> Self {
        Self {
            cap,
            slots: Mutex::default(),
        }
    }

    /// The slots each tenant has.
    pub fn cap(&self) -> u32 {
        self.cap
    }

    fn of(&self, tenant: &str) -> Arc<Semaphore> {
        let mut map = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        let cap = self.cap as usize;
        map.entry(tenant.to_owned())
            .or_insert_with(|| Arc::new(Semaphore::new(cap)))
            .clone()
    }

    /// One of `tenant`'s slots, released when dropped; `None` if none
    /// frees within `wait`. Waiters are served in their order.
    pub async fn acquire(&self, tenant: &str, wait: Duration) -> Option<OwnedSemaphorePermit> {
        let slots = self.of(tenant);
        tokio::time::timeout(wait, slots.acquire_owned())
            .await
            .ok()?
            .ok()
    }

    /// Slots `tenant` holds.
    pub fn in_flight(&self, tenant: &str) -> u32 {
        self.cap - self.of(tenant).available_permits() as u32
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
        let caps = InstanceCaps::default();
        let held: Vec<InstanceSlot> = (0..3).map(|_| caps.try_acquire("a", 3).unwrap()).collect();
        assert!(caps.try_acquire("a", 3).is_none());
        assert!(caps.try_acquire("b", 3).is_some(), "b has its own count");
        drop(held);
        assert_eq!(caps.in_flight("a"), 0);
        assert!(caps.try_acquire("a", 3).is_some());
    }

    #[tokio::test(start_paused = true)]
    async fn a_tenant_past_its_slots_waits_its_turn_then_is_refused() {
        let q = TenantQueues::new(2);
        let wait = Duration::from_secs(30);
        let held = [q.acquire("a", wait).await, q.acquire("a", wait).await];
        assert!(held.iter().all(Option::is_some));
        assert_eq!(q.in_flight("a"), 2);
        assert!(q.acquire("b", wait).await.is_some(), "b has its own slots");
        // A third waits; a slot freed meanwhile is its.
        let waiter = q.acquire("a", wait);
        let [first, _second] = held;
        let free = async {
            tokio::time::sleep(Duration::from_secs(10)).await;
            drop(first);
        };
        let (got, ()) = tokio::join!(waiter, free);
        assert!(got.is_some(), "the freed slot went to the waiter");
        // With none freed within the wait, it is refused.
        assert!(q.acquire("a", wait).await.is_none());
    }

    #[test]
    fn default_cap_is_a_share_of_the_pool_and_never_zero() {
        assert_eq!(default_cap(1000, 0.25), 250);
        assert_eq!(default_cap(3, 0.1), 1);
        assert_eq!(default_cap(10, 7.0), 10);
    }
}
