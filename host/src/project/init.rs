//! `kiln init`: a new function project that builds and deploys as it is.

use std::path::Path;

use super::{COMPONENTIZE_JS, Lang, ProjectError, embedded, io};
use crate::names::Name;

const RUST_APP: &str = r#"//! A Kiln function: `GET` greets; `POST` a question and the model answers.

use kiln_guest::{Handler, Request, Response, ai};

struct App;

impl Handler for App {
    fn handle(req: Request) -> Response {
        if req.method() != "POST" {
            return Response::text(200, "Hello from Kiln! POST a question to ask the model.\n");
        }
        let question = String::from_utf8_lossy(&req.body()).into_owned();
        match ai::Chat::new("smollm2-135m-instruct")
            .system("Answer in one sentence.")
            .user(question)
            .max_tokens(64)
            .send()
        {
            Ok(done) => Response::text(200, done.text),
            Err(e) => Response::text(e.http_status(), format!("model call failed: {e}\n")),
        }
    }
}

kiln_guest::export_handler!(App);
"#;

const PYTHON_APP: &str = r#""""A Kiln function: `GET` greets; `POST` a question and the model answers."""

from kiln_guest import Handler, Request, Response, ai


class IncomingHandler(Handler):
    def handle_request(self, req: Request) -> Response:
        if req.method != "POST":
            return Response.text(200, "Hello from Kiln! POST a question to ask the model.\n")
        try:
            reply = (ai.Chat("smollm2-135m-instruct")
                     .system("Answer in one sentence.")
                     .user(req.text())
                     .max_tokens(64)
                     .send())
        except ai.AiError as e:
            return Response.text(e.http_status, f"model call failed: {e}\n")
        return Response.text(200, reply.text)
"#;

const JS_APP: &str = r#"// A Kiln function: `GET` greets; `POST` a question and the model answers.

import { AiError, Chat } from "./kiln.js";

export default {
  async fetch(request) {
    if (request.method !== "POST") {
      return new Response("Hello from Kiln! POST a question to ask the model.\n");
    }
    try {
      const reply = new Chat("smollm2-135m-instruct")
        .system("Answer in one sentence.")
        .user(await request.text())
        .maxTokens(64)
        .send();
      return new Response(reply.text);
    } catch (e) {
      if (e instanceof AiError) {
        return new Response(`model call failed: ${e.message}\n`, { status: e.httpStatus });
      }
      throw e;
    }
  },
};
"#;

/// Makes a new project of `lang` in `dir` (which must not exist); the
/// directory's name is the function's name. Returns the next steps to
/// print.
pub fn init(dir: &Path, lang: Lang) -> Result<String, ProjectError> {
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    Name::function(&name).map_err(|e| ProjectError::Name(e.to_string()))?;
    if dir.exists() {
        return Err(ProjectError::Exists(dir.to_owned()));
    }
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let write = |files: &[(&str, &str)]| embedded::write(dir, files).map_err(io(dir));
    let setup = match lang {
        Lang::Rust => {
            write(&[
                ("Cargo.toml", &rust_manifest(&name)),
                ("src/lib.rs", RUST_APP),
                ("kiln-guest/Cargo.toml", RUST_SDK_MANIFEST),
                (".gitignore", "/target\n"),
            ])?;
            embedded::write(&dir.join("kiln-guest"), embedded::RUST_SDK).map_err(io(dir))?;
            embedded::write_wit(&dir.join("wit"), embedded::WASI_VERSION).map_err(io(dir))?;
            String::new()
        }
        Lang::Python => {
            write(&[
                ("app.py", PYTHON_APP),
                (".gitignore", "/.kiln-build\n__pycache__/\n"),
            ])?;
            format!("  pip install {}\n", super::COMPONENTIZE_PY)
        }
        Lang::Js => {
            write(&[
                ("app.js", JS_APP),
                ("package.json", &js_manifest(&name)),
                (".gitignore", "/.kiln-build\n/node_modules\n"),
            ])?;
            embedded::write(dir, &[embedded::JS_HELPER]).map_err(io(dir))?;
            format!("  (cd {} && npm install)\n", dir.display())
        }
    };
    let lang = match lang {
        Lang::Rust => "Rust",
        Lang::Python => "Python",
        Lang::Js => "JavaScript",
    };
    Ok(format!(
        "Made {lang} function `{name}` in {dir}. Next:\n{setup}  kiln deploy {dir} --tenant TENANT   # builds it; KILN_API_KEY holds the tenant's key\n",
        dir = dir.display(),
    ))
}

fn rust_manifest(name: &str) -> String {
    format!(
        r#"[package]
name = "{name}"
version = "0.1.0"
edition = "2024"
publish = false

[lib]
crate-type = ["cdylib"]

[dependencies]
kiln-guest = {{ path = "kiln-guest" }}

[profile.release]
opt-level = "s"
strip = true

# A workspace of its own, wherever the project lies.
[workspace]
"#
    )
}

const RUST_SDK_MANIFEST: &str = r#"[package]
name = "kiln-guest"
description = "Write Kiln functions: an HTTP handler API over wasi:http plus the kiln:ai model API."
version = "0.1.0"
edition = "2024"
publish = false

[dependencies]
wit-bindgen = "0.61"
"#;

fn js_manifest(name: &str) -> String {
    let (package, version) = COMPONENTIZE_JS
        .rsplit_once('@')
        .unwrap_or((COMPONENTIZE_JS, "*"));
    serde_json::to_string_pretty(&serde_json::json!({
        "name": name,
        "private": true,
        "type": "module",
        "scripts": { "build": "kiln build .", "deploy": "kiln deploy ." },
        "devDependencies": { package: version },
    }))
    .unwrap_or_default()
        + "\n"
}
