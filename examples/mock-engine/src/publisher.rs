//! ZeroMQ side of the mock engine: a PUB socket sending `[topic, seq_be8, payload]`
//! and a ROUTER replay socket answering `[b"", start_seq]` with the buffered
//! batches `[b"", topic, seq_be8, payload]` and the end marker
//! `[b"", b"", ff×8, b""]` (vLLM ≥ 0.26 / SGLang ≥ 0.5.22 framing).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use parking_lot::Mutex;
use tokio::sync::mpsc;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

/// One encoded batch waiting to be sent.
pub enum Outgoing {
    /// A payload and the sequence number it was given.
    Payload(u64, Bytes),
    /// Recreate the PUB socket (same port) and restart the sequence at 0, as a
    /// restarted engine process would. The reply fires once the new socket is bound.
    Restart(tokio::sync::oneshot::Sender<()>),
}

/// The sequence counter and the batches kept for replay, newest last.
///
/// Numbering and buffering happen when a batch is handed over (under the
/// engine's lock), so a replay request never misses a batch the engine already
/// produced, and the numbering follows the engine's event order.
#[derive(Default)]
pub struct ReplayBuffer {
    next_seq: u64,
    batches: VecDeque<(u64, Bytes)>,
    limit: usize,
}

impl ReplayBuffer {
    fn push(&mut self, seq: u64, payload: Bytes) {
        if self.limit == 0 {
            return;
        }
        while self.batches.len() >= self.limit {
            self.batches.pop_front();
        }
        self.batches.push_back((seq, payload));
    }
}

/// Handle to the running publisher.
#[derive(Clone)]
pub struct Publisher {
    tx: mpsc::UnboundedSender<Outgoing>,
    buffer: Arc<Mutex<ReplayBuffer>>,
    /// Port the PUB socket is bound to.
    pub port: u16,
    /// Port of the replay ROUTER, if any.
    pub replay_port: Option<u16>,
}

impl Publisher {
    /// Binds PUB on `127.0.0.1:pub_port` (0 = ephemeral) and, if given, the replay
    /// ROUTER on `replay_port`, then starts the send loop.
    pub async fn start(
        pub_port: u16,
        replay_port: Option<u16>,
        topic: String,
        buffer_steps: usize,
    ) -> anyhow::Result<Self> {
        let (socket, port) = bind_pub(pub_port).await?;
        let buffer = Arc::new(Mutex::new(ReplayBuffer {
            next_seq: 0,
            batches: VecDeque::new(),
            limit: buffer_steps,
        }));
        let topic = Bytes::from(topic);
        let replay_port = match replay_port {
            Some(p) => {
                let mut router = RouterSocket::new();
                let endpoint = router.bind(&format!("tcp://127.0.0.1:{p}")).await?;
                let bound = endpoint_port(&endpoint)?;
                tokio::spawn(serve_replay(router, Arc::clone(&buffer), topic.clone()));
                Some(bound)
            }
            None => None,
        };
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(send_loop(socket, port, rx, topic));
        Ok(Self {
            tx,
            buffer,
            port,
            replay_port,
        })
    }

    /// Numbers a payload with the next sequence number, buffers it for replay and
    /// queues it for the PUB socket.
    pub fn publish(&self, payload: Vec<u8>) {
        let payload = Bytes::from(payload);
        let seq = {
            let mut buffer = self.buffer.lock();
            let seq = buffer.next_seq;
            buffer.next_seq = seq.wrapping_add(1);
            buffer.push(seq, payload.clone());
            seq
        };
        if self.tx.send(Outgoing::Payload(seq, payload)).is_err() {
            tracing::warn!("mock engine publisher stopped; event batch dropped");
        }
    }

    /// Recreates the PUB socket with the sequence back at 0; resolves when done.
    pub async fn restart(&self) {
        {
            let mut buffer = self.buffer.lock();
            buffer.next_seq = 0;
            buffer.batches.clear();
        }
        let (done, wait) = tokio::sync::oneshot::channel();
        if self.tx.send(Outgoing::Restart(done)).is_ok() {
            let _ = wait.await;
        }
    }
}

fn endpoint_port(endpoint: &zeromq::Endpoint) -> anyhow::Result<u16> {
    match endpoint {
        zeromq::Endpoint::Tcp(_, port) => Ok(*port),
        other => anyhow::bail!("unexpected bound endpoint {other}"),
    }
}

async fn bind_pub(port: u16) -> anyhow::Result<(PubSocket, u16)> {
    let mut socket = PubSocket::new();
    let endpoint = socket.bind(&format!("tcp://127.0.0.1:{port}")).await?;
    let port = endpoint_port(&endpoint)?;
    Ok((socket, port))
}

async fn send_loop(
    mut socket: PubSocket,
    port: u16,
    mut rx: mpsc::UnboundedReceiver<Outgoing>,
    topic: Bytes,
) {
    while let Some(item) = rx.recv().await {
        match item {
            Outgoing::Payload(seq, payload) => {
                let frames = vec![
                    topic.clone(),
                    Bytes::copy_from_slice(&seq.to_be_bytes()),
                    payload,
                ];
                if let Ok(message) = ZmqMessage::try_from(frames) {
                    if let Err(e) = socket.send(message).await {
                        tracing::warn!(seq, error = %e, "KV event publish failed");
                    }
                }
            }
            Outgoing::Restart(done) => {
                drop(socket.close().await);
                socket = rebind_pub(port).await;
                let _ = done.send(());
            }
        }
    }
}

/// The old listener may linger for a moment after close; retry briefly.
async fn rebind_pub(port: u16) -> PubSocket {
    let mut delay = Duration::from_millis(5);
    for _ in 0..40 {
        match bind_pub(port).await {
            Ok((socket, _)) => return socket,
            Err(e) => {
                tracing::debug!(port, error = %e, "PUB rebind failed, retrying");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_millis(100));
            }
        }
    }
    tracing::warn!(port, "PUB rebind gave up; publishing on an unbound socket");
    PubSocket::new()
}

const REPLAY_END: [u8; 8] = [0xff; 8];

async fn serve_replay(mut router: RouterSocket, buffer: Arc<Mutex<ReplayBuffer>>, topic: Bytes) {
    loop {
        let request = match router.recv().await {
            Ok(m) => m.into_vec(),
            Err(e) => {
                tracing::debug!(error = %e, "replay ROUTER receive failed");
                continue;
            }
        };
        // [identity, b"", start_seq]
        let (Some(identity), Some(start)) = (request.first(), request.get(2)) else {
            continue;
        };
        let start = start
            .iter()
            .fold(0u64, |acc, &b| acc.wrapping_shl(8) | u64::from(b));
        let batches: Vec<(u64, Bytes)> = buffer
            .lock()
            .batches
            .iter()
            .filter(|(seq, _)| *seq >= start)
            .cloned()
            .collect();
        for (seq, payload) in batches {
            let frames = vec![
                identity.clone(),
                Bytes::new(),
                topic.clone(),
                Bytes::copy_from_slice(&seq.to_be_bytes()),
                payload,
            ];
            if let Ok(m) = ZmqMessage::try_from(frames) {
                if router.send(m).await.is_err() {
                    break;
                }
            }
        }
        let end = vec![
            identity.clone(),
            Bytes::new(),
            Bytes::new(),
            Bytes::copy_from_slice(&REPLAY_END),
            Bytes::new(),
        ];
        if let Ok(m) = ZmqMessage::try_from(end) {
            let _ = router.send(m).await;
        }
    }
}
