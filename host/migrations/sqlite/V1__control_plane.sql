-- Tenants, API keys (hashes only), functions and tenant policies. IF NOT
-- EXISTS: databases made before migrations were tracked already hold them.
CREATE TABLE IF NOT EXISTS tenants (
    name TEXT PRIMARY KEY,
    created INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS api_keys (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL REFERENCES tenants(name) ON DELETE CASCADE,
    hash BLOB NOT NULL,
    created INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS functions (
    tenant TEXT NOT NULL REFERENCES tenants(name) ON DELETE CASCADE,
    name TEXT NOT NULL,
    digest TEXT NOT NULL,
    size INTEGER NOT NULL,
    created INTEGER NOT NULL,
    PRIMARY KEY (tenant, name)
);
CREATE TABLE IF NOT EXISTS policies (
    tenant TEXT PRIMARY KEY REFERENCES tenants(name) ON DELETE CASCADE,
    policy TEXT NOT NULL
);
