//! Hash plans: per (profile, model), how the request's blocks are hashed (the hashing the
//! profile pins, else what the replicas serving the model publish, else the defaults), which
//! replicas hash otherwise (never credited), and the note that says so for the log. A plan is
//! computed when a request first needs it after the replica table or the configuration
//! changed, never per request; the hashers themselves (with their digest memos) are kept per
//! profile, a few specs each.

use crate::config::{CompiledProfile, MemoSettings};
use crate::feed::FeedState;
use crate::hash::{BlockHasher, HashSpec};
use crate::index::ReplicaId;

/// Whether a plan's hashing can be used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlanStatus {
    /// Hash with the plan's spec; replicas in `mismatched` (if any) are not credited.
    Use,
    /// No replica serving the model hashes as the profile does: routing by the fallback.
    Mismatch,
    /// The settings cannot be hashed here (an algorithm this build lacks, xxhash unseeded).
    Unusable,
}

/// How a (profile, model) hashes, given the replica table.
#[derive(Debug, Clone)]
pub struct HashPlan {
    pub status: PlanStatus,
    pub spec: HashSpec,
    /// `spec.fingerprint()`: tokenizations cached under another hashing are not reused.
    pub fingerprint: u64,
    /// Replicas serving the model that hash otherwise.
    pub mismatched: Vec<ReplicaId>,
    /// What differs, naming both values (for the log), when anything does.
    pub note: Option<String>,
}

impl HashPlan {
    /// Computes the plan of `profile` for `model` over `feed`'s table: the profile's own
    /// settings first, then those of the first up replica serving the model that carries
    /// any, then the defaults.
    pub fn compute(profile: &CompiledProfile, feed: &FeedState, model: Option<&str>) -> HashPlan {
        let published: Vec<_> = feed
            .replicas
            .iter()
            .filter(|r| r.up && r.serves(model))
            .filter_map(|r| r.hash.as_ref().map(|h| (r, h)))
            .collect();
        let reference = published.iter().find_map(|(_, s)| s.as_ref().ok());
        let spec = profile.effective_spec(reference);
        let fingerprint = spec.fingerprint();
        if spec.block_size == 0 || spec.hasher().is_err() {
            return HashPlan { status: PlanStatus::Unusable, spec, fingerprint, mismatched: Vec::new(), note: None };
        }
        let mut mismatched = Vec::new();
        let mut notes = Vec::new();
        for (r, theirs) in &published {
            let diff = match theirs {
                Ok(t) if *t == spec => continue,
                Ok(t) => spec
                    .differences(t)
                    .into_iter()
                    .map(|(field, ours, theirs)| format!("{field} {theirs} (profile `{}` uses {ours})", profile.name))
                    .collect::<Vec<_>>()
                    .join(", "),
                Err(e) => format!("unusable settings ({e})"),
            };
            mismatched.push(r.id);
            notes.push(format!("replica `{}` rank {} ({}) hashes with {diff}", r.name, r.rank, r.address));
        }
        let all = !published.is_empty() && mismatched.len() == published.len();
        let note = (!notes.is_empty()).then(|| {
            let what = if all { "routing by the fallback" } else { "its blocks are not credited" };
            format!(
                "llmgw: hash settings mismatch for model `{}`: {}; {what}",
                model.unwrap_or("(none)"),
                notes.join("; ")
            )
        });
        let status = if all { PlanStatus::Mismatch } else { PlanStatus::Use };
        HashPlan { status, spec, fingerprint, mismatched, note }
    }
}

/// At most this many plans are kept (a catch-all profile sees whatever model names clients
/// send); past it they are all dropped and recomputed as needed.
const MAX_PLANS: usize = 256;

/// The plans of the current replica table and configuration.
#[derive(Debug, Default)]
pub struct Plans {
    /// (table version, configuration generation) the plans were computed under.
    under: (u64, u64),
    entries: Vec<((usize, Option<String>), HashPlan)>,
}

impl Plans {
    /// The plan of profile `pi` for `model`, computed if the table or configuration moved
    /// (`None` never happens in practice: the plan was just found or computed).
    pub fn get(
        &mut self,
        profile: (usize, &CompiledProfile),
        model: Option<&str>,
        feed: &FeedState,
        generation: u64,
    ) -> Option<&HashPlan> {
        let under = (feed.table_version, generation);
        if self.under != under || self.entries.len() >= MAX_PLANS {
            self.entries.clear();
            self.under = under;
        }
        let (pi, p) = profile;
        let found = self.entries.iter().position(|((i, m), _)| *i == pi && m.as_deref() == model);
        let at = match found {
            Some(at) => at,
            None => {
                self.entries.push(((pi, model.map(str::to_owned)), HashPlan::compute(p, feed, model)));
                self.entries.len().saturating_sub(1)
            }
        };
        self.entries.get(at).map(|(_, plan)| plan)
    }
}

/// Hashers kept per profile besides the one in use (a catch-all profile over models whose
/// replicas hash differently switches between them without losing their digest memos).
const HASHERS_PER_PROFILE: usize = 4;

/// The hashers of each profile, by spec, most recently used last.
#[derive(Default)]
pub struct Hashers {
    memo: Option<MemoSettings>,
    by_profile: Vec<Vec<(HashSpec, BlockHasher)>>,
}

impl Hashers {
    pub fn new(memo: Option<MemoSettings>) -> Hashers {
        Hashers { memo, by_profile: Vec::new() }
    }

    /// The hasher of profile `pi` for `spec` (built the first time), or `None` when `spec`
    /// cannot be hashed here.
    pub fn get(&mut self, pi: usize, spec: &HashSpec) -> Option<&mut BlockHasher> {
        if self.by_profile.len() <= pi {
            self.by_profile.resize_with(pi.saturating_add(1), Vec::new);
        }
        let memo = self.memo;
        let kept = self.by_profile.get_mut(pi)?;
        match kept.iter().position(|(s, _)| s == spec) {
            Some(i) => {
                let entry = kept.remove(i);
                kept.push(entry);
            }
            None => {
                let hasher = spec.hasher().ok()?;
                let hasher = match memo {
                    Some(m) => hasher.with_cache(m.slots, m.key),
                    None => hasher,
                };
                if kept.len() >= HASHERS_PER_PROFILE {
                    kept.remove(0);
                }
                kept.push((spec.clone(), hasher));
            }
        }
        kept.last_mut().map(|(_, h)| h)
    }
}
