//! `embed_pingora LISTEN CONTRACT MODEL=DIR URL[,EVENTS[,REPLAY]]...`: the
//! pingora embedding example as a program, e.g.
//! `embed_pingora 127.0.0.1:9000 vllm@0.33.0:sha256_cbor:block=16:seed=0 qwen3=golden/tokenizers/qwen3 http://127.0.0.1:8000,tcp://*:5557,tcp://127.0.0.1:5558`.

use kvroute::{Backend, KvRouter};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [listen, contract, model, endpoints @ ..] = args.as_slice() else {
        return Err(
            "usage: embed_pingora LISTEN CONTRACT MODEL=DIR URL[,EVENTS[,REPLAY]]...".into(),
        );
    };
    let (slug, dir) = model.split_once('=').ok_or("MODEL=DIR")?;
    let mut builder = KvRouter::builder(contract.parse()?).model(slug, dir);
    for e in endpoints {
        let mut parts = e.split(',');
        let mut backend = Backend::vllm(parts.next().unwrap_or_default());
        if let Some(events) = parts.next() {
            backend = backend.events(events);
        }
        if let Some(replay) = parts.next() {
            backend = backend.replay(replay);
        }
        builder = builder.endpoint(backend);
    }
    // Pingora runs its services on runtimes it owns; the router's event
    // subscribers and tokenizer pool run on this one, alive until exit.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let router = builder.spawn_on(runtime.handle().clone())?;
    let server = kvroute_embed_pingora::server(router, listen)?;
    println!("embed_pingora: serving on {listen}");
    server.run_forever()
}
