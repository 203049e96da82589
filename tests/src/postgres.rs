//! A throwaway PostgreSQL server (Debian's, installed by
//! `scripts/postgres.sh`) in a temporary directory on a free port.

use std::path::{Path, PathBuf};
use std::process::Command;

/// A running PostgreSQL; stopped and removed when dropped.
pub struct Postgres {
    /// `postgres://kiln@127.0.0.1:PORT/postgres`.
    pub url: String,
    bin: PathBuf,
    data: PathBuf,
    /// The server's options (port, socket directory).
    opts: String,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

/// Runs a PostgreSQL tool, as the `postgres` user when this process is
/// root (initdb refuses to run as root).
fn as_postgres(bin: &Path, tool: &str, args: &[&str]) -> std::process::Output {
    let exe = bin.join(tool);
    let root = Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| o.stdout.starts_with(b"0\n"));
    let mut cmd = if root {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(&exe);
        c
    } else {
        Command::new(&exe)
    };
    cmd.args(args)
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", exe.display()))
}

impl Postgres {
    /// Initializes and starts a server; returns once it accepts
    /// connections.
    pub fn start() -> Self {
        let bin = crate::installed_by("postgres.sh");
        let dir = tempfile::tempdir().expect("tempdir");
        // The server runs as `postgres`, which must own its directory.
        let _ = Command::new("chown")
            .arg("postgres")
            .arg(dir.path())
            .status();
        let data = dir.path().join("data");
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let out = as_postgres(
            &bin,
            "initdb",
            &[
                "-D",
                data.to_str().unwrap(),
                "--auth=trust",
                "-U",
                "kiln",
                "-E",
                "UTF8",
            ],
        );
        assert!(
            out.status.success(),
            "initdb: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let opts = format!(
            "-p {port} -k {} -c listen_addresses=127.0.0.1 -c fsync=off",
            dir.path().display()
        );
        let pg = Self {
            url: format!("postgres://kiln@127.0.0.1:{port}/postgres"),
            bin,
            data,
            opts,
            log: dir.path().join("log"),
            _dir: dir,
        };
        let out = pg.pg_ctl(&["-w", "start"]);
        assert!(
            out.status.success(),
            "pg_ctl start: {}{}",
            String::from_utf8_lossy(&out.stderr),
            std::fs::read_to_string(&pg.log).unwrap_or_default()
        );
        pg
    }

    /// Runs `pg_ctl` on this server's data, options and log with `action`.
    fn pg_ctl(&self, action: &[&str]) -> std::process::Output {
        let mut args = vec![
            "-D",
            self.data.to_str().unwrap(),
            "-o",
            &self.opts,
            "-l",
            self.log.to_str().unwrap(),
        ];
        args.extend_from_slice(action);
        as_postgres(&self.bin, "pg_ctl", &args)
    }

    /// `psql` on this server running `sql`, not yet waited for.
    pub fn psql(&self, sql: &str) -> std::process::Child {
        Command::new(self.bin.join("psql"))
            .args([
                self.url.as_str(),
                "-X",
                "-q",
                "-t",
                "-A",
                "-v",
                "ON_ERROR_STOP=1",
                "-c",
                sql,
            ])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("psql runs")
    }

    /// What `sql` prints through `psql` on this server, trimmed.
    pub fn query(&self, sql: &str) -> String {
        let out = self.psql(sql).wait_with_output().expect("psql ends");
        assert!(
            out.status.success(),
            "psql: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    /// Stops the server (dropping every connection) and starts it again
    /// on the same data and port.
    pub fn restart(&self) {
        let out = self.pg_ctl(&["-m", "fast", "-w", "restart"]);
        assert!(
            out.status.success(),
            "pg_ctl restart: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        let _ = as_postgres(
            &self.bin,
            "pg_ctl",
            &[
                "-D",
                self.data.to_str().unwrap_or_default(),
                "-m",
                "immediate",
                "stop",
            ],
        );
    }
}
