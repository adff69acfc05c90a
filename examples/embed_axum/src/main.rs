//! `embed_axum LISTEN CONTRACT MODEL=DIR URL[,EVENTS[,REPLAY]]...`: the
//! embedding example as a program, e.g.
//! `embed_axum 127.0.0.1:9000 vllm@0.33.0:sha256_cbor:block=16:seed=0 qwen3=golden/tokenizers/qwen3 http://127.0.0.1:8000,tcp://*:5557,tcp://127.0.0.1:5558`.

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [listen, contract, model, endpoints @ ..] = args.as_slice() else {
        return Err("usage: embed_axum LISTEN CONTRACT MODEL=DIR URL[,EVENTS[,REPLAY]]...".into());
    };
    let (slug, dir) = model.split_once('=').ok_or("MODEL=DIR")?;
    let router = kvroute_embed_axum::router(contract, slug, dir, endpoints)?;
    let listener = tokio::net::TcpListener::bind(listen).await?;
    println!("embed_axum: listening on {}", listener.local_addr()?);
    kvroute_embed_axum::serve(listener, kvroute_embed_axum::app(router)).await?;
    Ok(())
}
