-- Component bytes, content-addressed, so a node can run a function another
-- node deployed.
CREATE TABLE components (
    digest TEXT PRIMARY KEY,
    bytes BYTEA NOT NULL
);
