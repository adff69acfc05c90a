//! Prefill/decode end to end: two prefill mock engines publishing KV events, one
//! decode mock engine; the gateway runs vLLM's two-step for every request.

mod gateway_support;

use gateway_support::*;

/// Sends a completion of a 40-word prompt named `name` through `gw` in the
/// background; its status when it answers.
fn spawn_completion(
    gw: &Gateway,
    name: &str,
) -> tokio::task::JoinHandle<Result<u16, reqwest::Error>> {
    let url = gw.url("/v1/completions");
    let body = serde_json::json!({"model": MODEL, "prompt": prompt(name, 40), "max_tokens": 4});
    tokio::spawn(async move {
        client()
            .post(url)
            .json(&body)
            .send()
            .await
            .map(|r| r.status().as_u16())
    })
}

/// The (prefill, decode) endpoints' requests in flight (the first two).
async fn in_flight(gw: &Gateway) -> (Option<u64>, Option<u64>) {
    let eps = endpoints(gw).await;
    (eps[0]["in_flight"].as_u64(), eps[1]["in_flight"].as_u64())
}

/// A P/D rule over `prefill` and decode endpoints at `decodes`, with no
/// health probes or engine polls, plus `limits` under `[limits]`.
fn pd_config(prefill: &Engine, decodes: &[std::net::SocketAddr], limits: &str) -> String {
    let mut c = format!(
        "{}{}{}",
        config_head(&format!(
            "[health]\ninterval_ms = 0\n[limits]\nengine_load_poll_ms = 0\n{limits}"
        )),
        kv_rule("pd", "prefill_decode"),
        prefill.endpoint_toml("prefill"),
    );
    for d in decodes {
        c.push_str(&decode_addr_toml(*d));
    }
    c
}

fn decode_addr_toml(addr: std::net::SocketAddr) -> String {
    format!("[[rules.endpoints]]\nurl = \"http://{addr}\"\nrole = \"decode\"\n\n")
}

fn decode_toml(e: &Engine) -> String {
    format!(
        "[[rules.endpoints]]\nurl = \"http://{}\"\nrole = \"decode\"\n\n",
        e.http
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_goes_by_kv_and_never_to_the_decode_endpoint() {
    let mut prefill = [Engine::start("prefill"), Engine::start("prefill")];
    let decode = Engine::start("decode");
    let config = format!(
        "{}{}{}{}{}",
        config_head("[health]\ninterval_ms = 0\n"),
        kv_rule("pd", "prefill_decode"),
        prefill[0].endpoint_toml("prefill"),
        prefill[1].endpoint_toml("prefill"),
        decode_toml(&decode)
    );
    // Cold traffic goes through `cold`; `gw` has never seen the prompt, so no
    // session or prefix-trie memory can decide for it: only KV-exact can.
    let cold = Gateway::start(&config);
    let gw = Gateway::start(&config);
    wait_subscribed(&cold).await;
    wait_subscribed(&gw).await;

    let p = prompt("pd", 120);
    let (status, v) = complete(&cold, &p, 4).await;
    assert_eq!(status, 200, "{v}");
    // The decode engine produced the whole output; the prefill ran max_tokens 1.
    assert_eq!(v["usage"]["completion_tokens"], 4, "{v}");
    let holder = eventually("one prefill endpoint holding the prompt", || async {
        let inv = inventory(&gw).await;
        assert_eq!(inv[2], 0, "the decode endpoint has no inventory");
        match (inv[0] > 0, inv[1] > 0) {
            (true, false) => Some(0),
            (false, true) => Some(1),
            _ => None,
        }
    })
    .await;

    let (status, v) = complete(&gw, &format!("{p} more"), 4).await;
    assert_eq!(status, 200, "{v}");
    let c = counters(&gw, "pd").await;
    assert_eq!(c["tiers"]["kv_exact"], 1, "{c}");
    assert_eq!(c["hits"][holder], 1, "{c}");
    assert_eq!(c["hits"][2], 0, "{c}");
    let eps = endpoints(&gw).await;
    // The prefill leg's own cached-token report is the receipt.
    assert!(
        eps[holder]["delivered_cached_tokens"].as_u64().unwrap() >= 16,
        "{:?}",
        eps[holder]
    );
    let metrics = metrics_text(&gw).await;
    assert!(
        metrics.contains("kvroute_prefill_requests_total 1"),
        "{metrics}"
    );

    // The holding prefill engine refuses connections: the next prefill endpoint
    // takes the prefill leg, never the decode endpoint.
    prefill[holder].proc.kill();
    let (status, v) = complete(&gw, &format!("{p} once more"), 4).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 4, "{v}");
    let c = counters(&gw, "pd").await;
    assert_eq!(c["retries"], 1, "{c}");
    let eps = endpoints(&gw).await;
    assert_eq!(eps[1 - holder]["receipts"], 1, "{:?}", eps[1 - holder]);
    assert_eq!(eps[2]["receipts"], 0, "{:?}", eps[2]);
    assert_eq!(c["hits"][2], 0, "{c}");
}

/// A P/D gateway over a prefill engine and a decode engine that holds its
/// requests until `gate` opens, subscribed to the prefill engine's events.
async fn held_decode_gateway() -> (Engine, Gate, HeldEngine, Gateway) {
    let prefill = Engine::start("prefill");
    let gate = Gate::new();
    let decode = held_engine(&gate).await;
    let gw = Gateway::start(&pd_config(&prefill, &[decode.addr], ""));
    wait_subscribed(&gw).await;
    (prefill, gate, decode, gw)
}

/// The prefill endpoint carries a P/D request only until its leg answers:
/// while the decode endpoint still works on the request (held here, as a
/// non-streamed decode is until its whole output is generated), the prefill
/// endpoint shows nothing in flight and the decode endpoint one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_prefill_endpoint_is_released_when_its_leg_answers() {
    let (_prefill, gate, decode, gw) = held_decode_gateway().await;
    let request = spawn_completion(&gw, "held");
    eventually("the decode leg reached its engine", || async {
        (decode.received.load(std::sync::atomic::Ordering::SeqCst) == 1).then_some(())
    })
    .await;
    assert_eq!(in_flight(&gw).await, (Some(0), Some(1)));
    gate.open();
    assert_eq!(request.await.unwrap().unwrap(), 200);
    assert_eq!(in_flight(&gw).await, (Some(0), Some(0)));
}

/// A decode endpoint that received the request and then gave no headers in
/// time may already have pulled the prefilled blocks, which the prefill
/// engine then frees: the retry on the other decode endpoint runs the
/// prefill leg again (fresh transfer parameters) instead of handing it the
/// same transfer. The prefill endpoint is charged for the second leg and
/// released when it answers; the decision's receipt is the first leg's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_retry_after_the_engine_got_the_request_runs_the_prefill_again() {
    let prefill = Engine::start("prefill");
    let gates = [Gate::new(), Gate::new()];
    let decode = [held_engine(&gates[0]).await, held_engine(&gates[1]).await];
    let config = pd_config(
        &prefill,
        &[decode[0].addr, decode[1].addr],
        "response_header_timeout_ms = 1500\n",
    );
    let gw = Gateway::start(&config);
    wait_subscribed(&gw).await;
    let request = spawn_completion(&gw, "spent");
    // One decode engine holds the first attempt until the gateway gives
    // up on it; the other then gets the retry, and both are let go.
    eventually("both decode engines got an attempt", || async {
        let got = |i: usize| decode[i].received.load(std::sync::atomic::Ordering::SeqCst);
        (got(0) == 1 && got(1) == 1).then_some(())
    })
    .await;
    for g in &gates {
        g.open();
    }
    assert_eq!(request.await.unwrap().unwrap(), 200);
    let metrics = metrics_text(&gw).await;
    assert!(
        metrics.contains("kvroute_prefill_requests_total 2"),
        "{metrics}"
    );
    let eps = endpoints(&gw).await;
    for e in &eps {
        assert_eq!(e["in_flight"], 0, "{e:?}");
    }
    // The receipt is the first leg's (the prompt was new there); the second
    // leg found it cached by the first.
    assert_eq!(eps[0]["receipts"], 1, "{:?}", eps[0]);
    assert_eq!(eps[0]["delivered_cached_tokens"], 0, "{:?}", eps[0]);
}

/// The prefill endpoint refuses a P/D request (an error status whose body
/// is still streaming): its answer goes to the client, and the decode
/// endpoint, which never gets the request, is released at once; the prefill
/// endpoint carries the request until its answer ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_prefill_leg_charges_the_decode_endpoint_nothing() {
    use axum::body::Body;
    use axum::http::Request;
    use axum::response::IntoResponse;
    let gate = Gate::new();
    let held = gate.clone();
    let app = axum::Router::new().fallback(move |req: Request<Body>| {
        let gate = held.clone();
        async move {
            let _ = axum::body::to_bytes(req.into_body(), 1 << 20).await;
            let chunks = futures_util::stream::unfold(0u8, move |step| {
                let gate = gate.clone();
                async move {
                    match step {
                        0 => Some((
                            Ok::<_, std::io::Error>(bytes::Bytes::from_static(b"{\"error\": ")),
                            1,
                        )),
                        1 => {
                            gate.hold(&std::sync::atomic::AtomicUsize::new(0)).await;
                            Some((Ok(bytes::Bytes::from_static(b"\"no\"}")), 2))
                        }
                        _ => None,
                    }
                }
            });
            (
                axum::http::StatusCode::BAD_REQUEST,
                [("content-type", "application/json")],
                Body::from_stream(chunks),
            )
                .into_response()
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let prefill = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let decode = held_engine(&Gate::new()).await;
    let config = format!(
        "{}[[rules]]\nname = \"pd\"\nmodels = [\"{MODEL}\"]\ndefault = true\nchoice = \"round_robin\"\ntopology = \"prefill_decode\"\n\n[[rules.endpoints]]\nurl = \"http://{prefill}\"\nrole = \"prefill\"\n\n{}",
        config_head("[health]\ninterval_ms = 0\n[limits]\nengine_load_poll_ms = 0\n"),
        decode_addr_toml(decode.addr)
    );
    let gw = Gateway::start(&config);
    let url = gw.url("/v1/completions");
    let (headers, got_headers) = tokio::sync::oneshot::channel();
    let request = tokio::spawn(async move {
        let body = serde_json::json!({"model": MODEL, "prompt": "refused", "max_tokens": 4});
        let r = client().post(url).json(&body).send().await.unwrap();
        let _ = headers.send(r.status().as_u16());
        r.text().await.unwrap()
    });
    // The refusal's headers reached the client; its body is still held.
    assert_eq!(got_headers.await.unwrap(), 400);
    assert_eq!(in_flight(&gw).await, (Some(1), Some(0)));
    gate.open();
    assert_eq!(request.await.unwrap(), "{\"error\": \"no\"}");
    assert_eq!(decode.received.load(std::sync::atomic::Ordering::SeqCst), 0);
    assert_eq!(in_flight(&gw).await, (Some(0), Some(0)));
}

/// A P/D request whose body cannot be split into the two legs (a key that
/// is a lone UTF-16 surrogate escape, which the gateway's own prompt parser
/// and Python's accept and serde_json refuses as a string): the decode
/// endpoint serves it whole, as a decode engine serves a request without
/// transfer parameters, and the prefill endpoint, which would run it as a
/// full generation, gets nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_cannot_be_split_goes_whole_to_the_decode_endpoint() {
    let (_prefill, gate, decode, gw) = held_decode_gateway().await;
    let body = format!(
        r#"{{"model": "{MODEL}", "prompt": "{}", "max_tokens": 4, "x_\ud800": 1}}"#,
        prompt("whole", 40)
    );
    let url = gw.url("/v1/completions");
    let request = tokio::spawn(async move {
        client()
            .post(url)
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .map(|r| r.status().as_u16())
    });
    eventually("the request reached the decode engine", || async {
        (decode.received.load(std::sync::atomic::Ordering::SeqCst) == 1).then_some(())
    })
    .await;
    assert_eq!(in_flight(&gw).await, (Some(0), Some(1)));
    gate.open();
    assert_eq!(request.await.unwrap().unwrap(), 200);
    let metrics = metrics_text(&gw).await;
    assert!(
        metrics.contains("kvroute_prefill_requests_total 0"),
        "{metrics}"
    );
}

/// A prefill endpoint that sends its answer's headers and then goes silent
/// (a hung engine, or one whose connection breaks mid-answer): the prefill
/// leg runs on the next prefill endpoint, as for a stall before the
/// headers, since nothing reached the client and the decode leg has not
/// started; the request is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_answer_cut_short_runs_the_prefill_on_the_next_endpoint() {
    use axum::body::Body;
    use axum::http::Request;
    use axum::response::IntoResponse;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let silent_calls = std::sync::Arc::new(AtomicUsize::new(0));
    let seen = std::sync::Arc::clone(&silent_calls);
    let app = axum::Router::new().fallback(move |req: Request<Body>| {
        let seen = std::sync::Arc::clone(&seen);
        async move {
            let _ = axum::body::to_bytes(req.into_body(), 1 << 20).await;
            seen.fetch_add(1, Ordering::SeqCst);
            let chunks = futures_util::stream::unfold(0u8, |step| async move {
                if step == 0 {
                    Some((
                        Ok::<_, std::io::Error>(bytes::Bytes::from_static(b"{\"choices\": ")),
                        1,
                    ))
                } else {
                    std::future::pending().await
                }
            });
            (
                [("content-type", "application/json")],
                Body::from_stream(chunks),
            )
                .into_response()
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    // Answers at once (the prefill leg, then the decode leg).
    let answering = || async {
        let app = axum::Router::new().fallback(|| async {
            axum::Json(serde_json::json!({"choices": [{"text": "ok"}],
                "kv_transfer_params": {"remote_port": 1},
                "usage": {"prompt_tokens": 5, "completion_tokens": 1}}))
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        addr
    };
    let (good, decode) = (answering().await, answering().await);
    let config = format!(
        "{}[[rules]]\nname = \"pd\"\nmodels = [\"{MODEL}\"]\ndefault = true\nchoice = \"round_robin\"\ntopology = \"prefill_decode\"\n\n\
         [[rules.endpoints]]\nurl = \"http://{silent}\"\nrole = \"prefill\"\n\n\
         [[rules.endpoints]]\nurl = \"http://{}\"\nrole = \"prefill\"\n\n{}",
        config_head(
            "[health]\ninterval_ms = 0\n[limits]\nengine_load_poll_ms = 0\nupstream_idle_timeout_ms = 300\n"
        ),
        good,
        decode_addr_toml(decode)
    );
    let gw = Gateway::start(&config);
    let mut statuses = Vec::new();
    for name in ["cut-a", "cut-b"] {
        statuses.push(spawn_completion(&gw, name).await.unwrap().unwrap());
    }
    assert_eq!(statuses, [200, 200]);
    // Each attempt on the silent endpoint ran the prefill again elsewhere.
    let cut = silent_calls.load(Ordering::SeqCst);
    assert!(cut >= 1);
    let metrics = metrics_text(&gw).await;
    let want = format!("kvroute_prefill_requests_total {}", 2 + cut);
    assert!(metrics.contains(&want), "{want}:\n{metrics}");
}
