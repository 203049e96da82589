//! Choosing a decode pool for a request.
//!
//! A request with a session key goes to the pool that rendezvous hashing of
//! (tenant, key) picks, so a session keeps landing where its cached prefix
//! is, and adding a pool moves only the sessions the new pool wins. If that
//! pool is saturated the request spills to the least-loaded pool. Without a
//! key, the pool holding the longest cached prefix of the prompt wins if the
//! match is worth it; otherwise the least-loaded pool.

use std::hash::{Hash, Hasher};

/// Cached pages a prefix match needs before it outweighs load balancing.
pub const MIN_PREFIX_PAGES: usize = 2;

/// A pool's load as the router sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolLoad {
    /// Requests it holds.
    pub requests: usize,
    /// Requests it runs at once; at or above this it is saturated.
    pub capacity: usize,
}

impl PoolLoad {
    fn saturated(&self) -> bool {
        self.requests >= self.capacity
    }
}

/// Where a request goes, and why.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// The session's own pool.
    Session(usize),
    /// The session's pool was saturated; this one was least loaded.
    Spilled(usize),
    /// The pool with the longest cached prefix (pages matched).
    Prefix(usize, usize),
    /// The least-loaded pool.
    LeastLoaded(usize),
}

impl Route {
    /// The chosen pool.
    pub fn pool(self) -> usize {
        match self {
            Route::Session(p) | Route::Spilled(p) | Route::Prefix(p, _) | Route::LeastLoaded(p) => {
                p
            }
        }
    }
}

/// The pool rendezvous hashing gives `(tenant, key)` among `n` pools.
pub fn rendezvous(tenant: &str, key: &str, n: usize) -> usize {
    (0..n)
        .max_by_key(|i| {
            let mut h = std::hash::DefaultHasher::new();
            (tenant, key, i).hash(&mut h);
            h.finish()
        })
        .unwrap_or(0)
}

fn least_loaded(loads: &[PoolLoad]) -> usize {
    (0..loads.len())
        .min_by_key(|i| loads[*i].requests)
        .unwrap_or(0)
}

/// Picks a pool. `cached_pages(i)` is how many leading pages of the
/// prompt pool `i` has cached for this tenant.
pub fn choose(
    tenant: &str,
    session: Option<&str>,
    loads: &[PoolLoad],
    cached_pages: impl Fn(usize) -> usize,
) -> Route {
    if loads.len() <= 1 {
        return match session {
            Some(_) => Route::Session(0),
            None => Route::LeastLoaded(0),
        };
    }
    if let Some(key) = session {
        let home = rendezvous(tenant, key, loads.len());
        if !loads[home].saturated() {
            return Route::Session(home);
        }
        let other = least_loaded(loads);
        return if loads[other].requests < loads[home].requests {
            Route::Spilled(other)
        } else {
            Route::Session(home)
        };
    }
    let best = (0..loads.len())
        .filter(|i| !loads[*i].saturated())
        .map(|i| (cached_pages(i), i))
        .max_by_key(|(pages, i)| (*pages, std::cmp::Reverse(loads[*i].requests)));
    match best {
        Some((pages, i)) if pages >= MIN_PREFIX_PAGES => Route::Prefix(i, pages),
        _ => Route::LeastLoaded(least_loaded(loads)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn idle(n: usize) -> Vec<PoolLoad> {
        vec![
            PoolLoad {
                requests: 0,
                capacity: 4
            };
            n
        ]
    }

    #[test]
    fn a_session_sticks_to_its_pool_and_spills_only_when_it_is_saturated() {
        let mut loads = idle(4);
        let home = choose("a", Some("s1"), &loads, |_| 0);
        for _ in 0..20 {
            assert_eq!(choose("a", Some("s1"), &loads, |_| 0), home);
        }
        let Route::Session(h) = home else {
            panic!("{home:?}")
        };
        // The same key of another tenant is an unrelated session.
        let spread: std::collections::HashSet<usize> = (0..32)
            .map(|t| rendezvous(&format!("t{t}"), "s1", 4))
            .collect();
        assert!(spread.len() > 1, "keys spread over pools: {spread:?}");
        loads[h].requests = 4;
        let spilled = choose("a", Some("s1"), &loads, |_| 0);
        assert!(
            matches!(spilled, Route::Spilled(p) if p != h),
            "{spilled:?}"
        );
    }

    #[test]
    fn rendezvous_moves_only_the_sessions_a_new_pool_wins() {
        let keys: Vec<String> = (0..200).map(|i| format!("k{i}")).collect();
        let moved = keys
            .iter()
            .filter(|k| {
                let before = rendezvous("t", k, 4);
                let after = rendezvous("t", k, 5);
                before != after && after != 4
            })
            .count();
        assert_eq!(moved, 0);
    }

    #[test]
    fn without_a_key_the_longest_worthwhile_prefix_wins_else_the_least_loaded() {
        let mut loads = idle(3);
        loads[0].requests = 2;
        loads[1].requests = 1;
        assert_eq!(choose("a", None, &loads, |_| 0), Route::LeastLoaded(2));
        let pages = [5, 1, 0];
        assert_eq!(choose("a", None, &loads, |i| pages[i]), Route::Prefix(0, 5));
        let short = [1, 1, 0];
        assert_eq!(
            choose("a", None, &loads, |i| short[i]),
            Route::LeastLoaded(2)
        );
        loads[0].requests = 4; // saturated: its cache does not count
        assert_eq!(
            choose("a", None, &loads, |i| pages[i]),
            Route::LeastLoaded(2)
        );
    }
}
