//! `kiln init` scaffolds a project per language that builds with
//! `kiln build`'s logic, deploys, greets and asks the real model.

use kiln_host::project::{self, Lang};
use kiln_tests::{TestServer, guest_tools};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn init_makes_projects_in_every_language_that_build_deploy_and_call_the_model() {
    let s = TestServer::start_with_models().await;
    let key = s.tenant("acme").await;
    let tmp = tempfile::tempdir().unwrap();
    let tools = guest_tools();
    for (lang, name) in [
        (Lang::Python, "ask-py"),
        (Lang::Js, "ask-js"),
        (Lang::Rust, "ask-rs"),
    ] {
        let dir = tmp.path().join(name);
        let next = project::init(&dir, lang).unwrap();
        assert!(next.contains("kiln deploy"), "{next}");
        assert!(matches!(
            project::init(&dir, lang),
            Err(project::ProjectError::Exists(_))
        ));
        assert_eq!(project::detect(&dir).unwrap(), lang);

        let (dir2, tools2) = (dir.clone(), tools.clone());
        let wasm = tokio::task::spawn_blocking(move || {
            project::build_with(&dir2, &dir2.join(".kiln-build"), &tools2)
        })
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("building the {lang:?} project: {e}"));
        let resp = s.put(&key, name, std::fs::read(&wasm).unwrap()).await;
        assert_eq!(resp.status(), 201, "{:?}", resp.text().await);

        let get = s.call("acme", name, "/").await;
        assert_eq!(get.status(), 200);
        assert!(get.text().await.unwrap().starts_with("Hello from Kiln!"));
        let post = s
            .http
            .post(format!("{}/fn/acme/{name}/", s.url))
            .body("What is the capital of France?")
            .send()
            .await
            .unwrap();
        assert_eq!(post.status(), 200, "{lang:?}");
        let answer = post.text().await.unwrap();
        assert!(!answer.trim().is_empty(), "{lang:?}: empty answer");
    }
    assert!(matches!(
        project::init(&tmp.path().join("Bad_Name"), Lang::Python),
        Err(project::ProjectError::Name(_))
    ));
}
