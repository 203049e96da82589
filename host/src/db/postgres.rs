//! A control plane that nodes share: PostgreSQL through one connection on
//! a thread of its own. The `postgres` client blocks on a runtime of its
//! own, which must not run inside the server's; callers wait on a channel
//! instead, as they wait on SQLite's disk. A lost connection is made again
//! before the next statement, so a restarted database needs no restart of
//! Kiln.

use std::sync::mpsc;

use ::postgres::fallible_iterator::FallibleIterator;
use ::postgres::{Client, GenericClient, NoTls, Row};

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use super::{Change, Db, DbError, FunctionRow, Store, Subscription, TenantLoad};

/// The channel nodes announce control-plane changes on.
const CHANNEL: &str = "kiln_changes";

mod embedded {
    refinery::embed_migrations!("migrations/postgres");
}

/// A statement run on the connection's thread. Given `last: false`, it
/// hands back `false` instead of its result when it found the connection
/// closed (the server restarted since the last statement), to be run again
/// on a new connection.
type Job = Box<dyn FnMut(&mut Client, bool) -> bool + Send>;

/// Sends statements to the connection's thread.
pub(super) struct Postgres {
    jobs: mpsc::Sender<Job>,
    url: String,
}

fn connect(url: &str) -> Result<Client, DbError> {
    let mut client = Client::connect(url, NoTls)?;
    embedded::migrations::runner()
        .run(&mut client)
        .map_err(|e| DbError::Migration(e.to_string()))?;
    Ok(client)
}

impl Postgres {
    /// Connects to `url` and migrates its schema.
    pub(super) fn connect(url: &str) -> Result<Self, DbError> {
        let (jobs, queue) = mpsc::channel::<Job>();
        let (ready, started) = mpsc::channel();
        let url = url.to_owned();
        let this_url = url.clone();
        std::thread::Builder::new()
            .name("kiln-postgres".into())
            .spawn(move || {
                let mut client = match connect(&url) {
                    Ok(c) => {
                        let _ = ready.send(Ok(()));
                        c
                    }
                    Err(e) => {
                        let _ = ready.send(Err(e));
                        return;
                    }
                };
                let reconnect = |client: &mut Client| match connect(&url) {
                    Ok(c) => *client = c,
                    Err(e) => tracing::warn!("reconnecting to PostgreSQL: {e}"),
                };
                for mut job in queue {
                    if client.is_closed() {
                        reconnect(&mut client);
                    }
                    // A restarted server leaves the socket looking open until
                    // a statement fails on it: that statement never reached a
                    // live server, so it runs once more on a new connection.
                    if !job(&mut client, false) {
                        reconnect(&mut client);
                        job(&mut client, true);
                    }
                }
            })
            .map_err(|_| DbError::Closed)?;
        started.recv().map_err(|_| DbError::Closed)??;
        Ok(Self {
            jobs,
            url: this_url,
        })
    }

    /// Runs `f` on the connection and waits for its result.
    fn run<T: Send + 'static>(
        &self,
        f: impl Fn(&mut Client) -> Result<T, DbError> + Send + 'static,
    ) -> Result<T, DbError> {
        let (done, result) = mpsc::sync_channel(1);
        let job: Job = Box::new(move |c, last| {
            let out = f(c);
            if !last && matches!(&out, Err(DbError::Postgres(e)) if connection_lost(e)) {
                return false;
            }
            let _ = done.send(out);
            true
        });
        self.jobs.send(job).map_err(|_| DbError::Closed)?;
        result.recv().map_err(|_| DbError::Closed)?
    }
}

/// Whether `e` says the connection is gone: closed, or ended by the
/// server's shutdown (SQLSTATE 57P01-03) or a connection failure (08xxx),
/// which the server reports on an idle connection before it goes.
fn connection_lost(e: &::postgres::Error) -> bool {
    e.is_closed()
        || e.code()
            .is_some_and(|c| c.code().starts_with("57P") || c.code().starts_with("08"))
}

const FUNCTION: &str = "SELECT tenant, name, digest, size, created FROM functions";

fn function_of(r: &Row) -> FunctionRow {
    FunctionRow {
        tenant: r.get(0),
        name: r.get(1),
        digest: r.get(2),
        size: r.get::<_, i64>(3) as u64,
        created: r.get(4),
    }
}

fn digest_in_use(c: &mut impl GenericClient, digest: &str) -> Result<bool, DbError> {
    let q = "SELECT 1 FROM functions WHERE digest = $1 LIMIT 1";
    Ok(c.query_opt(q, &[&digest])?.is_some())
}

impl Store for Postgres {
    fn create_tenant(&self, name: &str, key_id: &str, key_hash: &[u8]) -> Result<(), DbError> {
        let (name, key_id, key_hash) = (name.to_owned(), key_id.to_owned(), key_hash.to_vec());
        self.run(move |c| {
            let mut tx = c.transaction()?;
            let inserted = tx.execute(
                "INSERT INTO tenants (name, created) VALUES ($1, $2) ON CONFLICT DO NOTHING",
                &[&name, &Db::now()],
            )?;
            if inserted == 0 {
                return Err(DbError::TenantExists(name.clone()));
            }
            tx.execute(
                "INSERT INTO api_keys (id, tenant, hash, created) VALUES ($1, $2, $3, $4)",
                &[&key_id, &name, &key_hash, &Db::now()],
            )?;
            tx.commit()?;
            Ok(())
        })
    }

    fn api_key(&self, key_id: &str) -> Result<Option<(String, Vec<u8>)>, DbError> {
        let key_id = key_id.to_owned();
        self.run(move |c| {
            let q = "SELECT tenant, hash FROM api_keys WHERE id = $1";
            Ok(c.query_opt(q, &[&key_id])?.map(|r| (r.get(0), r.get(1))))
        })
    }

    fn upsert_function(
        &self,
        row: &FunctionRow,
        max_functions: u32,
    ) -> Result<Option<String>, DbError> {
        let row = row.clone();
        self.run(move |c| {
            let mut tx = c.transaction()?;
            // Deploys of one tenant take turns here, so two new names on
            // two nodes cannot both pass the count below.
            tx.execute(
                "SELECT 1 FROM tenants WHERE name = $1 FOR UPDATE",
                &[&row.tenant],
            )?;
            // The bytes stay until this row is committed: a delete on
            // another node takes this lock's rival before it forgets them.
            let bytes = "SELECT 1 FROM components WHERE digest = $1 FOR KEY SHARE";
            if tx.query_opt(bytes, &[&row.digest])?.is_none() {
                return Err(DbError::ComponentGone(row.digest.clone()));
            }
            let previous: Option<String> = tx
                .query_opt(
                    "SELECT digest FROM functions WHERE tenant = $1 AND name = $2 FOR UPDATE",
                    &[&row.tenant, &row.name],
                )?
                .map(|r| r.get(0));
            if previous.is_none() {
                let count = "SELECT COUNT(*) FROM functions WHERE tenant = $1";
                let n: i64 = tx.query_one(count, &[&row.tenant])?.get(0);
                super::within_cap(&row.tenant, n, max_functions)?;
            }
            tx.execute(
                "INSERT INTO functions (tenant, name, digest, size, created)
                 VALUES ($1, $2, $3, $4, $5)
                 ON CONFLICT (tenant, name) DO UPDATE SET
                   digest = EXCLUDED.digest, size = EXCLUDED.size, created = EXCLUDED.created",
                &[
                    &row.tenant,
                    &row.name,
                    &row.digest,
                    &(row.size as i64),
                    &row.created,
                ],
            )?;
            let unused = match previous {
                Some(old) if !digest_in_use(&mut tx, &old)? => Some(old),
                _ => None,
            };
            tx.commit()?;
            Ok(unused)
        })
    }

    fn function(&self, tenant: &str, name: &str) -> Result<Option<FunctionRow>, DbError> {
        let (tenant, name) = (tenant.to_owned(), name.to_owned());
        self.run(move |c| {
            let q = format!("{FUNCTION} WHERE tenant = $1 AND name = $2");
            Ok(c.query_opt(&q, &[&tenant, &name])?
                .as_ref()
                .map(function_of))
        })
    }

    fn functions(&self, tenant: Option<&str>) -> Result<Vec<FunctionRow>, DbError> {
        let tenant = tenant.map(str::to_owned);
        self.run(move |c| {
            let q =
                format!("{FUNCTION} WHERE $1::TEXT IS NULL OR tenant = $1 ORDER BY tenant, name");
            Ok(c.query(&q, &[&tenant])?.iter().map(function_of).collect())
        })
    }

    fn delete_function(
        &self,
        tenant: &str,
        name: &str,
    ) -> Result<Option<(FunctionRow, bool)>, DbError> {
        let (tenant, name) = (tenant.to_owned(), name.to_owned());
        self.run(move |c| {
            let mut tx = c.transaction()?;
            let q = format!("{FUNCTION} WHERE tenant = $1 AND name = $2 FOR UPDATE");
            let Some(row) = tx
                .query_opt(&q, &[&tenant, &name])?
                .as_ref()
                .map(function_of)
            else {
                return Ok(None);
            };
            tx.execute(
                "DELETE FROM functions WHERE tenant = $1 AND name = $2",
                &[&tenant, &name],
            )?;
            let shared = digest_in_use(&mut tx, &row.digest)?;
            tx.commit()?;
            Ok(Some((row, shared)))
        })
    }

    fn digests(&self) -> Result<std::collections::HashSet<String>, DbError> {
        self.run(|c| {
            let rows = c.query("SELECT DISTINCT digest FROM functions", &[])?;
            Ok(rows.iter().map(|r| r.get(0)).collect())
        })
    }

    fn tenant_exists(&self, name: &str) -> Result<bool, DbError> {
        let name = name.to_owned();
        self.run(move |c| {
            let q = "SELECT 1 FROM tenants WHERE name = $1";
            Ok(c.query_opt(q, &[&name])?.is_some())
        })
    }

    fn set_policy(&self, tenant: &str, policy_json: &str) -> Result<(), DbError> {
        let (tenant, policy) = (tenant.to_owned(), policy_json.to_owned());
        self.run(move |c| {
            c.execute(
                "INSERT INTO policies (tenant, policy) VALUES ($1, $2)
                 ON CONFLICT (tenant) DO UPDATE SET policy = EXCLUDED.policy",
                &[&tenant, &policy],
            )?;
            Ok(())
        })
    }

    fn policies(&self) -> Result<Vec<(String, String)>, DbError> {
        self.run(|c| {
            let rows = c.query("SELECT tenant, policy FROM policies ORDER BY tenant", &[])?;
            Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
        })
    }

    fn put_component(&self, digest: &str, bytes: &[u8]) -> Result<(), DbError> {
        let (digest, bytes) = (digest.to_owned(), bytes.to_vec());
        self.run(move |c| {
            c.execute(
                "INSERT INTO components (digest, bytes) VALUES ($1, $2) ON CONFLICT DO NOTHING",
                &[&digest, &bytes],
            )?;
            Ok(())
        })
    }

    fn component(&self, digest: &str) -> Result<Option<Vec<u8>>, DbError> {
        let digest = digest.to_owned();
        self.run(move |c| {
            let q = "SELECT bytes FROM components WHERE digest = $1";
            Ok(c.query_opt(q, &[&digest])?.map(|r| r.get(0)))
        })
    }

    fn forget_component(&self, digest: &str) -> Result<(), DbError> {
        let digest = digest.to_owned();
        self.run(move |c| {
            let mut tx = c.transaction()?;
            // Waits for every deploy about to refer to these bytes to
            // commit; the delete after it, a statement of its own, sees
            // their rows.
            tx.query_opt(
                "SELECT 1 FROM components WHERE digest = $1 FOR UPDATE",
                &[&digest],
            )?;
            tx.execute(
                "DELETE FROM components WHERE digest = $1
                 AND NOT EXISTS (SELECT 1 FROM functions WHERE digest = $1)",
                &[&digest],
            )?;
            tx.commit()?;
            Ok(())
        })
    }

    fn publish(&self, change: &Change) -> Result<(), DbError> {
        let payload = change.encode();
        self.run(move |c| {
            c.execute("SELECT pg_notify($1, $2)", &[&CHANNEL, &payload])?;
            Ok(())
        })
    }

    fn shared(&self) -> bool {
        true
    }

    fn share_load(&self, node: &str, load: &[TenantLoad]) -> Result<Vec<TenantLoad>, DbError> {
        let (node, load) = (node.to_owned(), load.to_vec());
        self.run(move |c| {
            let mut tx = c.transaction()?;
            // Its own rows, and those of nodes gone for a minute (each
            // start is a new node): the table holds the live nodes' only.
            tx.execute(
                "DELETE FROM quota_load WHERE node = $1 OR updated < now() - interval '1 minute'",
                &[&node],
            )?;
            for l in &load {
                tx.execute(
                    "INSERT INTO quota_load (node, tenant, tokens, inflight) VALUES ($1, $2, $3, $4)",
                    &[&node, &l.tenant, &(l.tokens as i64), &(l.inflight as i32)],
                )?;
            }
            // A node that stopped refreshing (down, or cut off) holds
            // nothing after a few seconds.
            let rows = tx.query(
                "SELECT tenant, SUM(tokens)::BIGINT, SUM(inflight)::BIGINT FROM quota_load
                 WHERE node <> $1 AND updated > now() - interval '3 seconds'
                 GROUP BY tenant",
                &[&node],
            )?;
            tx.commit()?;
            Ok(rows
                .iter()
                .map(|r| TenantLoad {
                    tenant: r.get(0),
                    tokens: r.get::<_, i64>(1).max(0) as u64,
                    inflight: r.get::<_, i64>(2).clamp(0, i64::from(u32::MAX)) as u32,
                })
                .collect())
        })
    }

    fn subscribe(&self) -> Option<Subscription> {
        let (tx, changes) = mpsc::channel();
        let stop = Arc::new(AtomicBool::new(false));
        let (url, stopped) = (self.url.clone(), stop.clone());
        let spawned = std::thread::Builder::new()
            .name("kiln-postgres-listen".into())
            .spawn(move || listen(&url, &tx, &stopped));
        spawned.ok().map(|_| Subscription { changes, stop })
    }
}

/// Forwards the channel's notifications to `tx` until `stop`, connecting
/// again whenever the connection is lost; each (re)connection first sends
/// a resync, as notifications sent meanwhile are gone.
fn listen(url: &str, tx: &mpsc::Sender<Change>, stop: &AtomicBool) {
    while !stop.load(Ordering::Relaxed) {
        let mut client = match Client::connect(url, NoTls) {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!("listening for control-plane changes: {e}");
                std::thread::sleep(Duration::from_millis(250));
                continue;
            }
        };
        if client.batch_execute(&format!("LISTEN {CHANNEL}")).is_err() {
            continue;
        }
        if tx.send(Change::Resync).is_err() {
            return;
        }
        loop {
            if stop.load(Ordering::Relaxed) {
                return;
            }
            let next = client
                .notifications()
                .timeout_iter(Duration::from_millis(250))
                .next();
            match next {
                Ok(Some(n)) => {
                    if let Some(change) = Change::decode(n.payload())
                        && tx.send(change).is_err()
                    {
                        return;
                    }
                }
                Err(_) => break,
                Ok(None) if client.is_closed() => break,
                Ok(None) => {}
            }
        }
    }
}
