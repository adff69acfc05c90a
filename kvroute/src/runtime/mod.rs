//! The one runtime: [`KvRouter`] owns a pool's endpoint slots, their
//! inventories and event followers, breakers and health probes, the load
//! view (its own charges, the engines' reports, the other replicas' load),
//! LoRA extras and the rule that decides. The gateway hosts one per rule, the
//! simulator drives one with simulated time, an embedding proxy calls it
//! directly: all run this assembly.

mod background;
mod breaker;
mod builder;
mod followers;
mod outlier;
mod pick;
mod recycle;
pub(crate) mod replicas;
mod slots;
mod status;
#[cfg(test)]
mod test_support;
mod turn;
mod view;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kvroute_core::{BlockKey, EndpointId, HashContract, LoraAdapter};
use kvroute_engines::prompt::TokenizerPool;
use kvroute_engines::ApiKind;
use kvroute_ingest::{KeyAttestor, Keying, SharedIndex};
use kvroute_select::{
    ContractId, ContractKeys, CountersSnapshot, EngineReport, LoadTracker, ReportedLoad, Rule, Turn,
};
use parking_lot::{Mutex, RwLock};
use tokio::sync::watch;

use crate::admission::{TokenizeAdmission, TokenizeOverload};
use crate::clock::Clock;
use crate::prompt::{
    prepare_admitted, PreparedPrompt, PromptHost, PromptOptions, TokenIdCounters, TokenIdSnapshot,
};

pub use builder::{EngineLoadConfig, KvRouterBuilder, ProbeConfig};
pub use outlier::{HeaderTimeouts, Stall};
pub use pick::{NoEndpoint, Pick};
pub use replicas::{
    EndpointDelta, HostTransport, ReplicaBatch, ReplicaConfig, ReplicaCounters, ReplicaError,
    ReplicaSink, ReplicaSubscription, ReplicaTransport,
};
pub use status::{EndpointStatus, FollowerStatus, LoadPolls, Readiness, TokenizerState};

use slots::{Generation, SlotRuntime, SlotState};

/// Why a router could not be built or changed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BuildError {
    /// The contract has no prompt-side hasher here, or a KV-exact router has
    /// no contract.
    #[error("hash contract {contract}: {reason}")]
    Contract {
        /// The contract.
        contract: String,
        /// Why.
        reason: String,
    },
    /// The rule refused the configuration (P/D without a prefill or decode
    /// endpoint, ...).
    #[error(transparent)]
    Rule(#[from] kvroute_select::RuleError),
    /// An endpoint's events cannot be followed (bad endpoint string, llama.cpp,
    /// a transport this build lacks).
    #[error("endpoint {url}: {reason}")]
    Endpoint {
        /// The endpoint's URL.
        url: String,
        /// Why.
        reason: String,
    },
    /// A model directory has no usable tokenizer.
    #[error("model {model}: {reason}")]
    Model {
        /// The model slug.
        model: String,
        /// Why.
        reason: String,
    },
    /// More endpoints than [`KvRouterBuilder::max_endpoints`].
    #[error("at most {0} endpoints (KvRouterBuilder::max_endpoints)")]
    TooManyEndpoints(usize),
    /// An endpoint URL given twice, or removed without being present.
    #[error("endpoint {0}: {1}")]
    Membership(String, &'static str),
    /// Replica sharing could not start.
    #[error(transparent)]
    Replicas(#[from] ReplicaError),
    /// No tokio runtime to spawn background work on.
    #[error("spawn() must be called inside a tokio runtime (or use spawn_on / build)")]
    NoRuntime,
}

/// One change of the endpoint set, as tower's `discover::Change`.
#[derive(Clone, Debug)]
pub enum Change {
    /// A new endpoint: its inventory slot is allocated and its followers,
    /// probe and load poller start.
    Insert(crate::Backend),
    /// The endpoint with this URL leaves: its background work stops, its
    /// inventory is cleared, and it is never chosen again (requests in flight
    /// finish). A later endpoint may take its slot: nothing of this one
    /// reaches it — not its late event batches, probe verdicts or load
    /// reports, not the outcomes of requests decided for it (their retries
    /// never go to the newcomer), not the other replicas' load on it, nor
    /// its sessions, predicted entries, delivery evidence or reported
    /// inventory bound. Its requests still in flight count on its slot until
    /// they end: a newcomer in the slot meanwhile shows them as its load.
    Remove(String),
}

/// Settings of the rule the router rebuilds on every endpoint change.
struct Settings {
    name: String,
    topology: kvroute_select::Topology,
    choice: kvroute_select::Choice,
    scorer: kvroute_select::ScorerRef,
    fallback: kvroute_select::SelectorKind,
    thresholds: kvroute_select::Thresholds,
    predicted: kvroute_select::PredictedConfig,
    seed: u64,
    breaker: kvroute_select::BreakerConfig,
}

/// What the contract gives the prompt and ingest sides.
struct ContractSide {
    contract: Option<HashContract>,
    /// The contract's name as selection sees it (a host-named one when the
    /// host computes keys itself).
    id: Option<ContractId>,
    /// Prompt-side keys (a KV-exact router's contract).
    keys: Option<Arc<ContractKeys>>,
    block_size: u32,
    keying: Keying,
    attestor: Option<Arc<dyn KeyAttestor>>,
}

pub(crate) struct Shared {
    settings: Settings,
    contract: ContractSide,
    tokenizers: Arc<TokenizerPool>,
    models: Vec<(String, std::path::PathBuf)>,
    tokenizer_states: Mutex<Vec<(String, TokenizerState)>>,
    lora: HashMap<String, LoraAdapter>,
    admission: Arc<TokenizeAdmission>,
    overload: TokenizeOverload,
    tokenize_wait: Duration,
    options: PromptOptions,
    token_ids: TokenIdCounters,
    index: Arc<SharedIndex>,
    tracker: Arc<LoadTracker>,
    reported: ReportedLoad,
    replicas: Option<replicas_state::ReplicaState>,
    /// How long a request without a home waits in a burst
    /// ([`KvRouterBuilder::burst_order`]).
    burst_order: Duration,
    /// Decisions' buffers for the next requests.
    recycled: recycle::Recycled,
    slots: Box<[SlotState]>,
    /// The running endpoints by slot (touched by changes only).
    membership: Mutex<Vec<Option<SlotRuntime>>>,
    generation: RwLock<Arc<Generation>>,
    engine_load: Option<EngineLoadConfig>,
    probes: Option<ProbeConfig>,
    /// Outlier detection over the slots.
    outliers: outlier::Outliers,
    clock: Arc<dyn Clock>,
    handle: Option<tokio::runtime::Handle>,
    /// Turns `true` when the last router handle goes: every background task
    /// ends.
    stop: watch::Sender<bool>,
}

mod replicas_state;

impl Drop for Shared {
    fn drop(&mut self) {
        let _ = self.stop.send_replace(true);
        if let Some(r) = &self.replicas {
            r.retire(self);
        }
    }
}

pub(crate) fn id(slot: usize) -> EndpointId {
    EndpointId(u32::try_from(slot).unwrap_or(u32::MAX))
}

impl Shared {
    pub(crate) fn now(&self) -> Duration {
        self.clock.now()
    }

    fn current(&self) -> Arc<Generation> {
        Arc::clone(&self.generation.read())
    }

    /// A future that completes when the router stops.
    pub(crate) fn stopped(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut rx = self.stop.subscribe();
        async move {
            let _ = rx.wait_for(|s| *s).await;
        }
    }
}

impl PromptHost for Shared {
    fn tokenizers(&self) -> &TokenizerPool {
        &self.tokenizers
    }

    fn options(&self, model: Option<&str>) -> PromptOptions {
        let mut o = self.options.clone();
        o.extras.lora = model.and_then(|m| self.lora.get(m)).cloned();
        let g = self.current();
        o.dialect = g.dialect;
        o.engines.clone_from(&g.prompt_engines);
        o
    }
}

/// The KV-exact router a host keeps: decisions, inventories, event
/// followers, health, load accounting and replica sharing for one pool of
/// endpoints. Cheap to clone (one `Arc`); dropping the last clone stops
/// every background task.
#[derive(Clone)]
pub struct KvRouter {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for KvRouter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvRouter")
            .field("rule", &self.shared.settings.name)
            .field(
                "contract",
                &self
                    .shared
                    .contract
                    .contract
                    .as_ref()
                    .map(ToString::to_string),
            )
            .finish_non_exhaustive()
    }
}

impl KvRouter {
    /// A builder for a router whose prompt keys, block size, key mode,
    /// attestation and ingest all follow `contract`.
    pub fn builder(contract: HashContract) -> KvRouterBuilder {
        KvRouterBuilder::new(Some(contract))
    }

    /// A builder for a router without a hash contract: round robin or
    /// content affinity only (set [`KvRouterBuilder::choice`]).
    pub fn builder_without_contract() -> KvRouterBuilder {
        KvRouterBuilder::new(None)
    }

    /// A builder for a KV-exact router whose block keys the host computes
    /// itself under a contract it names (`contract`, `block_size` tokens per
    /// block): decisions come from [`KvRouter::pick_keys`], and the engines'
    /// events carry keys of the same contract, taken as they are (nothing to
    /// attest them against). The simulator runs its fleets this way.
    pub fn builder_for_keys(contract: impl Into<String>, block_size: u32) -> KvRouterBuilder {
        let mut b = KvRouterBuilder::new(None);
        b.host_keys = Some((contract.into(), block_size.max(1)));
        b
    }

    /// Decides where `body` (an OpenAI `api` request) goes: parses and
    /// tokenizes it on the blocking pool (bounded per request by the
    /// builder's prompt limits, across requests by its tokenization
    /// admission), hashes it under the contract, scores the inventories, and
    /// charges the chosen endpoint. Every prompt problem is a counted miss
    /// routed by the fallback, never an error.
    ///
    /// # Errors
    /// [`NoEndpoint`] when no endpoint is available.
    pub async fn pick(&self, api: ApiKind, body: &Bytes) -> Result<Pick, NoEndpoint> {
        self.pick_with(api, body, None).await
    }

    /// [`KvRouter::pick`] with a session id (P/D session affinity, CHWBL key).
    ///
    /// # Errors
    /// [`NoEndpoint`] when no endpoint is available.
    pub async fn pick_with(
        &self,
        api: ApiKind,
        body: &Bytes,
        session: Option<&str>,
    ) -> Result<Pick, NoEndpoint> {
        let mut prompt = self.prepare(api, body).await;
        self.take_turn(&mut prompt).await;
        self.pick_prepared(prompt, session)
    }

    /// The prompt step alone ([`crate::prompt::prepare_admitted`] under this
    /// router's options and admission), for a host that reads the prepared
    /// prompt before deciding (e.g. to choose among routers by its model).
    /// Outside a tokio runtime it runs on the caller's thread.
    pub async fn prepare(&self, api: ApiKind, body: &Bytes) -> PreparedPrompt {
        let shared = &self.shared;
        let handle = shared
            .handle
            .clone()
            .or_else(|| tokio::runtime::Handle::try_current().ok());
        match handle {
            Some(h) => {
                prepare_admitted(
                    shared,
                    &h,
                    &shared.admission,
                    shared.overload,
                    shared.tokenize_wait,
                    api,
                    body,
                )
                .await
            }
            None => crate::prompt::prepare(&**shared, api, body),
        }
    }

    /// The options of this router's prompt step for a request naming
    /// `model` (limits, the contract's keys, the LoRA extras, the engines'
    /// request dialect): what a host running [`crate::prompt::prepare`]
    /// itself passes, so its keys are this router's.
    #[must_use]
    pub fn prompt_options(&self, model: Option<&str>) -> PromptOptions {
        self.shared.options(model)
    }

    /// Decides for a prompt the host prepared (with
    /// [`KvRouter::prepare`] or [`KvRouter::prompt_options`]).
    ///
    /// # Errors
    /// [`NoEndpoint`] when no endpoint is available.
    pub fn pick_prepared(
        &self,
        prompt: PreparedPrompt,
        session: Option<&str>,
    ) -> Result<Pick, NoEndpoint> {
        Pick::decide(
            &self.shared,
            pick::Input::Prompt {
                prompt: Box::new(prompt),
                session: session.map(str::to_owned),
            },
            false,
        )
    }

    /// [`KvRouter::pick_prepared`] whose decision records its
    /// [`kvroute_select::Explanation`] (every endpoint's cached prefix and
    /// load as the pick saw them, each ladder step, the scorer's terms):
    /// read it with [`Pick::decision`] or take it with
    /// [`Pick::take_explanation`]. A plain pick records none and allocates
    /// nothing for it.
    ///
    /// # Errors
    /// [`NoEndpoint`] when no endpoint is available (its decision carries
    /// the explanation too).
    pub fn pick_explained(
        &self,
        prompt: PreparedPrompt,
        session: Option<&str>,
    ) -> Result<Pick, NoEndpoint> {
        Pick::decide(
            &self.shared,
            pick::Input::Prompt {
                prompt: Box::new(prompt),
                session: session.map(str::to_owned),
            },
            true,
        )
    }

    /// Decides for block keys the host computed under this router's
    /// contract (a simulator, a host that hashes itself); `prompt_tokens` is
    /// the prompt's length.
    ///
    /// # Errors
    /// [`NoEndpoint`] when no endpoint is available.
    pub fn pick_keys(&self, keys: &[BlockKey], prompt_tokens: u32) -> Result<Pick, NoEndpoint> {
        self.pick_keys_in_turn(keys, prompt_tokens, Turn::NONE)
    }

    /// [`KvRouter::pick_keys`] for a request held for its `turn`
    /// ([`KvRouter::turn`]; the host waited [`Turn::hold`]).
    ///
    /// # Errors
    /// [`NoEndpoint`] when no endpoint is available.
    pub fn pick_keys_in_turn(
        &self,
        keys: &[BlockKey],
        prompt_tokens: u32,
        turn: Turn,
    ) -> Result<Pick, NoEndpoint> {
        Pick::decide(
            &self.shared,
            pick::Input::Keys {
                keys: keys.to_vec(),
                prompt_tokens,
                turn,
            },
            false,
        )
    }

    /// A decision for a request without a prompt to route on (`/v1/models`,
    /// embeddings, ...): the rule's fallback selector picks, and the decision
    /// counts as a `no_model` miss. Its answer's body streams through
    /// unscanned ([`crate::receipt::BodyKind::Opaque`]): it settles no receipt.
    ///
    /// # Errors
    /// [`NoEndpoint`] when no endpoint is available.
    pub fn pick_unrouted(&self) -> Result<Pick, NoEndpoint> {
        let mut pick = self.pick_prepared(
            PreparedPrompt::missed(None, kvroute_select::MissReason::NoModel),
            None,
        )?;
        pick.unrouted = true;
        Ok(pick)
    }

    /// Applies one endpoint change. Only the changed endpoint's background
    /// work and inventory slot are touched; the rule is rebuilt over the new
    /// set, carrying its counters, predicted entries and measured prefill
    /// rates (decisions in flight keep theirs).
    ///
    /// # Errors
    /// [`BuildError`]: a duplicate or unknown URL, no free slot, an endpoint
    /// whose events cannot be followed; the set is unchanged then.
    pub fn apply(&self, change: Change) -> Result<(), BuildError> {
        slots::apply(&self.shared, change)
    }

    /// The URLs of the endpoints present, in slot order.
    #[must_use]
    pub fn endpoints(&self) -> Vec<String> {
        self.shared
            .membership
            .lock()
            .iter()
            .flatten()
            .map(|s| s.backend.url.clone())
            .collect()
    }

    /// The slot (rule endpoint id) of `url`, if present (a trailing `/` is
    /// ignored).
    #[must_use]
    pub fn endpoint_id(&self, url: &str) -> Option<EndpointId> {
        slots::slot_of(&self.shared, url).map(id)
    }

    /// Feeds one batch of engine events for endpoint `url` into its
    /// inventory (sequence window, attestation and all), for a host whose
    /// engine transport is its own (the simulator's in-memory engines).
    /// `false` when `url` is not present or keeps no inventory.
    pub fn ingest(&self, url: &str, batch: &kvroute_ingest::EventBatch) -> bool {
        slots::ingest(&self.shared, url, batch)
    }

    /// Records an engine's own load report for endpoint `url`, as the engine
    /// load poller does. `false` when `url` is not present.
    pub fn report_engine_load(&self, url: &str, report: EngineReport) -> bool {
        background::record_report(&self.shared, url, report)
    }

    /// [`KvRouter::ingest`] for the endpoint in slot `endpoint` (no lookup by
    /// URL: for hosts that feed many batches, as the simulator does).
    pub fn ingest_at(&self, endpoint: EndpointId, batch: &kvroute_ingest::EventBatch) -> bool {
        slots::ingest_slot(&self.shared, endpoint.index(), batch)
    }

    /// [`KvRouter::report_engine_load`] for the endpoint in slot `endpoint`.
    pub fn report_engine_load_at(&self, endpoint: EndpointId, report: EngineReport) {
        background::record_slot(&self.shared, endpoint.index(), report);
    }

    /// This replica's requests in flight on the endpoint in slot `endpoint`.
    #[must_use]
    pub fn in_flight_at(&self, endpoint: EndpointId) -> u32 {
        kvroute_select::Load::load(&*self.shared.tracker, endpoint).in_flight
    }

    /// Takes the replica outbox (changed endpoints; every endpoint when
    /// `full`) as a batch for the other replicas; `None` without replica
    /// sharing or when nothing changed. A host moving batches itself sends
    /// a `full` one more often than the replicas' TTL
    /// ([`ReplicaConfig::ttl`]): the others stop counting an endpoint no
    /// batch named for a TTL, as they stop counting a silent replica.
    #[must_use]
    pub fn drain_replica_batch(&self, full: bool) -> Option<ReplicaBatch> {
        self.shared.replicas.as_ref()?.drain(&self.shared, full)
    }

    /// Applies another replica's batch (counted, never an error).
    pub fn apply_replica_batch(&self, batch: &ReplicaBatch) {
        if let Some(r) = &self.shared.replicas {
            r.apply(&self.shared, batch);
        }
    }

    /// Replica sharing's counters (`None` without it).
    #[must_use]
    pub fn replica_counters(&self) -> Option<ReplicaCounters> {
        self.shared.replicas.as_ref().map(|r| r.counters())
    }

    /// The rule's counters: decisions, hits and misses by reason, predicted
    /// vs delivered cached tokens per endpoint (indexed by slot; see
    /// [`KvRouter::endpoint_id`]). They survive endpoint changes.
    #[must_use]
    pub fn counters(&self) -> CountersSnapshot {
        self.shared.current().rule.counters().snapshot()
    }

    /// The current rule (configuration, counters, prefill-rate estimates).
    #[must_use]
    pub fn rule(&self) -> Arc<Rule> {
        Arc::clone(&self.shared.current().rule)
    }

    /// The contract the router follows (`None` for a router without one).
    #[must_use]
    pub fn contract(&self) -> Option<&HashContract> {
        self.shared.contract.contract.as_ref()
    }

    /// The contract's identity as selection names it.
    #[must_use]
    pub fn contract_id(&self) -> ContractId {
        self.shared.current().rule.config().contract.clone()
    }

    /// Requests forwarded with token ids and kept as text by reason
    /// ([`KvRouterBuilder::forward_token_ids`]; all zero while it is off).
    #[must_use]
    pub fn token_id_counters(&self) -> TokenIdSnapshot {
        self.shared.token_ids.snapshot()
    }

    /// The bound on tokenizations across requests: its
    /// [`TokenizeAdmission::snapshot`] is what a host exports (in flight,
    /// peaks, admitted, overloaded).
    #[must_use]
    pub fn tokenize_admission(&self) -> &Arc<TokenizeAdmission> {
        &self.shared.admission
    }

    /// [`TokenizeAdmission::snapshot`] of [`KvRouter::tokenize_admission`].
    #[must_use]
    pub fn tokenize_counters(&self) -> crate::admission::AdmissionSnapshot {
        self.shared.admission.snapshot()
    }

    /// Whether completions prompts are forwarded as token ids
    /// ([`KvRouterBuilder::forward_token_ids`]).
    #[must_use]
    pub fn forwards_token_ids(&self) -> bool {
        self.shared.options.forward_token_ids
    }

    /// The tokenizer pool.
    #[must_use]
    pub fn tokenizers(&self) -> &Arc<TokenizerPool> {
        &self.shared.tokenizers
    }

    /// Tokens per block (the contract's; 16 without one).
    #[must_use]
    pub fn block_size(&self) -> u32 {
        self.shared.contract.block_size
    }

    /// The router's name.
    #[must_use]
    pub fn name(&self) -> &str {
        &self.shared.settings.name
    }

    /// The router's time (its clock's).
    #[must_use]
    pub fn now(&self) -> Duration {
        self.shared.now()
    }

    /// Sets endpoint `url` administratively down (drained: never chosen,
    /// requests in flight finish) or back up. `false` when not present.
    pub fn set_admin_down(&self, url: &str, down: bool) -> bool {
        slots::set_admin_down(&self.shared, url, down)
    }

    /// Whether the router routes: every model's tokenizer loaded, and how
    /// many endpoints are available and followed.
    #[must_use]
    pub fn readiness(&self) -> Readiness {
        status::readiness(&self.shared)
    }

    /// Waits until every tokenizer has loaded (or failed: see
    /// [`KvRouter::readiness`]).
    pub async fn ready(&self) -> Readiness {
        loop {
            let r = self.readiness();
            if r.tokenizers_settled() {
                return r;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Everything known about endpoint `url` (inventory, contract status,
    /// followers, breaker, probe, load, engine report, counters).
    #[must_use]
    pub fn endpoint_status(&self, url: &str) -> Option<EndpointStatus> {
        let slot = slots::slot_of(&self.shared, url)?;
        status::endpoint(&self.shared, slot)
    }

    /// [`KvRouter::endpoint_status`] of every endpoint present, in slot order.
    #[must_use]
    pub fn endpoint_statuses(&self) -> Vec<EndpointStatus> {
        let slots: Vec<usize> = self
            .shared
            .membership
            .lock()
            .iter()
            .enumerate()
            .filter(|(_, s)| s.is_some())
            .map(|(i, _)| i)
            .collect();
        slots
            .into_iter()
            .filter_map(|i| status::endpoint(&self.shared, i))
            .collect()
    }

    /// Blocks the inventory holds for endpoint `url` (0 when unknown).
    #[must_use]
    pub fn blocks(&self, url: &str) -> u64 {
        slots::slot_of(&self.shared, url).map_or(0, |i| self.shared.index.inventory(id(i)).total())
    }

    /// This replica's requests in flight on endpoint `url`.
    #[must_use]
    pub fn in_flight(&self, url: &str) -> u32 {
        slots::slot_of(&self.shared, url).map_or(0, |i| {
            kvroute_select::Load::load(&*self.shared.tracker, id(i)).in_flight
        })
    }

    /// Endpoint `url`'s event followers' metrics, one per DP rank (or its
    /// drain poller).
    #[must_use]
    pub fn subscriber_metrics(
        &self,
        url: &str,
    ) -> Vec<kvroute_engines::transport::MetricsSnapshot> {
        self.endpoint_status(url)
            .map(|s| s.followers.into_iter().map(|f| f.metrics).collect())
            .unwrap_or_default()
    }

    /// Heap bytes of the inventory index and the endpoints' ingest maps.
    #[must_use]
    pub fn memory_bytes(&self) -> usize {
        status::memory_bytes(&self.shared)
    }

    /// The URLs of the endpoints a request may go to now, least in flight
    /// first; endpoints with equal load start at a rotating offset (`turn`),
    /// so they take turns. With replicas, each starts its rotation from its
    /// rank ([`kvroute_select::Deciders::rotation_start`]), so replicas that
    /// count their turns alike do not send their first requests to the same
    /// endpoint. For requests a host forwards without a decision.
    #[must_use]
    pub fn available_by_load(&self, turn: usize) -> Vec<String> {
        let shared = &self.shared;
        let now = shared.now();
        let view = view::RouterView::new(shared, now);
        let deciders = shared
            .replicas
            .as_ref()
            .map_or(kvroute_select::Deciders::ALONE, |r| {
                r.remote().deciders(now)
            });
        let members = shared.membership.lock();
        let n = members.len().max(1);
        let start = usize::try_from(deciders.rotate(turn as u64, n as u64)).unwrap_or(0);
        let mut order: Vec<(u32, String)> = (0..members.len())
            .map(|k| start.wrapping_add(k) % n)
            .filter_map(|i| {
                let s = members.get(i)?.as_ref()?;
                kvroute_select::Health::availability(&view, id(i), now)
                    .is_available()
                    .then(|| {
                        let l = kvroute_select::Load::load(&view, id(i));
                        (l.in_flight, s.backend.url.clone())
                    })
            })
            .collect();
        order.sort_by_key(|(l, _)| *l);
        order.into_iter().map(|(_, u)| u).collect()
    }

    /// A request the host forwarded without a decision reached `url`
    /// (`true`) or failed to connect: feeds its circuit breaker as
    /// [`Pick::connected`] and [`Pick::retry`] do.
    pub fn record_connect(&self, url: &str, connected: bool) {
        slots::at_url(&self.shared, url, |slot, _| {
            if let Some(s) = self.shared.slots.get(slot) {
                if connected {
                    s.breaker.on_success();
                } else {
                    s.breaker.on_failure(self.shared.now());
                }
            }
        });
    }

    /// A request without a KV decision (pass-through) charged to `url`
    /// until the returned guard drops.
    #[must_use]
    pub fn charge_unrouted(&self, url: &str) -> Option<kvroute_select::LoadGuard> {
        let slot = slots::slot_of(&self.shared, url)?;
        let guard = self.shared.tracker.charge(
            kvroute_select::Target {
                endpoint: id(slot),
                decode: None,
            },
            0,
        );
        Some(guard)
    }

    fn assemble(
        b: KvRouterBuilder,
        handle: Option<tokio::runtime::Handle>,
    ) -> Result<KvRouter, BuildError> {
        slots::assemble(b, handle).map(|shared| KvRouter { shared })
    }
}
