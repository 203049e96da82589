//! The server's shared state: control plane, component store, runtime, and
//! the routing table of deployed functions.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use kiln_runtime::{Deployment, Inference, Runtime, RuntimeError};
use sha2::{Digest, Sha256};
use tokio::sync::OwnedSemaphorePermit;

use crate::aside::aside;
use crate::auth;
use crate::components::ComponentStore;
use crate::config::ServeConfig;
use crate::db::{Change, Db, DbError, FunctionRow, Subscription};
use crate::fairness::{InstanceCaps, InstanceSlot, TenantQueues, default_cap};
use crate::metrics::Metrics;
use crate::names::Name;
use crate::serving::policy::{Gateway, TenantPolicy};

#[path = "app_cluster.rs"]
mod cluster;
pub use cluster::{QUOTA_SYNC, follow, share_quotas};

/// A deployed function as the router sees it. Replaced whole on redeploy,
/// so in-flight requests finish on the version they started with.
pub struct Route {
    /// The control-plane record.
    pub row: FunctionRow,
    /// Filled by the first request; those arriving meanwhile wait for it
    /// rather than each loading the component again. A component that
    /// does not load keeps its error for `reload_after` (then a fresh
    /// route tries again); a failure to fetch it (the database) is tried
    /// again by the next request.
    deployment: tokio::sync::OnceCell<Result<Deployment, LoadFailure>>,
}

/// Why a route's component did not load, and when.
#[derive(Debug)]
struct LoadFailure {
    why: String,
    at: std::time::Instant,
}

impl Route {
    /// A route whose component loads on first use.
    pub(crate) fn new(row: FunctionRow) -> Self {
        Self {
            row,
            deployment: tokio::sync::OnceCell::new(),
        }
    }
}

/// Everything a request handler needs.
pub struct App {
    pub(crate) db: Db,
    pub(crate) runtime: Runtime,
    pub(crate) metrics: Metrics,
    /// The status page's history of the metrics.
    pub(crate) status: crate::status::History,
    /// This node's name, as the `x-kiln-node` header sends it.
    pub(crate) node: hyper::header::HeaderValue,
    /// This node among the others sharing its database: its name and a
    /// random suffix, so two nodes given one name stay apart.
    node_id: String,
    /// Model calls of guests and of the API, behind tenant policy.
    pub(crate) ai: Arc<Gateway>,
    pub(crate) config: ServeConfig,
    admin_hash: [u8; 32],
    metrics_hash: Option<[u8; 32]>,
    components: ComponentStore,
    routes: RwLock<HashMap<(String, String), Arc<Route>>>,
    /// Other nodes' changes, until the server starts following them.
    subscription: std::sync::Mutex<Option<Subscription>>,
    instances: InstanceCaps,
    /// Deploys in flight, by tenant.
    deploys: TenantQueues,
    /// Model calls' bodies arriving, per tenant.
    bodies: TenantQueues,
    keys: auth::KeyCache,
    /// Held while a policy is written to the database and set in memory,
    /// or read back from it for a change another node made: so the two
    /// always end up holding the same last write.
    policy_writes: std::sync::Mutex<()>,
}

/// How long a model call waits for one of its tenant's body slots: short,
/// so that the calls past a tenant's stalled bodies give their connections
/// back soon.
const BODY_SLOT_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// Deploys one tenant may have in flight at once on a node: each holds its
/// upload in memory and compiles on a thread of its own, so without a cap
/// one tenant's burst would take the server's memory and cores. The others
/// wait their turn, up to `deploy_wait`, before reading their uploads. A
/// function's first load on a node takes a slot too.
pub const DEPLOYS_PER_TENANT: u32 = 2;

/// How far back the status page's plots go.
const STATUS_SPAN: std::time::Duration = std::time::Duration::from_secs(300);

/// Why an [`App`] operation failed. The HTTP status and JSON body of each
/// are chosen in one place, `api/error.rs`.
#[derive(Debug, thiserror::Error)]
pub enum AppError {
    /// No tenant has this name.
    #[error("no tenant named `{0}`")]
    NoTenant(Name),
    /// The tenant already runs its share of the server's function instances.
    #[error(
        "tenant `{tenant}` already runs {cap} function instances, its share of the server; \
         retry when some finish, or ask the operator to raise `max_instances` \
         (PUT /v1/tenants/{tenant}/policy)"
    )]
    InstancesExceeded {
        /// The tenant.
        tenant: String,
        /// Its cap on instances in flight.
        cap: u32,
    },
    /// The tenant already had its most deploys in flight for as long as a
    /// deploy waits.
    #[error(
        "tenant `{tenant}` had {cap} deploys in flight (first loads of its functions on this \
         node count as deploys) for as long as another may wait; retry when one finishes"
    )]
    DeploysExceeded {
        /// The tenant.
        tenant: String,
        /// Its cap on deploys in flight.
        cap: u32,
    },
    /// The tenant has as many model calls' bodies arriving as it may.
    #[error(
        "tenant `{tenant}` already has {cap} model calls' request bodies arriving, its cap; send \
         a body whole once its head is sent, or retry when one has arrived"
    )]
    BodiesExceeded {
        /// The tenant.
        tenant: String,
        /// Its cap on bodies arriving at once.
        cap: u32,
    },
    /// As many API keys not seen before are being looked up as may be.
    #[error(
        "the server is checking as many API keys it has not seen before as it may at once; \
         retry shortly"
    )]
    KeyChecksBusy,
    /// The component was refused, or could not be compiled.
    #[error(transparent)]
    Component(#[from] RuntimeError),
    /// The control-plane database refused or failed.
    #[error(transparent)]
    Db(#[from] DbError),
    /// A failure on the server's side, explained.
    #[error("{0}")]
    Internal(String),
}

impl App {
    /// Samples the metrics into the status page's history.
    pub fn sample_status(&self) {
        self.status
            .record(&crate::status::parse(&self.metrics.encode()));
    }

    /// Opens the data directory and builds the runtime over `backend`
    /// wrapped in tenant policy. Functions are listed from the database;
    /// each compiles (or loads its cached artifact) on first use.
    pub fn open(
        config: ServeConfig,
        admin_token: &str,
        backend: Arc<dyn Inference>,
        metrics: Metrics,
    ) -> anyhow::Result<Self> {
        let components = ComponentStore::open(config.data_dir.join("components"))?;
        let tenant_bodies = config.net.tenant_bodies;
        let db = match &config.database {
            Some(url) => Db::connect(url)?,
            None => Db::open(&config.data_dir.join("kiln.db"))?,
        };
        // Subscribed before reading: a change made meanwhile is not lost.
        let db_subscription = db.subscribe();
        let in_use = db.digests()?;
        let removed = components.collect_orphans(|d| in_use.contains(d))?;
        if removed > 0 {
            tracing::info!("removed {removed} component files that no function refers to");
        }
        let ai = Arc::new(Gateway::new(
            backend,
            config.model_deadline,
            config.max_concurrent_calls,
            metrics.engine.clone(),
        ));
        for (tenant, json) in db.policies()? {
            let policy: TenantPolicy = serde_json::from_str(&json)
                .map_err(|e| anyhow::anyhow!("stored policy of tenant `{tenant}`: {e}"))?;
            ai.set_policy(&tenant, policy);
        }
        let runtime = Runtime::new(
            config.limits.clone(),
            ai.clone(),
            &config.data_dir.join("cache"),
        )?;
        let stale = runtime.collect_orphans(|d| in_use.contains(d));
        if stale > 0 {
            tracing::info!("removed {stale} compiled artifacts of components no function uses");
        }
        let routes = db
            .functions(None)?
            .into_iter()
            .map(|row| {
                let key = (row.tenant.clone(), row.name.clone());
                (key, Arc::new(Route::new(row)))
            })
            .collect();
        Ok(Self {
            db,
            runtime,
            metrics,
            status: crate::status::History::new(config.status_interval, STATUS_SPAN),
            node: hyper::header::HeaderValue::from_str(&config.node_name)
                .map_err(|_| anyhow::anyhow!("--node-name must be printable ASCII"))?,
            node_id: format!("{}-{:016x}", config.node_name, rand::random::<u64>()),
            ai,
            metrics_hash: config.metrics_token.as_deref().map(auth::hash),
            config,
            admin_hash: auth::hash(admin_token),
            components,
            routes: RwLock::new(routes),
            subscription: std::sync::Mutex::new(db_subscription),
            instances: InstanceCaps::default(),
            deploys: TenantQueues::new(DEPLOYS_PER_TENANT),
            bodies: TenantQueues::new(tenant_bodies),
            keys: auth::KeyCache::default(),
            policy_writes: std::sync::Mutex::default(),
        })
    }

    /// Whether `token` is the metrics token.
    pub fn is_metrics_reader(&self, token: &str) -> bool {
        self.metrics_hash
            .as_ref()
            .is_some_and(|h| auth::verify(token, h))
    }

    /// Whether `token` is the admin token.
    pub fn is_admin(&self, token: &str) -> bool {
        auth::verify(token, &self.admin_hash)
    }

    /// The tenant owning API key `key`, if it is valid.
    /// A key not seen before is looked up aside from the async worker.
    pub fn tenant_for_key(&self, key: &str) -> Result<Option<String>, AppError> {
        let lookup = |id: &str| aside(|| self.db.api_key(id)).map_err(AppError::from);
        self.keys.tenant(key, lookup, || AppError::KeyChecksBusy)
    }

    /// Creates a tenant; returns its first API key.
    pub fn create_tenant(&self, name: &Name) -> Result<String, AppError> {
        let key = auth::new_key();
        aside(|| self.db.create_tenant(name.as_str(), &key.id, &key.hash))?;
        Ok(key.key)
    }

    /// Sets a tenant's model policy, stored and in force at once.
    pub fn set_policy(&self, tenant: &Name, policy: TenantPolicy) -> Result<(), AppError> {
        aside(|| self.store_policy(tenant, policy))
    }

    fn store_policy(&self, tenant: &Name, policy: TenantPolicy) -> Result<(), AppError> {
        if !self.db.tenant_exists(tenant.as_str())? {
            return Err(AppError::NoTenant(tenant.clone()));
        }
        let json = serde_json::to_string(&policy)
            .map_err(|e| AppError::Internal(format!("encoding the policy: {e}")))?;
        {
            let _write = self.policy_writes.lock().unwrap_or_else(|p| p.into_inner());
            self.db.set_policy(tenant.as_str(), &json)?;
            self.ai.set_policy(tenant.as_str(), policy);
        }
        self.db.publish(&Change::Policy {
            tenant: tenant.as_str().to_owned(),
        })?;
        Ok(())
    }

    /// A tenant's model policy.
    pub fn policy(&self, tenant: &Name) -> Result<TenantPolicy, AppError> {
        if !aside(|| self.db.tenant_exists(tenant.as_str()))? {
            return Err(AppError::NoTenant(tenant.clone()));
        }
        Ok(self.ai.policy(tenant.as_str()))
    }

    /// One of `tenant`'s function instance slots, or
    /// [`AppError::InstancesExceeded`] when it holds its share of the pool
    /// already.
    pub fn instance_slot(&self, tenant: &str) -> Result<InstanceSlot, AppError> {
        let cap = self.ai.policy(tenant).max_instances.unwrap_or_else(|| {
            default_cap(
                self.config.limits.max_instances,
                self.config.tenant_instance_share,
            )
        });
        self.instances
            .try_acquire(tenant, cap)
            .ok_or_else(|| AppError::InstancesExceeded {
                tenant: tenant.to_owned(),
                cap,
            })
    }

    /// One of `tenant`'s deploy slots, once one is free, or
    /// [`AppError::DeploysExceeded`] when none frees within the config's
    /// `deploy_wait`.
    pub async fn deploy_slot(&self, tenant: &str) -> Result<OwnedSemaphorePermit, AppError> {
        self.deploys
            .acquire(tenant, self.config.deploy_wait)
            .await
            .ok_or_else(|| AppError::DeploysExceeded {
                tenant: tenant.to_owned(),
                cap: self.deploys.cap(),
            })
    }

    /// One of `tenant`'s slots for a model call's body arriving (the config's
    /// `net.tenant_bodies`), held while the body is read, or
    /// [`AppError::BodiesExceeded`] when none frees within two seconds.
    pub async fn body_slot(&self, tenant: &str) -> Result<OwnedSemaphorePermit, AppError> {
        self.bodies
            .acquire(tenant, BODY_SLOT_WAIT)
            .await
            .ok_or_else(|| AppError::BodiesExceeded {
                tenant: tenant.to_owned(),
                cap: self.bodies.cap(),
            })
    }

    /// Deploys `tenant` has in flight.
    pub fn deploys_in_flight(&self, tenant: &str) -> u32 {
        self.deploys.in_flight(tenant)
    }

    /// Validates, stores and routes a component; replaces any previous
    /// version atomically (requests in flight finish on the old one).
    /// Deploys and deletes are ordered, so the file, the row and the route
    /// always agree.
    pub fn deploy(&self, tenant: &str, name: &Name, bytes: &[u8]) -> Result<FunctionRow, AppError> {
        let digest = hex::encode(Sha256::digest(bytes));
        let max_functions = self.max_functions(tenant);
        // Before the compile, which a tenant at its cap must not get for
        // free; the store checks again, atomically.
        let deployed = self.db.functions(Some(tenant))?;
        if !deployed.iter().any(|f| f.name == name.as_str()) {
            crate::db::within_cap(tenant, deployed.len() as i64, max_functions)?;
        }
        // Validation first: nothing is stored for a component we reject.
        let deployment = self.runtime.load(&digest, bytes)?;
        let guard = self.components.lock();
        self.components
            .put(&guard, &digest, bytes)
            .map_err(|e| AppError::Internal(format!("storing the component failed: {e}")))?;
        let row = FunctionRow {
            tenant: tenant.to_owned(),
            name: name.as_str().to_owned(),
            digest,
            size: bytes.len() as u64,
            created: Db::now(),
        };
        let unused = match self.store_function(&row, bytes, max_functions) {
            Ok(unused) => unused,
            Err(e) => {
                // Refused: no row may refer to these bytes; none is left.
                // (The refusal is what the caller hears, whatever happens
                // here.)
                if self.db.digests().is_ok_and(|d| !d.contains(&row.digest)) {
                    self.components.remove(&guard, &row.digest);
                    self.runtime.forget(&row.digest);
                    let _ = self.db.forget_component(&row.digest);
                }
                return Err(e);
            }
        };
        let route = Route {
            row: row.clone(),
            deployment: tokio::sync::OnceCell::new_with(Some(Ok(deployment))),
        };
        self.routes_mut().insert(
            (tenant.to_owned(), name.as_str().to_owned()),
            Arc::new(route),
        );
        if let Some(old) = unused {
            self.components.remove(&guard, &old);
            self.runtime.forget(&old);
            self.db.forget_component(&old)?;
        }
        self.db.publish(&Change::Function {
            tenant: tenant.to_owned(),
            name: name.as_str().to_owned(),
        })?;
        Ok(row)
    }

    /// Stores `row` and its component's bytes; again if another node's
    /// delete took the bytes between the two (a shared database).
    fn store_function(
        &self,
        row: &FunctionRow,
        bytes: &[u8],
        max_functions: u32,
    ) -> Result<Option<String>, AppError> {
        let mut tries = 0;
        loop {
            self.db.put_component(&row.digest, bytes)?;
            match self.db.upsert_function(row, max_functions) {
                Err(DbError::ComponentGone(_)) if tries < 3 => tries += 1,
                out => return Ok(out?),
            }
        }
    }

    /// Deletes a function; false if the tenant has no such function.
    pub fn delete(&self, tenant: &str, name: &Name) -> Result<bool, AppError> {
        aside(|| self.delete_now(tenant, name))
    }

    fn delete_now(&self, tenant: &str, name: &Name) -> Result<bool, AppError> {
        let guard = self.components.lock();
        let Some((row, shared)) = self.db.delete_function(tenant, name.as_str())? else {
            return Ok(false);
        };
        self.routes_mut()
            .remove(&(tenant.to_owned(), name.as_str().to_owned()));
        self.metrics.forget_function(tenant, name.as_str());
        if !shared {
            self.components.remove(&guard, &row.digest);
            self.runtime.forget(&row.digest);
            self.db.forget_component(&row.digest)?;
        }
        self.db.publish(&Change::Function {
            tenant: tenant.to_owned(),
            name: name.as_str().to_owned(),
        })?;
        Ok(true)
    }

    fn routes_mut(&self) -> std::sync::RwLockWriteGuard<'_, HashMap<(String, String), Arc<Route>>> {
        self.routes.write().unwrap_or_else(|p| p.into_inner())
    }

    /// The route of `tenant`'s function `name`, if deployed.
    pub fn route(&self, tenant: &Name, name: &Name) -> Option<Arc<Route>> {
        let routes = self.routes.read().unwrap_or_else(|p| p.into_inner());
        let key = (tenant.as_str().to_owned(), name.as_str().to_owned());
        routes.get(&key).cloned()
    }

    /// How many functions `tenant` may have deployed.
    fn max_functions(&self, tenant: &str) -> u32 {
        (self.ai.policy(tenant).max_functions).unwrap_or(self.config.max_functions)
    }

    /// The route's deployment, compiling it (or loading the cached
    /// artifact) on first use, aside from the async worker it is called on.
    /// Requests arriving during that load wait for it without holding a
    /// thread; a component that does not load keeps its error for
    /// `reload_after`, and the first request after that loads it again on
    /// a fresh route (unless a change replaced the route already). A
    /// failure to fetch it is tried again by the next request.
    pub async fn deployment(&self, route: &Arc<Route>) -> Result<Deployment, AppError> {
        let mut route = route.clone();
        let mut renewed = false;
        loop {
            let loaded = (route.deployment)
                .get_or_try_init(|| async {
                    // A first load compiles (or reads) the component as a
                    // deploy does, on a slot of the tenant's deploys: one
                    // tenant's first calls to many functions (a node new
                    // to them) do not take the node's cores and memory.
                    let _slot = self.deploy_slot(&route.row.tenant).await?;
                    crate::aside::aside(|| self.load(&route))
                })
                .await?;
            match loaded {
                Ok(d) => return Ok(d.clone()),
                Err(failed) => {
                    if !renewed
                        && failed.at.elapsed() >= self.config.reload_after
                        && let Some(fresh) = self.renew(&route)
                    {
                        (route, renewed) = (fresh, true);
                        continue;
                    }
                    return Err(AppError::Internal(failed.why.clone()));
                }
            }
        }
    }

    /// Replaces `route` with a fresh one of the same row, if it is still
    /// the one its name routes to; returns the route its name now has.
    fn renew(&self, route: &Arc<Route>) -> Option<Arc<Route>> {
        let key = (route.row.tenant.clone(), route.row.name.clone());
        let mut routes = self.routes_mut();
        let now = routes.get_mut(&key)?;
        if Arc::ptr_eq(now, route) {
            *now = Arc::new(Route::new(route.row.clone()));
        }
        Some(now.clone())
    }

    fn load(&self, route: &Route) -> Result<Result<Deployment, LoadFailure>, AppError> {
        let digest = &route.row.digest;
        let bytes = match std::fs::read(self.components.path(digest)) {
            Ok(b) => b,
            // Deployed through another node: the shared database has it.
            Err(e) => match self.db.component(digest)? {
                Some(b) => {
                    let guard = self.components.lock();
                    self.components.put(&guard, digest, &b).map_err(|e| {
                        AppError::Internal(format!("storing the component failed: {e}"))
                    })?;
                    b
                }
                None => {
                    return Err(AppError::Internal(format!(
                        "component {digest} of function `{}` is missing from the data dir: {e}",
                        route.row.name
                    )));
                }
            },
        };
        self.metrics.component_loads.inc();
        // Accepted when it was deployed: failing now is the server's fault
        // (a changed runtime, damaged storage), not the caller's.
        Ok(self.runtime.load(digest, &bytes).map_err(|e| {
            tracing::error!(digest, "a deployed component no longer loads: {e}");
            LoadFailure {
                why: format!(
                    "function `{}` was deployed but its component no longer loads here; \
                     redeploy it (see the server log)",
                    route.row.name
                ),
                at: std::time::Instant::now(),
            }
        }))
    }
}
