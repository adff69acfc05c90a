//! The host-facing driver: implement [`Proxy`] (connecting, load, health) and let
//! [`route`] run decide → connect → retry-with-exclusion.
//!
//! The shape follows pingora's `ProxyHttp` (one required method to reach the
//! upstream, a per-request context, defaulted phase hooks; a failed connect is
//! retryable and the framework asks for the next peer) and tower's `Load`. The
//! driver is `async` but needs no runtime of its own; hosts that want no driver
//! step a [`Decision`] themselves.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use kvroute_ingest::InventoryView;

use crate::decision::{Decision, Leg, Target};
use crate::endpoint::Endpoint;
use crate::health::Health;
use crate::keys::Request;
use crate::load::Load;
use crate::rule::Rule;
use crate::tracker::{LoadGuard, LoadTracker};

/// Why a connect attempt failed, as the host reports it.
#[derive(Debug)]
pub struct ConnectFailure<E> {
    /// Which endpoint of the target failed.
    pub leg: Leg,
    /// Whether another endpoint may be tried (refused / unreachable: yes;
    /// a malformed request: no).
    pub retryable: bool,
    /// The host's error.
    pub error: E,
}

/// A routed request: the host's connection, the decision behind it and the
/// request's charge on the host's [`LoadTracker`].
#[derive(Debug)]
pub struct Routed<C> {
    /// What [`Proxy::connect`] returned.
    pub connection: C,
    /// The decision (target, source, predicted overlap, keys).
    pub decision: Decision,
    /// Counts the request on its endpoint(s) since the decision; keep it with
    /// the response body and drop it when the body ends, errors or is dropped
    /// (call [`LoadGuard::first_byte`] when the first byte arrives).
    pub guard: LoadGuard,
}

/// Routing gave up.
#[derive(Debug, thiserror::Error)]
pub enum RouteError<E> {
    /// No eligible endpoint was left (all excluded, down, open, or retries spent).
    #[error("no eligible endpoint left")]
    NoEndpoint {
        /// The decision as it ended.
        decision: Box<Decision>,
    },
    /// The host reported a non-retryable connect failure.
    #[error("connect failed and is not retryable")]
    ConnectFailed {
        /// The decision as it ended.
        decision: Box<Decision>,
        /// The host's error.
        error: E,
    },
}

/// What a proxy host provides. Load and health come from the [`Load`] and
/// [`Health`] supertraits; the [`Load`] a host reports must include what its
/// [`Proxy::tracker`] counts (it may add engine-reported load on top).
pub trait Proxy: Load + Health {
    /// Per-request state of the host.
    type Ctx: Send;
    /// A connected upstream.
    type Connection;
    /// The host's connect error.
    type Error;

    /// The host's monotonic time.
    fn now(&self) -> Duration;

    /// The tracker that counts this rule's requests in flight: [`route`]
    /// charges the decision's target before the first connect and moves the
    /// charge on every retry.
    fn tracker(&self) -> &Arc<LoadTracker>;

    /// Connects to `target` (`endpoints` are the rule's, indexed by id).
    fn connect(
        &self,
        ctx: &mut Self::Ctx,
        target: Target,
        endpoints: &[Endpoint],
    ) -> impl Future<Output = Result<Self::Connection, ConnectFailure<Self::Error>>> + Send;

    /// Called once a decision exists, before the first connect.
    fn on_decision(&self, _ctx: &mut Self::Ctx, _decision: &Decision) {}

    /// Called on every connect failure, before the retry (e.g. to feed a
    /// circuit breaker).
    fn on_connect_failure(
        &self,
        _ctx: &mut Self::Ctx,
        _target: Target,
        _failure: &ConnectFailure<Self::Error>,
    ) {
    }

    /// Called by [`Proxy::complete`] with the backend's cached-token receipt.
    fn on_complete(&self, _ctx: &mut Self::Ctx, _decision: &Decision, _cached_tokens: Option<u32>) {
    }

    /// The request finished: records the delivery receipt (`cached_tokens` from
    /// `usage.prompt_tokens_details.cached_tokens`, if the backend sent it) and
    /// calls [`Proxy::on_complete`].
    fn complete(
        &self,
        rule: &Rule,
        ctx: &mut Self::Ctx,
        decision: &Decision,
        cached_tokens: Option<u32>,
    ) {
        if let Some(c) = cached_tokens {
            rule.record_receipt(decision, c);
        }
        self.on_complete(ctx, decision, cached_tokens);
    }
}

/// Decides, connects, and on retryable failures retries with the failed
/// endpoint excluded until a connection succeeds or nothing is eligible.
///
/// A minimal host (synchronous "connections", polled without a runtime):
///
/// ```
/// use std::future::Future;
/// use std::sync::Arc;
/// use std::time::Duration;
/// use kvroute_core::{BlockKey, EndpointId};
/// use kvroute_select::*;
///
/// struct Host { refused: EndpointId, tracker: Arc<LoadTracker> }
/// impl Load for Host {
///     fn load(&self, e: EndpointId) -> EndpointLoad { self.tracker.load(e) }
/// }
/// impl Health for Host {
///     fn availability(&self, _: EndpointId, _: Duration) -> Availability { Availability::Available }
/// }
/// impl Proxy for Host {
///     type Ctx = ();
///     type Connection = String;
///     type Error = &'static str;
///     fn now(&self) -> Duration { Duration::ZERO }
///     fn tracker(&self) -> &Arc<LoadTracker> { &self.tracker }
///     fn connect(&self, _: &mut (), t: Target, eps: &[Endpoint])
///         -> impl Future<Output = Result<String, ConnectFailure<&'static str>>> + Send {
///         let r = if t.endpoint == self.refused {
///             Err(ConnectFailure { leg: Leg::Endpoint, retryable: true, error: "refused" })
///         } else {
///             Ok(eps[t.endpoint.index()].address.clone())
///         };
///         std::future::ready(r)
///     }
/// }
///
/// let contract = ContractId::new("example/bs4");
/// let eps = vec![
///     Endpoint::new("a:1", Role::Both).with_inventory_slot(0),
///     Endpoint::new("b:1", Role::Both).with_inventory_slot(1),
/// ];
/// let rule = Rule::new(RuleConfig::kv_exact("r", Topology::Converged, eps, 4, contract.clone()), None).unwrap();
/// let mut inv = KeySetInventory::new(2);
/// inv.store(0, [BlockKey(1)]);
/// let keys = [BlockKey(1)];
/// let req = Request::new(PromptInput::Keys { keys: &keys, contract: &contract, prompt_tokens: 4 });
/// let host = Host { refused: EndpointId(0), tracker: Arc::new(LoadTracker::new(2)) };
///
/// let routed = block_on(route(&host, &rule, &inv, &req, &mut ())).unwrap();
/// assert_eq!(routed.connection, "b:1");
/// // Counted on the endpoint that answered, from the decision on.
/// assert_eq!(host.tracker.load(EndpointId(1)).in_flight, 1);
/// assert_eq!(host.tracker.load(EndpointId(0)).in_flight, 0);
/// host.complete(&rule, &mut (), &routed.decision, Some(0));
/// assert_eq!(rule.counters().snapshot().retries, 1);
/// drop(routed.guard); // the response body ended
/// assert_eq!(host.tracker.load(EndpointId(1)).in_flight, 0);
///
/// fn block_on<F: Future>(f: F) -> F::Output {
///     let mut f = std::pin::pin!(f);
///     let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
///     loop {
///         if let std::task::Poll::Ready(v) = f.as_mut().poll(&mut cx) { return v; }
///     }
/// }
/// ```
///
/// # Errors
/// [`RouteError`] when nothing eligible is left or a failure is not retryable.
pub async fn route<P, V>(
    proxy: &P,
    rule: &Rule,
    view: &V,
    request: &Request<'_>,
    ctx: &mut P::Ctx,
) -> Result<Routed<P::Connection>, RouteError<P::Error>>
where
    P: Proxy + Sync,
    V: InventoryView + Sync + ?Sized,
{
    let mut decision = rule.decide(request, view, proxy, proxy, proxy.now());
    proxy.on_decision(ctx, &decision);
    let block_size = rule.config().block_size;
    let mut guard: Option<LoadGuard> = None;
    loop {
        let Some(target) = decision.target() else {
            return Err(RouteError::NoEndpoint {
                decision: Box::new(decision),
            });
        };
        let prefill = decision.predicted_prefill_tokens(block_size);
        match guard.as_mut() {
            Some(g) => g.retarget(target, prefill),
            None => guard = Some(proxy.tracker().charge(target, prefill)),
        }
        match proxy.connect(ctx, target, rule.endpoints()).await {
            Ok(connection) => {
                let guard = match guard {
                    Some(g) => g,
                    None => proxy.tracker().charge(target, prefill),
                };
                return Ok(Routed {
                    connection,
                    decision,
                    guard,
                });
            }
            Err(failure) => {
                proxy.on_connect_failure(ctx, target, &failure);
                if !failure.retryable {
                    return Err(RouteError::ConnectFailed {
                        decision: Box::new(decision),
                        error: failure.error,
                    });
                }
                rule.retry(
                    &mut decision,
                    failure.leg,
                    request,
                    proxy,
                    proxy,
                    proxy.now(),
                );
            }
        }
    }
}
