//! A throwaway nginx (Debian's, installed by `scripts/nginx.sh`) running
//! the shipped `deploy/nginx/kiln.conf` in front of test nodes.

use std::process::{Child, Command, Stdio};

use crate::workspace;

/// An nginx process; killed when dropped.
pub struct Nginx {
    /// Its base URL.
    pub url: String,
    child: Child,
    _dir: tempfile::TempDir,
}

/// `deploy/nginx/kiln.conf` with its nodes replaced by `nodes` (ports on
/// 127.0.0.1) and its listener by `port`.
pub fn config(nodes: &[u16], port: u16) -> String {
    let shipped = std::fs::read_to_string(workspace().join("deploy/nginx/kiln.conf"))
        .expect("deploy/nginx/kiln.conf");
    let mut out = String::new();
    let mut skipping = false;
    for line in shipped.lines() {
        let t = line.trim();
        if t == "# KILN NODES (one line per node)" {
            skipping = true;
            for p in nodes {
                out.push_str(&format!(
                    "    server 127.0.0.1:{p} max_fails=1 fail_timeout=2s;\n"
                ));
            }
            continue;
        }
        if skipping && t.starts_with("server ") {
            continue;
        }
        skipping = false;
        if t.starts_with("listen ") {
            out.push_str(&format!("    listen 127.0.0.1:{port};\n"));
            continue;
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

impl Nginx {
    /// Starts nginx on a free port in front of `nodes`, and waits until it
    /// accepts connections.
    pub fn start(nodes: &[u16]) -> Self {
        let bin = crate::installed_by("nginx.sh");
        let dir = tempfile::tempdir().expect("tempdir");
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let p = dir.path().display();
        let main = format!(
            "worker_processes 1;\npid {p}/nginx.pid;\nerror_log {p}/error.log warn;\n\
             master_process off;\nevents {{ worker_connections 1024; }}\n\
             http {{\n  access_log off;\n  client_body_temp_path {p}/body;\n  proxy_temp_path {p}/proxy;\n\
             fastcgi_temp_path {p}/fcgi;\n  uwsgi_temp_path {p}/uwsgi;\n  scgi_temp_path {p}/scgi;\n\
             {}\n}}\n",
            config(nodes, port)
        );
        let conf = dir.path().join("nginx.conf");
        std::fs::write(&conf, main).expect("writing nginx.conf");
        let child = Command::new(bin)
            .arg("-p")
            .arg(dir.path())
            .arg("-c")
            .arg(&conf)
            .args(["-g", "daemon off;"])
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("starting nginx");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(std::time::Instant::now() < deadline, "nginx did not start");
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        Self {
            url: format!("http://127.0.0.1:{port}"),
            child,
            _dir: dir,
        }
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
