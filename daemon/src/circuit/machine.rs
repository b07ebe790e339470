//! The circuit's state machine: per target, the failure that opened it, the budget units
//! charged per class, and what a retry still needs.
//!
//! The life of a target (tool, resource, auth scope):
//! * closed: no failure on record; every call is allowed;
//! * a failed result opens it under the failure's class ([`Circuit::record_result`]);
//! * each later call on it is a retry, judged by [`Circuit::judge`] against the class's
//!   rule and budget, and charged when it goes out ([`Circuit::record_call`]);
//! * a successful result closes it again, except for the fail-closed classes (budget 0).
//!
//! Units are charged per (target, class) and never reset while the target stays open, so
//! a loop that alternates classes cannot retry forever. The rules per class are in
//! docs/tokencircuit.md, "Rules".

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use super::artifact::{receipt, DiagnosticArtifact, RECEIPTS};
use super::canonical::CanonicalArgs;
use super::class::FailureClass;
use super::classify::{classify, Outcome};
use super::evidence::Evidence;
use super::key::{EquivalenceKey, Target};
use super::policy::CircuitPolicy;
use super::registry::{pointed_text, AuthScopeSource};

/// A tool call as the model emitted it.
#[derive(Clone, Copy, Debug)]
pub struct ToolCall<'a> {
    pub id: &'a str,
    pub name: &'a str,
    /// The raw `arguments` string.
    pub arguments: &'a str,
}

/// The judgment of a call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The call may go out; `cost` budget units are charged when it does (0 on a closed
    /// target).
    Allow { cost: u32 },
    /// The call's key has no budget left (or its rule forbids the retry).
    Deny(Box<DiagnosticArtifact>),
}

/// What a read-after-write verifier found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Finding {
    /// The verifier returned data: the resource exists.
    Present,
    /// The verifier returned an empty result.
    Absent,
}

/// An open target.
#[derive(Clone, Debug)]
struct OpenState {
    key: EquivalenceKey,
    charged: BTreeMap<FailureClass, u32>,
    receipts: VecDeque<String>,
    failed_args: CanonicalArgs,
    /// Failures of the current class so far (the backoff's exponent).
    failures: u32,
    /// A transient retry before this instant is premature.
    not_before: Option<Instant>,
    /// A discovery step succeeded since the failure (missing_resource).
    discovered: bool,
    finding: Option<Finding>,
}

impl OpenState {
    fn charged(&self) -> u32 {
        self.charged
            .get(&self.key.error_class)
            .copied()
            .unwrap_or(0)
    }
}

/// A call seen, waiting for its result.
#[derive(Clone, Debug)]
struct Pending {
    target: Target,
    args: CanonicalArgs,
}

/// The circuit of one conversation.
#[derive(Clone, Debug)]
pub struct Circuit {
    policy: Arc<CircuitPolicy>,
    open: BTreeMap<Target, OpenState>,
    pending: HashMap<String, Pending>,
}

impl Circuit {
    pub fn new(policy: Arc<CircuitPolicy>) -> Self {
        Circuit {
            policy,
            open: BTreeMap::new(),
            pending: HashMap::new(),
        }
    }

    pub fn policy(&self) -> &CircuitPolicy {
        &self.policy
    }

    /// Judges a call emitted at `now` (`None`: unknown, no backoff check). Changes nothing.
    pub fn judge(&self, call: ToolCall<'_>, now: Option<Instant>) -> Verdict {
        let args = CanonicalArgs::of(call.arguments);
        let target = self.policy.registry.target(call.name, &args);
        let Some(state) = self.open.get(&target) else {
            return Verdict::Allow { cost: 0 };
        };
        let class = state.key.error_class;
        let budget = self.policy.budgets.of(class);
        let charged = state.charged();
        let over = |cost: u32| charged.saturating_add(cost) > budget;
        let deny = |why: String| Verdict::Deny(Box::new(self.artifact(state, true, why)));
        let premature = matches!((now, state.not_before), (Some(n), Some(nb)) if n < nb);
        match class {
            FailureClass::PermissionAuth => deny(
                "permission/auth failures are not retried: a paraphrased call runs as the same \
                 principal on the same resource; the auth or scope must change first"
                    .into(),
            ),
            FailureClass::InvariantViolation => deny(
                "an invariant was violated (or an unknown error followed a possible mutation): \
                 haltd fails closed and a human must look"
                    .into(),
            ),
            FailureClass::Validation if args == state.failed_args => deny(
                "the retry repeats the arguments that failed validation; only a structurally \
                 changed call may be retried"
                    .into(),
            ),
            FailureClass::MissingResource if args == state.failed_args && !state.discovered => {
                deny(
                    "the resource was not found and no discovery step resolved the identifier \
                     since"
                        .into(),
                )
            }
            FailureClass::AmbiguousEffect => self.judge_ambiguous(state, over(1)),
            FailureClass::Transient if premature && over(2) => deny(format!(
                "a transient retry before its backoff elapsed costs 2 units; {charged} of {budget} \
                 are used"
            )),
            FailureClass::Transient => Verdict::Allow {
                cost: 1 + u32::from(premature),
            },
            _ if over(1) => deny(format!(
                "the {class} budget of {budget} retries is used up ({charged} charged)"
            )),
            _ => Verdict::Allow { cost: 1 },
        }
        .check_budget(|cost| {
            over(cost).then(|| {
                self.artifact(
                    state,
                    true,
                    format!(
                        "the {class} budget of {budget} retries is used up ({charged} charged)"
                    ),
                )
            })
        })
    }

    fn judge_ambiguous(&self, state: &OpenState, over: bool) -> Verdict {
        let write = state.key.side_effect_boundary;
        let why = match (state.finding, write) {
            (None, true) => {
                "the write's outcome is unknown: it may have happened; no retry until a \
                 read-after-write verifier result confirms it did not"
            }
            (None, false) => {
                "the result was empty: a valid empty answer and a wrong query look the same \
                 until the verifier tells them apart"
            }
            (Some(Finding::Present), true) => {
                "the verifier found the write's effect: a retry would duplicate it"
            }
            (Some(Finding::Absent), false) => {
                "the verifier confirmed the empty result is valid: there is nothing to retry for"
            }
            (Some(Finding::Absent), true) | (Some(Finding::Present), false) if over => {
                "the ambiguous_effect budget is used up"
            }
            (Some(_), _) => return Verdict::Allow { cost: 1 },
        };
        Verdict::Deny(Box::new(self.artifact(state, true, why.into())))
    }

    /// Records a call that went out (or that the transcript shows went out), charging its
    /// retry cost; returns the verdict it was charged under.
    pub fn record_call(&mut self, call: ToolCall<'_>, now: Option<Instant>) -> Verdict {
        let verdict = self.judge(call, now);
        let args = CanonicalArgs::of(call.arguments);
        let target = self.policy.registry.target(call.name, &args);
        if let Some(state) = self.open.get_mut(&target) {
            let cost = match &verdict {
                Verdict::Allow { cost } => *cost,
                Verdict::Deny(_) => 1,
            };
            *state.charged.entry(state.key.error_class).or_insert(0) += cost;
            state.discovered = false;
            state.finding = None;
        }
        self.pending
            .insert(call.id.to_owned(), Pending { target, args });
        verdict
    }

    /// Records the result of call `call_id`, arrived at `arrived` (`None`: unknown, no
    /// backoff clock). `dispatched`: the call was delivered to the client. Returns the
    /// failure class, if it failed. A result for an unknown call is ignored.
    pub fn record_result(
        &mut self,
        call_id: &str,
        content: &str,
        arrived: Option<Instant>,
        dispatched: bool,
    ) -> Option<FailureClass> {
        let pending = self.pending.remove(call_id)?;
        let evidence = Evidence::read(content);
        let profile = self
            .policy
            .registry
            .profile(&pending.target.tool_name)
            .clone();
        let outcome = classify(&evidence, &profile, dispatched);
        self.observe_for_others(&pending.target.tool_name, &evidence, outcome);
        let Outcome::Failure {
            class,
            side_effect_boundary,
        } = outcome
        else {
            if self
                .open
                .get(&pending.target)
                .is_some_and(|s| !s.key.error_class.fails_closed())
            {
                self.open.remove(&pending.target);
            }
            return None;
        };
        let mut key = EquivalenceKey::new(&pending.target, class, side_effect_boundary);
        if let Some(AuthScopeSource::Result(pointer)) = &profile.auth_scope {
            let value = serde_json::from_str(content.trim()).ok();
            key.auth_scope = value.and_then(|v| pointed_text(&v, pointer));
        }
        let state = self
            .open
            .entry(pending.target.clone())
            .or_insert_with(|| OpenState {
                key: key.clone(),
                charged: BTreeMap::new(),
                receipts: VecDeque::new(),
                failed_args: pending.args.clone(),
                failures: 0,
                not_before: None,
                discovered: false,
                finding: None,
            });
        if state.key.error_class != class {
            state.failures = 0;
        }
        state.key = key;
        state.failed_args = pending.args;
        state.discovered = false;
        state.finding = None;
        if state.receipts.len() == RECEIPTS {
            state.receipts.pop_front();
        }
        state.receipts.push_back(receipt(content));
        let delay = self.policy.backoff.delay(state.failures, call_id);
        let wait = evidence.retry_after.map_or(delay, |ra| ra.max(delay));
        state.not_before = arrived
            .filter(|_| class == FailureClass::Transient)
            .map(|t| t + wait);
        state.failures += 1;
        Some(class)
    }

    /// A result of one tool may resolve another's open state: a verifier's finding for an
    /// ambiguous effect, or any success as the discovery step of a missing resource.
    fn observe_for_others(&mut self, tool: &str, evidence: &Evidence, outcome: Outcome) {
        if outcome != Outcome::Success {
            return;
        }
        let verified: Vec<String> = self
            .policy
            .registry
            .verified_by(tool)
            .map(str::to_owned)
            .collect();
        let finding = if evidence.empty {
            Finding::Absent
        } else {
            Finding::Present
        };
        for (target, state) in &mut self.open {
            if target.tool_name == tool {
                continue;
            }
            match state.key.error_class {
                FailureClass::AmbiguousEffect if verified.contains(&target.tool_name) => {
                    state.finding = Some(finding);
                }
                FailureClass::MissingResource => state.discovered = true,
                _ => {}
            }
        }
    }

    /// The artifacts of the open targets whose budget is used up (the fail-closed classes
    /// always).
    pub fn exhausted(&self) -> Vec<DiagnosticArtifact> {
        self.open
            .values()
            .filter(|s| s.charged() >= self.policy.budgets.of(s.key.error_class))
            .map(|s| self.artifact(s, true, exhausted_why(s.key.error_class)))
            .collect()
    }

    /// The artifacts of every open target, exhausted or not (the operator's view).
    pub fn open_artifacts(&self) -> Vec<DiagnosticArtifact> {
        self.open
            .values()
            .map(|s| {
                let budget = self.policy.budgets.of(s.key.error_class);
                let exhausted = s.charged() >= budget;
                self.artifact(s, exhausted, exhausted_why(s.key.error_class))
            })
            .collect()
    }

    fn artifact(&self, state: &OpenState, exhausted: bool, why: String) -> DiagnosticArtifact {
        let class = state.key.error_class;
        DiagnosticArtifact {
            equivalence_key: state.key.clone(),
            failure_class: class,
            next_action: class.next_action(),
            budget: self.policy.budgets.of(class),
            budget_exhausted: exhausted,
            retry_count: state.charged(),
            sample_receipts: state.receipts.iter().cloned().collect(),
            safety_justification: why,
            policy: self.policy.in_force(),
            tokens_saved: None,
        }
    }

    /// Units charged on a target per class (tests and the operator view).
    pub fn charged(&self) -> impl Iterator<Item = (&Target, FailureClass, u32)> + '_ {
        self.open
            .iter()
            .flat_map(|(t, s)| s.charged.iter().map(move |(c, n)| (t, *c, *n)))
    }
}

fn exhausted_why(class: FailureClass) -> String {
    match class {
        FailureClass::PermissionAuth => {
            "the principal lacks permission; retrying as the same principal cannot succeed"
        }
        FailureClass::InvariantViolation => "an invariant was violated: fail closed, page a human",
        FailureClass::Validation => "the one repair attempt failed validation too",
        FailureClass::MissingResource => "the retry after discovery did not find the resource",
        FailureClass::Transient => "the transient retries are used up",
        FailureClass::AmbiguousEffect => "the effect could not be reconciled",
    }
    .to_owned()
}

trait CheckBudget {
    fn check_budget(self, over: impl Fn(u32) -> Option<DiagnosticArtifact>) -> Self;
}

impl CheckBudget for Verdict {
    /// Turns an allowed retry whose cost would exceed the budget into a denial: whatever
    /// the class's rule said, the budget is the last word.
    fn check_budget(self, over: impl Fn(u32) -> Option<DiagnosticArtifact>) -> Self {
        match self {
            Verdict::Allow { cost } if cost > 0 => match over(cost) {
                Some(artifact) => Verdict::Deny(Box::new(artifact)),
                None => self,
            },
            other => other,
        }
    }
}
