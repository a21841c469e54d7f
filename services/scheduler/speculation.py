"""Speculative decoding, as the scheduler plans it (--speculative-config, shared/speculative.py).

A decoding request whose last token is known here (none of its tokens in flight) and whose worker
runs at most the config's disable_by_batch_size requests proposes up to num_speculative_tokens
tokens by prompt lookup over its prompt and output (propose_ngram), or, with a draft model, leaves
that many placeholders for the worker's draft to fill (services/worker/draft.py). Its item then
feeds its last token and the proposals (StepItem.draft_tokens); the worker samples every position and keeps the
proposals while each equals the token sampled before it (services/worker/speculation.py), so the
tokens are those of decoding one a step. KV blocks are reserved for all the item's tokens, and kept
after (the worker keeps them too: the refused proposals' slots are overwritten by the next steps,
and a block is registered in the prefix cache only once it holds known tokens).

With the plan pipeline: a speculating item's result says how many tokens came back, so the
request's next item cannot be planned before it (it waits out the plan in flight: a round trip
between its steps, which pipelining hides for the others). A request whose lookup finds nothing,
or whose proposals were all refused, backs off: it runs pipelined, one token a plan, for 2, 4 ...
up to MAX_WAIT plans, then waits one plan out to propose again (a draft's request counts its
back-off down in plans whose last token it knows too: the first after its refused proposals, and
every plan at pipeline depth 1; a lookup is tried again at once there, costing nothing). So a workload with nothing to quote
pays a round trip every MAX_WAIT steps, and one that quotes pays it on steps that make several tokens.
A draft model's request also proposes fewer tokens after a refusal and more after all were kept
(`_verified`: the number a verification costs in draft passes and rows follows what it gets back).
"""

from services.scheduler.request_state import RequestState, WorkerState
from shared.speculative import acceptance_bucket, propose_ngram

DRAFT_PLACEHOLDER = 0  # a proposal the worker's draft model makes (any id in the vocabulary: it is replaced)
MAX_WAIT = 16  # plans a request that found nothing to propose runs pipelined before it looks again


class Speculation:
    """SchedulerPolicy's speculation (a mixin: its state is the policy's: speculative, the spec_* totals)."""

    def _speculates_on(self, worker: WorkerState) -> bool:
        """Whether requests on this worker propose this plan (its batch small enough)."""
        config = self.speculative
        return config is not None and worker.speculates and len(worker.running) <= config.batch_limit

    def _proposal(self, worker: WorkerState, state: RequestState, computed: int, outputs: int,
                  budget: int) -> list[int]:
        """The tokens a decoding request whose last token is known proposes ([]: none, and it backs
        off), its KV holding `computed` tokens before its step: at most as many as its output limit
        leaves after the token the step samples anyway and the step's token budget left (`budget`),
        and only where the KV blocks for them are free (nothing is preempted for a proposal): those
        blocks are reserved."""
        config = self.speculative
        if config.proposed_by_worker and state.speculation_wait > 0:
            # A draft's proposals all refused: plain steps for a while (pipelined ones count down in
            # _waits_to_propose, these, with nothing in flight, here). A lookup costs nothing: it is
            # tried again at once, so that a quote is found as soon as it starts.
            state.speculation_wait -= 1
            return []
        most = min(state.draft_length or config.num_speculative_tokens, state.output_limit - outputs - 1, budget)
        if most <= 0:
            proposal = []
        elif config.proposed_by_worker:  # the worker's draft model writes its proposals over these
            proposal = [DRAFT_PLACEHOLDER] * most
        else:
            proposal = propose_ngram(state.prompt_token_ids + tuple(state.output_token_ids), most,
                                     config.prompt_lookup_min, config.lookup_max)
        needed = worker.blocks_for(computed + 1 + len(proposal)) - state.kv_blocks if proposal else 0
        if not proposal or needed > worker.kv_blocks_available:
            # (backed off whatever the reason: else, pipelined next plan, it would sit out every other one)
            self._back_off(state)
            return []
        if needed > 0:
            worker.take_blocks(needed)
            state.kv_blocks += needed
        return proposal

    def _waits_to_propose(self, state: RequestState) -> bool:
        """A pipelined request (its last token in flight) that has backed off long enough: it sits
        out this plan, so that its next one knows its last token and can propose. Counts its wait down."""
        if state.speculation_wait > 0:
            state.speculation_wait -= 1
            return False
        return True

    def _note_acceptance(self, state: RequestState) -> None:
        """A request that verified proposals ends: its share of them kept, into the per-request histogram."""
        if state.spec_proposed:
            counts = self.spec_request_acceptance
            counts[acceptance_bucket(state.spec_kept, state.spec_proposed)] += 1
            counts["spec_request_acceptance_permille_sum"] += round(1000 * state.spec_kept / state.spec_proposed)
            counts["spec_requests"] += 1
            state.spec_proposed = state.spec_kept = 0

    @staticmethod
    def _back_off(state: RequestState) -> None:
        state.speculation_misses += 1
        state.speculation_wait = min(2**state.speculation_misses, MAX_WAIT)

    def _verified(self, state: RequestState, kept: int) -> None:
        """A speculating item's answer: `kept` of its proposals were kept (its KV holds its last
        token and those); a request whose proposals were all refused backs off."""
        proposed = state.drafts_in_flight
        state.drafts_in_flight = 0
        state.computed += kept
        state.spec_proposed += proposed
        state.spec_kept += kept
        self.spec_drafts += 1
        self.spec_draft_tokens += proposed
        self.spec_accepted_tokens += kept
        if kept:
            state.speculation_misses = 0
        else:
            self._back_off(state)
        if self.speculative.proposed_by_worker:
            # How many a draft proposes next (transformers' assisted generation's "heuristic" schedule):
            # two more after all were kept, one fewer after any was refused, from 1 to the config's most.
            # Each proposal costs a draft pass and a row of the verifying step: a draft that proposes
            # badly comes down to one (two rows, the price of one on a CPU's float32 step, measured),
            # one that proposes well stays at the most.
            # (A proposal cut short by the output limit or the step's budget, all kept, leaves it as it was.)
            most = self.speculative.num_speculative_tokens
            length = state.draft_length or most
            if kept < proposed:
                state.draft_length = max(1, length - 1)
            elif proposed >= length:
                state.draft_length = min(most, length + 2)
