-- Tenants, API keys (hashes only), functions and tenant policies, as in
-- SQLite.
CREATE TABLE tenants (
    name TEXT PRIMARY KEY,
    created BIGINT NOT NULL
);
CREATE TABLE api_keys (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL REFERENCES tenants(name) ON DELETE CASCADE,
    hash BYTEA NOT NULL,
    created BIGINT NOT NULL
);
CREATE TABLE functions (
    tenant TEXT NOT NULL REFERENCES tenants(name) ON DELETE CASCADE,
    name TEXT NOT NULL,
    digest TEXT NOT NULL,
    size BIGINT NOT NULL,
    created BIGINT NOT NULL,
    PRIMARY KEY (tenant, name)
);
CREATE INDEX functions_digest ON functions (digest);
CREATE TABLE policies (
    tenant TEXT PRIMARY KEY REFERENCES tenants(name) ON DELETE CASCADE,
    policy TEXT NOT NULL
);
