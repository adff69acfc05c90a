//! Limits, fallbacks, admin auth and the security posture, over real sockets:
//! `kvroute serve` in front of small in-test upstreams.

mod gateway_support;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use axum::body::Bytes;
use axum::http::StatusCode;
use gateway_support::*;
use serde_json::{json, Value};

const TOKEN: &str = "s3cret-admin-token";

fn config(echo: SocketAddr) -> String {
    format!(
        "{}[[rules]]\nname = \"kv\"\nmodels = [\"{MODEL}\"]\ndefault = true\nchoice = \"kv_exact\"\ncontract = \"{CONTRACT}\"\n\
         [[rules.endpoints]]\nurl = \"http://{echo}\"\nzmq = \"tcp://*:{}\"\n\n\
         [[rules]]\nname = \"down\"\nmodels = [\"down-model\"]\nchoice = \"round_robin\"\n\
         [[rules.endpoints]]\nurl = \"http://127.0.0.1:{}\"\n",
        config_head_with_admin(
            &format!("token = \"{TOKEN}\"\n"),
            "[limits]\nmax_body_bytes = 4096\nbody_read_timeout_ms = 500\n[health]\ninterval_ms = 0\n"
        ),
        closed_port(),
        closed_port(),
    )
}

fn raw_http(addr: SocketAddr, request: &[u8]) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    s.write_all(request).unwrap();
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                out.extend_from_slice(&buf[..n]);
                if out.windows(4).any(|w| w == b"\r\n\r\n") && out.ends_with(b"}") {
                    break;
                }
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_fallbacks_auth_and_no_open_proxy() {
    let echo = echo_upstream().await;
    let gw = Gateway::start(&config(echo));
    let http = client();

    // text/plain → fallback to the rule's selector; counted as a not_json miss.
    let resp = http
        .post(gw.url("/v1/completions"))
        .header("content-type", "text/plain")
        .body("hello, not json")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["len"], 15);
    let auth = Some(TOKEN);
    let c = get_json(&gw.admin_url("/admin/counters"), auth).await;
    assert_eq!(c["rules"]["kv"]["misses"]["not_json"], 1, "{c}");
    assert_eq!(c["rules"]["kv"]["tiers"]["fallback"], 1, "{c}");

    // Oversized bodies → 413, declared or streamed.
    let big = vec![b'x'; 5000];
    let resp = http
        .post(gw.url("/v1/completions"))
        .body(big.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 413);
    // Chunked (no Content-Length): the limit applies while reading.
    let stream = futures_util::stream::iter(
        big.chunks(1000)
            .map(|c| Ok::<_, std::io::Error>(hyper::body::Frame::data(Bytes::copy_from_slice(c))))
            .collect::<Vec<_>>(),
    );
    let resp = http
        .post(gw.url("/v1/completions"))
        .body(reqwest::Body::wrap(http_body_util::StreamBody::new(stream)))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 413);

    // Admin auth: no token / wrong token → 401; /metrics stays readable.
    let r = http.get(gw.admin_url("/admin/rules")).send().await.unwrap();
    assert_eq!(r.status(), 401);
    let r = http
        .get(gw.admin_url("/admin/rules"))
        .bearer_auth("wrong")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let r = http
        .get(gw.admin_url("/admin/rules"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let r = http.get(gw.admin_url("/metrics")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let text = r.text().await.unwrap();
    assert!(text.contains("outcome=\"body_too_large\"} 2"), "{text}");
    assert!(!text.contains(TOKEN));

    // No open proxying: an absolute-URI target and a foreign Host go to the
    // configured upstream only, with its own Host.
    let body = r#"{"model":"qwen3","prompt":"hi"}"#;
    let req = format!(
        "POST http://evil.example:81/v1/completions HTTP/1.1\r\nHost: evil.example:81\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let answer = raw_http(gw.proxy, req.as_bytes());
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.contains(&format!("\"host\":\"{echo}\"")), "{answer}");
    assert!(answer.contains("\"path\":\"/v1/completions\""), "{answer}");

    // Only /v1/* is proxied.
    let r = http.get(gw.url("/admin/rules")).send().await.unwrap();
    assert_eq!(r.status(), 404);

    // Slow-loris: a body that never completes → 408 after the read timeout.
    let answer = raw_http(
        gw.proxy,
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"model\":",
    );
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");

    // The engine dies mid-stream: the client gets an error, not a hang.
    let resp = http
        .post(gw.url("/v1/die"))
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let read = tokio::time::timeout(WAIT, resp.bytes()).await;
    assert!(
        matches!(read, Ok(Err(_))),
        "expected a body error, got {read:?}"
    );

    // Every endpoint down → 503 with the reason.
    let resp = http
        .post(gw.url("/v1/completions"))
        .json(&json!({"model": "down-model", "prompt": "x"}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 503);
    let v: Value = resp.json().await.unwrap();
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains("connect failed"), "{msg}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_api_creates_updates_and_deletes_rules_at_run_time() {
    let echo = echo_upstream().await;
    let gw = Gateway::start(&config(echo));
    let http = client();
    let post = |doc: Value| {
        http.post(gw.admin_url("/admin/rules"))
            .bearer_auth(TOKEN)
            .json(&doc)
            .send()
    };

    // Invalid documents are refused with the field at fault.
    let r = post(json!({"name": "bad", "models": ["m"], "choice": "kv_exact",
                        "endpoints": [{"url": format!("http://{echo}")}]}))
    .await
    .unwrap();
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("rule.contract"),
        "{v}"
    );
    let r = post(
        json!({"name": "bad", "models": ["m"], "choice": "round_robin",
                        "endpoints": [{"url": "ftp://x"}]}),
    )
    .await
    .unwrap();
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("rule.endpoints[0].url"),
        "{v}"
    );
    // Names and endpoints that could never be served or deleted
    // are refused with the field at fault.
    for (doc, field) in [
        (
            json!({"name": "x".repeat(100_000), "models": ["m"], "choice": "round_robin",
                   "endpoints": [{"url": format!("http://{echo}")}]}),
            "rule.name",
        ),
        (
            json!({"name": "p0", "models": ["m"], "choice": "round_robin",
                   "endpoints": [{"url": "http://127.0.0.1:0"}]}),
            "rule.endpoints[0].url",
        ),
        (
            json!({"name": "ipc", "models": ["m"], "choice": "round_robin",
                   "endpoints": [{"url": "ipc:///tmp/x"}]}),
            "rule.endpoints[0].url",
        ),
        (
            json!({"name": "w0", "models": ["m"], "choice": "round_robin",
                   "endpoints": [{"url": format!("http://{echo}"), "weight": 0}]}),
            "rule.endpoints[0].weight",
        ),
    ] {
        let r = post(doc).await.unwrap();
        assert_eq!(r.status(), 400, "{field}");
        let v: Value = r.json().await.unwrap();
        assert!(
            v["error"]["message"].as_str().unwrap().contains(field),
            "{field}: {v}"
        );
    }
    // Dot segments never reach an engine.
    // Sent raw: an HTTP client library would resolve them before sending.
    for path in [
        "/v1/../health",
        "/v1/%2e%2e/health",
        "/v1//../../etc/passwd",
    ] {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let mut tcp = tokio::net::TcpStream::connect(gw.proxy).await.unwrap();
        let req = format!(
            "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{{}}"
        );
        tcp.write_all(req.as_bytes()).await.unwrap();
        let mut answer = Vec::new();
        let _ = tokio::time::timeout(WAIT, tcp.read_to_end(&mut answer)).await;
        let answer = String::from_utf8_lossy(&answer);
        assert!(answer.starts_with("HTTP/1.1 400"), "{path}: {answer}");
    }

    // A KV rule whose engine is not up yet: accepted, its subscriber keeps dialing.
    let dead_zmq = closed_port();
    let r = post(
        json!({"name": "late", "models": ["late-model"], "choice": "kv_exact",
                        "contract": CONTRACT,
                        "endpoints": [{"url": format!("http://{echo}"), "role": "both",
                                        "zmq": format!("tcp://*:{dead_zmq}")}]}),
    )
    .await
    .unwrap();
    assert_eq!(r.status(), 201);
    // The late rule's endpoint row on /admin/endpoints.
    let late_endpoint = || async {
        let eps = get_json(&gw.admin_url("/admin/endpoints"), Some(TOKEN)).await;
        eps["endpoints"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["rule"] == "late")
            .cloned()
            .unwrap()
    };
    let late_subscriber = || async { late_endpoint().await["subscribers"][0].clone() };
    assert_eq!(late_subscriber().await["connected"], false);
    // The engine comes up afterwards, on the configured port: the subscriber
    // that kept trying connects.
    let _engine = Engine::start_on("both", (0, dead_zmq, 0));
    eventually("the late rule's subscriber connected", || async {
        (late_subscriber().await["connected"] == true).then_some(())
    })
    .await;
    // One request for its model, then the rule's counters.
    let late_request = || async {
        let resp = http
            .post(gw.url("/v1/completions"))
            .json(&json!({"model": "late-model", "prompt": "x"}))
            .send()
            .await
            .unwrap();
        let counters = get_json(&gw.admin_url("/admin/counters"), Some(TOKEN)).await;
        (resp.status(), counters["rules"]["late"].clone())
    };
    // Requests for its model are routed by it (fallback: no inventory yet).
    let (status, c) = late_request().await;
    assert_eq!(status, 200);
    assert_eq!(c["decisions"], 1, "{c}");

    // An operator drains the endpoint; a PUT of the rule keeps it drained.
    let r = http
        .put(gw.admin_url("/admin/rules/late/endpoints/0/admin"))
        .bearer_auth(TOKEN)
        .body(r#"{"down": true}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let late_admin_down = || async { late_endpoint().await["admin_down"].clone() };
    assert_eq!(late_admin_down().await, true);

    // Duplicate name → 409; PUT replaces; a model claimed twice is refused.
    let doc = json!({"name": "late", "models": ["late-model"], "choice": "round_robin",
                     "endpoints": [{"url": format!("http://{echo}")}]});
    assert_eq!(post(doc.clone()).await.unwrap().status(), 409);
    let r = http
        .put(gw.admin_url("/admin/rules/late"))
        .bearer_auth(TOKEN)
        .json(&doc)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let rule = get_json(&gw.admin_url("/admin/rules/late"), Some(TOKEN)).await;
    assert_eq!(rule["choice"], "round_robin");
    assert_eq!(late_admin_down().await, true, "the drain outlives the PUT");
    // Its only endpoint drained: no endpoint, a decision of the `exhausted`
    // tier, counted as such.
    let (status, c) = late_request().await;
    assert_eq!(status, 503);
    assert_eq!(c["tiers"]["exhausted"], 1, "{c}");
    let r = post(
        json!({"name": "thief", "models": ["late-model"], "choice": "round_robin",
                        "endpoints": [{"url": format!("http://{echo}")}]}),
    )
    .await
    .unwrap();
    assert_eq!(r.status(), 400);

    // Delete; the model then falls to the default rule.
    let r = http
        .delete(gw.admin_url("/admin/rules/late"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 204);
    let r = http
        .get(gw.admin_url("/admin/rules/late"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let rules = get_json(&gw.admin_url("/admin/rules"), Some(TOKEN)).await;
    let names: Vec<&str> = rules["rules"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["down", "kv"]);
    let _ = StatusCode::OK;
}

#[test]
fn invalid_configuration_is_rejected_with_a_precise_message() {
    let cases = [
        (
            "listen = \"127.0.0.1:0\"\n[[rules]]\nname = \"r\"\nmodels = [\"m\"]\nchoice = \"kv_exact\"\n[[rules.endpoints]]\nurl = \"http://127.0.0.1:1\"\nzmq = \"tcp://127.0.0.1:2\"\n",
            "rules[0].contract",
        ),
        (
            "listen = \"127.0.0.1:0\"\n[admin]\nlisten = \"0.0.0.0:9999\"\n",
            "admin.listen",
        ),
        (
            "listen = \"127.0.0.1:0\"\n[[rules]]\nname = \"r\"\nmodels = [\"m\"]\nchoice = \"round_robin\"\n[[rules.endpoints]]\nurl = \"http://127.0.0.1:1/v1\"\n",
            "rules[0].endpoints[0].url",
        ),
        ("listen = \"127.0.0.1:0\"\nlisten_typo = 1\n", "unknown field"),
    ];
    for (toml, want) in cases {
        let mut f = tempfile::Builder::new().suffix(".toml").tempfile().unwrap();
        f.write_all(toml.as_bytes()).unwrap();
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvroute"))
            .args(["serve", "--config", f.path().to_str().unwrap()])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{toml}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(want), "want {want:?} in {err:?}");
    }
}
