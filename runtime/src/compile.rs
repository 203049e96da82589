//! The wasmtime engine, its linker, and components compiled once per digest.

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use wasmtime::component::{Component, Linker};
use wasmtime::{Config, Enabled, Engine, InstanceAllocationStrategy, PoolingAllocationConfig};
use wasmtime_wasi_http::p2::bindings::ProxyPre;

use crate::ai::{self, Inference};
use crate::error::RuntimeError;
use crate::limits::{Limits, TICK};
use crate::state::State;

/// Bytes of each linear memory kept resident between requests (reset in
/// place rather than returned to the kernel).
const KEEP_RESIDENT: usize = 4 << 20;

/// A validated component, ready to instantiate: its [`ProxyPre`] resolves
/// every import once, so each request only allocates and initialises.
#[derive(Clone)]
pub struct Deployment {
    /// SHA-256 of the component bytes, hex.
    pub digest: String,
    pub(crate) pre: ProxyPre<State>,
}

impl std::fmt::Debug for Deployment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Deployment")
            .field("digest", &self.digest)
            .finish()
    }
}

/// Most core instances one component may create: componentize-py's
/// components make 14 (CPython and its libraries), Rust's and
/// componentize-js's 3-4.
pub const CORE_INSTANCES_PER_COMPONENT: u32 = 16;

/// Most tables one component may hold (the toolchains above make 2).
pub const TABLES_PER_COMPONENT: u32 = 4;

/// The shared engine: configuration, linker, model backend and the on-disk
/// cache of compiled artifacts.
pub struct Runtime {
    pub(crate) engine: Engine,
    linker: Linker<State>,
    pub(crate) limits: Limits,
    pub(crate) backend: Arc<dyn Inference>,
    cache_dir: PathBuf,
    engine_key: String,
    ticker_stop: Arc<AtomicBool>,
    /// One lock per digest being compiled: loads of one component at once
    /// compile it once, and the rest read the artifact it leaves.
    compiling: Mutex<HashMap<String, Arc<Mutex<()>>>>,
}

impl Runtime {
    /// Builds the engine with the pooling allocator and copy-on-write memory
    /// images, starts the epoch ticker, and links WASI, WASI-HTTP and
    /// `kiln:ai`. Compiled components are cached under `cache_dir`.
    pub fn new(
        limits: Limits,
        backend: Arc<dyn Inference>,
        cache_dir: &Path,
    ) -> Result<Self, RuntimeError> {
        let setup = |e: wasmtime::Error| RuntimeError::Setup(e.to_string());
        let mut pool = PoolingAllocationConfig::default();
        let n = limits.max_instances;
        // Each component instance may hold at most its share of the pool's
        // core instances and tables, so no tenant's component can take
        // other tenants' slots while its own instance count is in bounds.
        pool.total_component_instances(n)
            .max_core_instances_per_component(CORE_INSTANCES_PER_COMPONENT)
            .total_core_instances(n.saturating_mul(CORE_INSTANCES_PER_COMPONENT))
            .max_tables_per_component(TABLES_PER_COMPONENT)
            .total_tables(n.saturating_mul(TABLES_PER_COMPONENT))
            .total_memories(n)
            .total_stacks(n)
            .max_memory_size(limits.memory_bytes)
            .max_memories_per_component(1)
            // Reset a slot's dirty pages with memset (found by PAGEMAP_SCAN on
            // Linux >= 6.7) instead of madvise: no TLB-shootdown IPIs and no
            // page faults when the slot is reused.
            .pagemap_scan(Enabled::Auto)
            .linear_memory_keep_resident(KEEP_RESIDENT)
            .table_keep_resident(64 << 10)
            .decommit_batch_size(16);
        let mut config = Config::new();
        config
            .wasm_component_model(true)
            .epoch_interruption(true)
            .memory_init_cow(true)
            .allocation_strategy(InstanceAllocationStrategy::Pooling(pool));
        let engine = Engine::new(&config).map_err(setup)?;

        let mut linker = Linker::<State>::new(&engine);
        wasmtime_wasi::p2::add_to_linker_async(&mut linker).map_err(setup)?;
        wasmtime_wasi_http::p2::add_only_http_to_linker_async(&mut linker).map_err(setup)?;
        crate::state::bound_outgoing_requests(&mut linker).map_err(setup)?;
        ai::add_to_linker(&mut linker, State::ai).map_err(setup)?;
        crate::ai_legacy::add_to_linker(&mut linker, State::ai).map_err(setup)?;

        let mut hasher = DefaultHasher::new();
        engine.precompile_compatibility_hash().hash(&mut hasher);
        let engine_key = format!("{:016x}", hasher.finish());
        std::fs::create_dir_all(cache_dir).map_err(|e| {
            RuntimeError::Setup(format!("creating cache dir {}: {e}", cache_dir.display()))
        })?;

        let ticker_stop = Arc::new(AtomicBool::new(false));
        spawn_ticker(engine.clone(), ticker_stop.clone())
            .map_err(|e| RuntimeError::Setup(format!("starting the epoch thread: {e}")))?;
        Ok(Self {
            engine,
            linker,
            limits,
            backend,
            cache_dir: cache_dir.to_owned(),
            engine_key,
            ticker_stop,
            compiling: Mutex::default(),
        })
    }

    /// The limits every request runs under.
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// Compiles (or loads from the artifact cache) and validates a component:
    /// it must be a component, import only what Kiln provides, and export
    /// `wasi:http/incoming-handler`.
    pub fn load(&self, digest: &str, bytes: &[u8]) -> Result<Deployment, RuntimeError> {
        let component = self.compile_cached(digest, bytes)?;
        let pre = self
            .linker
            .instantiate_pre(&component)
            .map_err(|e| RuntimeError::UnsupportedImport(format!("{e:#}")))
            .and_then(|pre| {
                ProxyPre::new(pre).map_err(|e| RuntimeError::MissingHandler(format!("{e:#}")))
            });
        match pre {
            Ok(pre) => Ok(Deployment {
                digest: digest.to_owned(),
                pre,
            }),
            Err(e) => {
                // A refused upload leaves no artifact behind to fill the disk.
                self.forget(digest);
                Err(e)
            }
        }
    }

    /// Deletes the compiled artifacts of `digest` (a component no function
    /// uses any more, or one refused).
    pub fn forget(&self, digest: &str) {
        self.remove_artifacts(|d| d == digest);
    }

    /// Deletes the compiled artifacts of every component that `in_use`
    /// does not name, and those of older engines: how many.
    pub fn collect_orphans(&self, in_use: impl Fn(&str) -> bool) -> usize {
        let current = format!("-{}.cwasm", self.engine_key);
        self.remove_artifacts(|d| !in_use(d)) + self.remove_files(|name| !name.ends_with(&current))
    }

    fn remove_artifacts(&self, remove: impl Fn(&str) -> bool) -> usize {
        self.remove_files(|name| {
            name.split_once('-')
                .is_some_and(|(digest, rest)| rest.ends_with(".cwasm") && remove(digest))
        })
    }

    fn remove_files(&self, remove: impl Fn(&str) -> bool) -> usize {
        let Ok(dir) = std::fs::read_dir(&self.cache_dir) else {
            return 0;
        };
        let mut removed = 0;
        for entry in dir.flatten() {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if name.ends_with(".cwasm") && remove(&name) {
                match std::fs::remove_file(entry.path()) {
                    Ok(()) => removed += 1,
                    Err(e) => tracing::warn!(file = %name, "could not remove artifact: {e}"),
                }
            }
        }
        removed
    }

    fn compile_cached(&self, digest: &str, bytes: &[u8]) -> Result<Component, RuntimeError> {
        if !wasmparser_is_component(bytes) {
            return Err(RuntimeError::InvalidComponent(
                "the upload is not a WebAssembly component (a core module or other bytes?); \
                 build with `--target wasm32-wasip2`"
                    .into(),
            ));
        }
        let path = self
            .cache_dir
            .join(format!("{digest}-{}.cwasm", self.engine_key));
        let lock = {
            let mut map = self.compiling.lock().unwrap_or_else(|p| p.into_inner());
            map.entry(digest.to_owned()).or_default().clone()
        };
        let compiled = {
            let _one_at_a_time = lock.lock().unwrap_or_else(|p| p.into_inner());
            self.compile_or_read(&path, bytes)
        };
        let mut map = self.compiling.lock().unwrap_or_else(|p| p.into_inner());
        if Arc::strong_count(&lock) == 2 {
            map.remove(digest);
        }
        compiled
    }

    fn compile_or_read(&self, path: &Path, bytes: &[u8]) -> Result<Component, RuntimeError> {
        if path.exists() {
            // SAFETY: the file was written by `Component::serialize` of an
            // engine with the same compatibility hash, under our data dir.
            match unsafe { Component::deserialize_file(&self.engine, path) } {
                Ok(c) => return Ok(c),
                Err(e) => {
                    tracing::warn!(path = %path.display(), "stale artifact, recompiling: {e}")
                }
            }
        }
        let component = Component::new(&self.engine, bytes)
            .map_err(|e| RuntimeError::InvalidComponent(format!("{e:#}")))?;
        match component.serialize() {
            Ok(art) => {
                // A name of its own: two compiles of one digest at once must
                // not write into the same file, which is later trusted.
                static NEXT: AtomicU64 = AtomicU64::new(0);
                let n = NEXT.fetch_add(1, Ordering::Relaxed);
                let tmp = path.with_extension(format!("tmp{}-{n}", std::process::id()));
                let written = std::fs::File::create(&tmp)
                    .and_then(|mut f| {
                        std::io::Write::write_all(&mut f, &art)?;
                        f.sync_all()
                    })
                    .and_then(|()| std::fs::rename(&tmp, path));
                if let Err(e) = written {
                    let _ = std::fs::remove_file(&tmp);
                    tracing::warn!("could not cache compiled artifact: {e}");
                }
            }
            Err(e) => tracing::warn!("could not serialize compiled artifact: {e}"),
        }
        Ok(component)
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        self.ticker_stop.store(true, Ordering::Relaxed);
    }
}

/// Advances the engine's epoch every [`TICK`] until told to stop.
fn spawn_ticker(engine: Engine, stop: Arc<AtomicBool>) -> std::io::Result<()> {
    std::thread::Builder::new()
        .name("kiln-epoch".into())
        .spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                std::thread::sleep(TICK);
                engine.increment_epoch();
            }
        })
        .map(drop)
}

/// Whether `bytes` start with the component-model preamble (as opposed to a
/// core module or anything else).
fn wasmparser_is_component(bytes: &[u8]) -> bool {
    // Magic `\0asm`, then a version field whose layer byte is 1 (component).
    bytes.len() >= 8 && bytes[..4] == *b"\0asm" && bytes[6..8] == [1, 0]
}
