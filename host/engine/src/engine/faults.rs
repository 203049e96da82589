//! Test-only hooks (`fault-injection`): failures and device timing that
//! tests cause on purpose, to see that each stays with the requests it
//! concerns.

use super::{Engine, SeqId};

/// Test-only: how an injected fault fails a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The step panics.
    Panic,
    /// The step returns an error.
    Error,
}

impl Engine {
    /// Test-only: each main-lane step reports itself still running to the
    /// first `polls` checks after its launch, as a device's step would.
    pub fn hold_decode_steps(&mut self, polls: u32) {
        self.runner.hold_main(polls);
    }

    /// Test-only: corrupts `victim`'s mapping with one of `donor`'s pages.
    pub fn inject_page_fault(&mut self, victim: SeqId, donor: SeqId) -> bool {
        self.kv.corrupt_mapping(victim, donor, 0)
    }

    /// Test-only: the next step fails once it has scheduled its batch, as
    /// a bug (a panic) or a device (an error) inside a step would.
    pub fn inject_fault(&mut self, fault: Fault) {
        self.fault_next_step = Some(fault);
    }
}
