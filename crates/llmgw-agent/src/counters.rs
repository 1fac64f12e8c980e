//! Counters that the discovery and the JetStream consumer keep in the hub state and `/metrics`
//! shows. They live here, apart from both, so that the hub holds them without importing the
//! modules that write them.

/// Why a discovered replica was refused: the `reason` label of
/// `llmgw_agent_discovery_refused_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// `/kv_event_sources` answered something discovery cannot use: not the expected JSON, an
    /// address that does not parse, port 0, or a publisher that connects out.
    Unparseable,
    /// It named a host other than the replica's own address.
    ForeignHost,
    /// It listed more than [`crate::discovery::MAX_RANKS`] ranks.
    TooManyRanks,
    /// Every replica id was in use (the engine was not added).
    IdsExhausted,
    /// `/v1/models` answered something the agent cannot use: not a model list, more than
    /// [`crate::served_models::MAX_MODEL_IDS`] ids, or an id empty or too long (the last list
    /// read stays).
    ModelList,
}

impl Refused {
    pub const ALL: [Refused; 5] =
        [Refused::Unparseable, Refused::ForeignHost, Refused::TooManyRanks, Refused::IdsExhausted, Refused::ModelList];

    pub fn label(self) -> &'static str {
        match self {
            Refused::Unparseable => "unparseable",
            Refused::ForeignHost => "foreign_host",
            Refused::TooManyRanks => "too_many_ranks",
            Refused::IdsExhausted => "ids_exhausted",
            Refused::ModelList => "model_list",
        }
    }
}

/// Refusals counted by reason.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RefusedCounts {
    unparseable: u64,
    foreign_host: u64,
    too_many_ranks: u64,
    ids_exhausted: u64,
    model_list: u64,
}

impl RefusedCounts {
    pub fn count(&mut self, reason: Refused) {
        let n = match reason {
            Refused::Unparseable => &mut self.unparseable,
            Refused::ForeignHost => &mut self.foreign_host,
            Refused::TooManyRanks => &mut self.too_many_ranks,
            Refused::IdsExhausted => &mut self.ids_exhausted,
            Refused::ModelList => &mut self.model_list,
        };
        *n = n.saturating_add(1);
    }

    pub fn get(&self, reason: Refused) -> u64 {
        match reason {
            Refused::Unparseable => self.unparseable,
            Refused::ForeignHost => self.foreign_host,
            Refused::TooManyRanks => self.too_many_ranks,
            Refused::IdsExhausted => self.ids_exhausted,
            Refused::ModelList => self.model_list,
        }
    }
}

/// Counters of the consuming side, shown in `/metrics`.
#[derive(Debug, Default, Clone)]
pub struct JetStreamCounters {
    /// Whether the consumer is connected and reading.
    pub connected: bool,
    pub sessions: u64,
    pub messages: u64,
    /// Messages on a subject no configured engine has (not applied).
    pub unknown_subject: u64,
    /// Messages without a readable `Llmgw-Seq` header (not applied).
    pub bad_header: u64,
    /// Hub-lock acquisitions that applied messages (messages / chunks = messages per lock).
    pub chunks: u64,
    /// Times the stream was found deleted, recreated or behind what was applied (every mirror
    /// read from JetStream was reset and read again).
    pub stream_replaced: u64,
}
