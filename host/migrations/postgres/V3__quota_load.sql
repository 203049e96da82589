-- What each node's tenants hold of their quotas (tokens charged in the
-- last minute plus those reserved, and calls in flight), refreshed by
-- every node several times a second, so a quota holds for the cluster.
CREATE TABLE quota_load (
    node TEXT NOT NULL,
    tenant TEXT NOT NULL,
    tokens BIGINT NOT NULL,
    inflight INTEGER NOT NULL,
    updated TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (node, tenant)
);
