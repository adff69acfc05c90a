//! The extension crate's engine and scorer in the three hosts of the router
//! runtime: an embedded `KvRouter`, the gateway (registered by name and
//! named in its configuration) and the simulator. In each, every keyed
//! decision is the scorer's (the last eligible endpoint, which no built-in
//! scorer or selector prefers), and where engines publish events they reach
//! the inventory through the engine's own decoder.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use kvroute::{ApiKind, Backend, KvRouter, Source};
use kvroute_extensions::{LastCandidate, TaggedVllm};
use kvroute_testkit::{chat, client, model_dir, wait_until, Standin, CONTRACT, MODEL};

fn backend(engine: &Arc<TaggedVllm>, s: &Standin) -> Backend {
    Backend::new(engine.clone(), s.url())
        .events(format!("tcp://*:{}", s.zmq))
        .replay(format!("tcp://127.0.0.1:{}", s.replay))
}

async fn post(url: String, body: Bytes) -> (http::response::Parts, Bytes) {
    let req = http::Request::post(url)
        .header("content-type", "application/json")
        .body(Full::new(body))
        .unwrap();
    let resp = client().request(req).await.expect("answered");
    assert!(resp.status().is_success(), "{}", resp.status());
    let (head, body) = resp.into_parts();
    (head, body.collect().await.unwrap().to_bytes())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_an_embedded_router() {
    let engine = Arc::new(TaggedVllm::new("tagged-vllm"));
    let scorer = Arc::new(LastCandidate::default());
    let standins = [Standin::start(), Standin::start(), Standin::start()];
    let mut builder = KvRouter::builder(CONTRACT.parse().unwrap())
        .model(MODEL, model_dir())
        .scorer(scorer.clone());
    for s in &standins {
        builder = builder.endpoint(backend(&engine, s));
    }
    let router = builder.spawn().unwrap();
    let last = standins[2].url();
    for (turn, topic) in ["tide tables", "tide tables", "glaciers"]
        .iter()
        .enumerate()
    {
        let before = router.blocks(&last);
        let body = chat(topic, false);
        let pick = router.pick(ApiKind::Chat, &body).await.unwrap();
        assert_eq!(pick.url(), last, "turn {turn}: the scorer's choice");
        let repeat = turn == 1;
        assert_eq!(pick.decision().source(), Source::KvExact, "turn {turn}");
        assert_eq!(
            pick.decision().predicted_cached_tokens(router.block_size()) > 0,
            repeat,
            "turn {turn}: only the repeat finds cached blocks"
        );
        let url = format!("{}/v1/chat/completions", pick.url());
        let upstream = pick.upstream_body(&body);
        let req = http::Request::post(url)
            .header("content-type", "application/json")
            .body(Full::new(upstream))
            .unwrap();
        let resp = client().request(req).await.unwrap();
        let (head, incoming) = resp.into_parts();
        pick.into_body(&head.headers, incoming)
            .collect()
            .await
            .unwrap();
        // New blocks arrive through the engine's own decoder.
        if !repeat {
            wait_until("the stand-in's events", || router.blocks(&last) > before).await;
        }
    }
    assert_eq!(scorer.calls(), 3);
    assert!(engine.frames() >= 2, "frames {}", engine.frames());
    assert_eq!(router.blocks(&standins[0].url()), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_the_gateway_by_name() {
    let engine = Arc::new(TaggedVllm::new("tagged-vllm-gw"));
    let scorer = Arc::new(LastCandidate::default());
    use kvroute_gateway::gateway::extensions;
    extensions::register_engine(engine.clone()).unwrap();
    let shared = scorer.clone();
    extensions::register_scorer(
        "last-candidate",
        Arc::new(move || shared.clone() as kvroute::ScorerRef),
    )
    .unwrap();

    let standins = [Standin::start(), Standin::start()];
    let mut toml = format!(
        "listen = \"127.0.0.1:0\"\n[admin]\nlisten = \"127.0.0.1:0\"\n\
         [[models]]\nslug = \"{MODEL}\"\ndir = \"{}\"\n\
         [[rules]]\nname = \"r\"\nmodels = [\"{MODEL}\"]\ndefault = true\n\
         choice = \"kv_exact\"\ncontract = \"{CONTRACT}\"\nscorer = \"last-candidate\"\n",
        model_dir().display()
    );
    for s in &standins {
        toml.push_str(&format!(
            "[[rules.endpoints]]\nurl = \"{}\"\nengine = \"tagged-vllm-gw\"\n\
             zmq = \"tcp://*:{}\"\nreplay = \"tcp://127.0.0.1:{}\"\n",
            s.url(),
            s.zmq,
            s.replay
        ));
    }
    let config =
        kvroute_gateway::gateway::ServeConfig::from_toml(&toml, std::path::Path::new(".")).unwrap();
    let running = kvroute_gateway::gateway::start(&config).await.unwrap();
    let last = standins[1].url();
    let rule = running.gateway.rule("r").unwrap();
    for (turn, topic) in ["harbours", "harbours", "lighthouses"].iter().enumerate() {
        let before = rule.router.blocks(&last);
        let (head, _) = post(
            format!("http://{}/v1/chat/completions", running.proxy),
            chat(topic, false),
        )
        .await;
        let repeat = turn == 1;
        let endpoint = head.headers.get("x-kvroute-endpoint").unwrap();
        assert_eq!(endpoint.to_str().unwrap(), last);
        assert_eq!(head.headers.get("x-kvroute-tier").unwrap(), "kv_exact");
        let predicted: u64 = head.headers["x-kvroute-predicted-cached-tokens"]
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        assert_eq!(predicted > 0, repeat, "turn {turn}");
        if !repeat {
            wait_until("the stand-in's events", || {
                rule.router.blocks(&last) > before
            })
            .await;
        }
    }
    assert_eq!(scorer.calls(), 3);
    assert!(engine.frames() >= 2, "frames {}", engine.frames());
    // The admin API lists the rule with the host's names.
    let (_, listed) = get(format!("http://{}/admin/rules", running.admin)).await;
    let listed: serde_json::Value = serde_json::from_slice(&listed).unwrap();
    let text = listed.to_string();
    assert!(text.contains("\"scorer\":\"last-candidate\""), "{text}");
    assert!(text.contains("\"engine\":\"tagged-vllm-gw\""), "{text}");
    drop(rule);
    tokio::time::timeout(Duration::from_secs(30), running.shutdown())
        .await
        .unwrap();
}

async fn get(url: String) -> (http::response::Parts, Bytes) {
    let req = http::Request::get(url)
        .body(Full::new(Bytes::new()))
        .unwrap();
    let resp = client().request(req).await.expect("answered");
    assert!(resp.status().is_success(), "{}", resp.status());
    let (head, body) = resp.into_parts();
    (head, body.collect().await.unwrap().to_bytes())
}

#[test]
fn in_the_simulator() {
    use kvroute_engine_model::{CostModel, WorkerConfig};
    use kvroute_sim::fleet::{simulate, FleetConfig};
    use kvroute_sim::policy::{PolicySpec, Tuning};
    use kvroute_sim::workload::{generate, GenConfig, Kind};

    let workload = generate(&GenConfig {
        kind: Kind::Tenants,
        requests: 200,
        seed: 3,
        rate: 20.0,
    });
    let fleet = FleetConfig {
        workers: 4,
        worker: WorkerConfig {
            block_size: 64,
            capacity_blocks: 262_144 / 64,
            max_running: 64,
            cost: CostModel::default(),
            ..WorkerConfig::default()
        },
        event_delay_us: 0,
        event_loss: 0.0,
        seq_window: 64,
        seed: 1,
        concurrency: None,
        tuning: Tuning::default(),
        replicas: 2,
        load_poll_us: 0,
        replica_sync_us: 0,
        replica_stagger_us: 0,
        burst_order_us: 1000,
        peer_poll_us: 50_000,
    };
    let scorer = Arc::new(LastCandidate::default());
    let shared = scorer.clone();
    let report = simulate(
        &workload,
        &fleet,
        PolicySpec::Custom {
            name: "last-candidate".into(),
            scorer: Arc::new(move || shared.clone() as kvroute::ScorerRef),
        },
    )
    .unwrap();
    assert_eq!(report.policy, "last-candidate");
    assert_eq!(report.served, 200);
    // Every request had keys, so every decision was the scorer's, on both
    // replicas, and each went to the last worker.
    assert_eq!(scorer.calls(), 200);
    // All on one worker of four: the busiest got four times the mean.
    assert!(
        (report.load.routed_max_over_mean - 4.0).abs() < 1e-9,
        "{:?}",
        report.load
    );
}
