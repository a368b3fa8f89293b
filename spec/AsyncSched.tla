----------------------------- MODULE AsyncSched -----------------------------
(***************************************************************************)
(* The scheduler's side of one request's KV connector lifecycle under      *)
(* asynchronous scheduling (AsyncScheduler; pipeline parallelism), as      *)
(* stage 03's commits code it (patches/03-connector-allocate): steps in    *)
(* flight, the in-flight fence (patch [00b.1 Don't free skipped blocks]),   *)
(* preemption of a request whose load failure is reported after its next   *)
(* step was scheduled (patch [00c.2 Preempt if a KV load failure]), load    *)
(* failures at any block with the recovery of                              *)
(* Scheduler._handle_invalid_blocks (patches                               *)
(* [00c.1 All sharers of a failed KV block],                                *)
(* [00c.3 Handle a failed sync KV load],                                    *)
(* [03.3 Allocate only the external blocks]) and the mark of a request    *)
(* whose load failed (patch [00c.4 No new KV load], or the rule that        *)
(* replaces it).                                                           *)
(*                                                                         *)
(* Modelled:                                                               *)
(*  - EngineCore.step_with_batch_queue's batch queue of depth D: Schedule  *)
(*    issues a step while fewer than D are in flight, UpdateFromOutput     *)
(*    processes the oldest step's output later (any interleaving: the      *)
(*    engine schedules first unless the oldest output is already done);    *)
(*  - one request: num_tokens, num_computed_tokens (advanced when a step   *)
(*    is scheduled), num_output_placeholders, its status;                  *)
(*  - the prefix cache of the request's tokens as the number of leading    *)
(*    blocks it holds (a hash chain: a lookup hits a prefix), and          *)
(*    SingleTypeKVCacheManager.num_cached_block;                           *)
(*  - the sliding window group's table as its leading null (skipped)       *)
(*    slots: null padding of external tokens (patch                        *)
(*    [03.3 Allocate only the external blocks]), remove_skipped_blocks    *)
(*    with or without the fence, can_recompute_from;                       *)
(*  - a connector that offers the same external tokens at every lookup     *)
(*    (the first Ext tokens of the prompt, past the local hit) and loads   *)
(*    them synchronously (inside the step) or asynchronously               *)
(*    (WAITING_FOR_REMOTE_KVS); a load fails at any of its blocks;         *)
(*  - preemption for memory (allocate_slots returned None because of       *)
(*    requests not modelled), bounded by MaxPreempts.                      *)
(*                                                                         *)
(* Abstracted away:                                                        *)
(*  - other requests: a step holds only this request's tokens; the token  *)
(*    budget is Chunk tokens per step; memory is never short except at    *)
(*    PreemptForMemory (block ids, ref counts, the free queue and         *)
(*    eviction are HybridKVAlloc's subject, not this module's);           *)
(*  - KV cache groups: the prefix cache is full attention's; the sliding  *)
(*    window group contributes only its null and skipped slots;           *)
(*  - a request preempted for memory is scheduled again only after its    *)
(*    steps in flight returned (as with AsyncScheduler's queue of two:    *)
(*    the schedule that preempts it issues no step of it);                *)
(*  - speculative decoding, aborts, connector saves, the load-failure     *)
(*    policy "fail", structured output.                                   *)
(*                                                                         *)
(* TLC checks it through spec/MCAsyncSched.tla, which adds the mutations   *)
(* (one protection of the code switched off) and the witnesses.            *)
(***************************************************************************)
EXTENDS Integers, Sequences

CONSTANTS
    D,            \* batch queue depth: steps in flight at most (1: Scheduler, 2: AsyncScheduler, more: pipeline parallelism)
    B,            \* block size in tokens
    W,            \* sliding window of the sliding window group, in tokens (counts the token itself)
    Chunk,        \* token budget of the request in one step (chunked prefill)
    PromptLen,    \* prompt tokens
    MaxLen,       \* the request finishes when it holds this many tokens (num_prompt_tokens + max_tokens)
    Ext,          \* the connector holds the first Ext tokens of the prompt (a multiple of B)
    LoadMode,     \* how the connector loads: "sync", "async", or "both" (its choice at each lookup)
    LoadsFail,    \* TRUE: every load fails (at a block the connector chooses), without bound
    MaxFailures,  \* load failures allowed in one behaviour when ~LoadsFail
    MaxPreempts,  \* preemptions for memory allowed in one behaviour
    MarkRule,     \* which failed loads mark the request (KVConnectorRequest.load_failed): "AnyFailure" (the code) or "NoValidToken" (the code without patch [00c.4 No new KV load]'s mark past block 0)
    Uncache,      \* TRUE (the code): a truncation also truncates num_cached_block (KVCacheManager.uncache_blocks); FALSE: the code without it
    ConnectorHMA  \* TRUE: the connector uses HMA (Scheduler.connector_uses_hma); FALSE: it declines (supports_hma_with_config False, or HMA off): a real block for every external token, as on vLLM 0.13.0

ASSUME /\ D \in Nat \ {0} /\ B \in Nat \ {0} /\ W \in Nat \ {0, 1}
       /\ Chunk \in Nat \ {0} /\ PromptLen \in Nat \ {0} /\ MaxLen > PromptLen
       /\ Ext \in Nat /\ Ext % B = 0 /\ Ext < PromptLen
       /\ LoadMode \in {"sync", "async", "both"} /\ LoadsFail \in BOOLEAN
       /\ MaxFailures \in Nat /\ MaxPreempts \in Nat
       /\ MarkRule \in {"NoValidToken", "AnyFailure"} /\ Uncache \in BOOLEAN
       /\ ConnectorHMA \in BOOLEAN

Min(a, b) == IF a < b THEN a ELSE b
Max(a, b) == IF a > b THEN a ELSE b
\* SlidingWindowManager.get_num_skipped_tokens(n): tokens no layer reads
\* again once n tokens are computed (token n reads n-W+1..n).
SkippedTokens(n) == Max(0, n - W + 1)
SkippedBlocks(n) == SkippedTokens(n) \div B
\* The engine's one step of this request that is in flight: its first
\* token `from`, the tokens it computes `n`, the external tokens it loads
\* synchronously `e` (from-e .. from-1), whether it samples a token, and
\* whether it computed on KV that a failed load left invalid.
Steps == [from : 0..MaxLen, n : 1..MaxLen, e : 0..Ext, sample : BOOLEAN,
          invalid : BOOLEAN]

VARIABLES
    status,    \* Request.status: "waiting" (or preempted), "loading" (WAITING_FOR_REMOTE_KVS), "running", "done"
    len,       \* Request.num_tokens: prompt plus output tokens appended
    computed,  \* Request.num_computed_tokens
    ph,        \* Request.num_output_placeholders (AsyncScheduler): tokens steps in flight will sample
    queue,     \* EngineCore.batch_queue: this request's steps in flight, oldest first
    discard,   \* KVConnectorRequest.discard_output: the outputs of the request's steps in flight are dropped (patch [00c.2 Preempt if a KV load failure])
    load,      \* the asynchronous load in flight: [from, e] (local hit tokens, external tokens), or NoLoad
    skip,      \* leading null slots of the sliding window table (null padding, or freed by remove_skipped_blocks)
    cached,    \* leading blocks of the request's tokens in the prefix cache (BlockPool hash chain)
    ncached,   \* SingleTypeKVCacheManager.num_cached_block of the request (blocks it published)
    mark,      \* KVConnectorRequest.load_failed: the request takes 0 external tokens
    failures,  \* load failures so far (bounded by MaxFailures unless LoadsFail)
    preempts,  \* preemptions for memory so far (bounded by MaxPreempts)
    emitted    \* TRUE once a token sampled on invalid KV was appended (read by NoInvalidOutput)

vars == <<status, len, computed, ph, queue, discard, load, skip, cached, ncached,
          mark, failures, preempts, emitted>>

NoLoad == [from |-> 0, e |-> 0]
\* Patch [00b.1 Don't free skipped blocks]: remove_skipped_blocks counts num_computed_tokens -
\* num_in_flight_tokens (the fence), not num_computed_tokens.
Fence == TRUE
\* Patch [00c.2 Preempt if a KV load failure]: a request whose load failure is reported after its next step
\* was scheduled is preempted and the outputs of its later steps are
\* dropped.
LatePreempt == TRUE
\* Patch [00c.2 Preempt if a KV load failure] resets the output placeholders of a request it preempts (the
\* outputs that would fill them are dropped).
ResetPlaceholders == TRUE
\* Patch [03.3 Allocate only the external blocks] with the one HMA decision (Scheduler.connector_uses_hma, which
\* configuration, allocation and the finish path read): only a connector
\* that uses HMA gets the null block for the external tokens its sliding
\* window skips; one that declines gets a real block for each, as on vLLM
\* 0.13.0 (the external tokens are allocated as new tokens, only the local
\* hit is null-padded).
PadExternal == ConnectorHMA
\* The null slots of a fresh sliding window table after a local hit of h
\* tokens and e external tokens.
FreshSkip(h, e) == IF PadExternal THEN SkippedBlocks(h + e) ELSE SkippedBlocks(h)
\* A request preempted for memory (or aborted) while the step of its
\* synchronous load is in flight: when that load fails, the step's output is
\* dropped, and those of its later steps in flight
\* (Scheduler.freed_blocks_of_loads_in_flight).
DropFreedOutput == TRUE
\* AsyncScheduler (output placeholders) for a queue deeper than one step.
Async == D > 1

\* Request.num_in_flight_tokens (patch [00b.1 Don't free skipped blocks]): the tokens the steps in flight
\* compute or load synchronously.
RECURSIVE SumInFlight(_)
SumInFlight(q) == IF q = <<>> THEN 0 ELSE Head(q).n + Head(q).e + SumInFlight(Tail(q))
InFlightTokens == SumInFlight(queue)
NumSampling(q) == Len(SelectSeq(q, LAMBDA s : s.sample))

\* KVCacheManager.can_recompute_from(t): the tokens from t on read no null
\* slot of the sliding window table.
CanRecomputeFrom(t) == SkippedBlocks(t) >= skip
\* Connector.get_num_new_matched_tokens for a lookup after a local hit of h
\* tokens: the same tokens at every lookup.
ExtOffer(h) == Max(0, Min(Ext, len - 1) - h)
LoadChoices(e) ==
    IF e = 0 THEN {FALSE}
    ELSE CASE LoadMode = "sync" -> {FALSE}
           [] LoadMode = "async" -> {TRUE}
           [] LoadMode = "both" -> {FALSE, TRUE}
\* The blocks a load of e tokens after h local tokens may fail at.
FailBlocks(h, e) == (h \div B)..((h + e) \div B - 1)
CanFail == LoadsFail \/ failures < MaxFailures
\* A failed load that affects the request marks it (patch [00c.4 No new KV load], the rule
\* "AnyFailure": always; the rule "NoValidToken": only when it leaves no
\* valid computed token, nc = 0).
\* The mark lasts until the request finishes.
Marked(nc) == mark \/ MarkRule = "AnyFailure" \/ nc = 0

\* BlockPool.cache_full_blocks through KVCacheManager.cache_blocks(n):
\* publishes blocks ncached .. n div B - 1; the prefix cache's hash chain
\* grows only where it reaches them.
CachedAfter(n) ==
    IF n \div B > ncached /\ cached >= ncached THEN Max(cached, n \div B) ELSE cached
NCachedAfter(n) == Max(ncached, n \div B)

Init ==
    /\ status = "waiting" /\ len = PromptLen /\ computed = 0 /\ ph = 0
    /\ queue = <<>> /\ discard = FALSE /\ load = NoLoad /\ skip = 0
    /\ cached = 0 /\ ncached = 0 /\ mark = FALSE /\ failures = 0
    /\ preempts = 0 /\ emitted = FALSE

-----------------------------------------------------------------------------
(* Actions, each named after the vLLM method it stands for. *)

\* A step of n tokens from `from` on (after e external tokens it loads):
\* it samples a token when it reaches the request's last token; the
\* scheduler adds an output placeholder when it reaches the placeholders
\* too (AsyncScheduler._update_after_schedule).
Issue(from, n, e) ==
    /\ queue' = Append(queue, [from |-> from, n |-> n, e |-> e,
                               sample |-> from + n >= len, invalid |-> FALSE])
    /\ computed' = from + n
    /\ ph' = IF Async /\ from + n = len + ph THEN ph + 1 ELSE ph

\* Scheduler.schedule, running loop: the next step of a running request
\* (KVCacheManager.allocate_slots: remove_skipped_blocks first, with the
\* fence of patch [00b.1 Don't free skipped blocks] counting num_computed_tokens - num_in_flight_tokens;
\* cache_blocks of the tokens scheduled). AsyncScheduler skips a request
\* whose steps in flight already reach max_tokens.
ScheduleRunning ==
  /\ status = "running" /\ Len(queue) < D
  /\ ~(ph > 0 /\ computed + 2 - ph >= MaxLen)
  /\ LET n == Min(Chunk, len + ph - computed)
         fence == IF Fence THEN computed - InFlightTokens ELSE computed
     IN  /\ n > 0
         /\ Issue(computed, n, 0)
         /\ skip' = Max(skip, SkippedBlocks(fence))
         /\ cached' = CachedAfter(Min(computed + n, len))
         /\ ncached' = NCachedAfter(Min(computed + n, len))
  /\ UNCHANGED <<status, len, discard, load, mark, failures, preempts, emitted>>

\* Scheduler.schedule, waiting loop: a request with nothing computed looks
\* up the prefix cache (KVCacheManager.get_computed_blocks) and the
\* connector (get_num_new_matched_tokens; patch [00c.4 No new KV load]: 0 tokens if it is
\* marked), then allocate_slots (a fresh sliding window table is null for
\* the tokens skipped before its first computed token, patch [03.3 Allocate only the external blocks]) and
\* update_state_after_alloc. A synchronous load runs inside the step; an
\* asynchronous one makes it WAITING_FOR_REMOTE_KVS, its tokens counted as
\* computed (KVConnectorRequest.num_computed_tokens_after_recving). A request back from an
\* asynchronous load resumes after its computed tokens. A request in
\* discard_output is skipped (patch [00c.2 Preempt if a KV load failure]), and one preempted for
\* memory waits for its steps in flight (see the header).
ScheduleWaiting ==
  /\ status = "waiting" /\ queue = <<>> /\ ~discard
  /\ IF computed = 0
     THEN LET h == Min(cached, (len - 1) \div B) * B
              e == IF mark THEN 0 ELSE ExtOffer(h)
          IN  \E async \in LoadChoices(e) :
              IF async
              THEN /\ status' = "loading"
                   /\ computed' = h + e
                   /\ load' = [from |-> h, e |-> e]
                   /\ skip' = FreshSkip(h, e)
                   /\ ncached' = h \div B
                   /\ UNCHANGED <<len, ph, queue, cached>>
              ELSE LET n == Min(Chunk, len - h - e)
                   IN  /\ status' = "running"
                       /\ Issue(h + e, n, e)
                       /\ skip' = FreshSkip(h, e)
                       /\ cached' = Max(cached, Min(h + e + n, len) \div B)
                       /\ ncached' = Min(h + e + n, len) \div B
                       /\ UNCHANGED <<len, load>>
     ELSE LET n == Min(Chunk, len - computed)
          IN  /\ status' = "running"
              /\ Issue(computed, n, 0)
              /\ skip' = Max(skip, SkippedBlocks(computed))
              /\ cached' = CachedAfter(Min(computed + n, len))
              /\ ncached' = NCachedAfter(Min(computed + n, len))
              /\ UNCHANGED <<len, load>>
  /\ UNCHANGED <<discard, mark, failures, preempts, emitted>>

\* Scheduler.schedule, running loop: allocate_slots returned None (blocks
\* taken by requests not modelled); Scheduler._preempt_request frees the
\* tables and resets num_computed_tokens. Its steps in flight stay in the
\* queue; their outputs are processed as usual.
PreemptForMemory ==
  /\ status = "running" /\ preempts < MaxPreempts
  /\ status' = "waiting" /\ computed' = 0 /\ skip' = 0 /\ ncached' = 0
  /\ preempts' = preempts + 1
  /\ UNCHANGED <<len, ph, queue, discard, load, cached, mark, failures, emitted>>

\* The output of step s appended to the request (Scheduler.update_from_output,
\* AsyncScheduler._update_request_with_output): the sampled token (inv:
\* computed on KV a failed load left invalid) and, for a running request,
\* cache_blocks of its computed tokens; the request finishes at MaxLen
\* (Scheduler._free_request drops its mark). c: the prefix cache before.
Appended(s, inv, c) ==
  IF s.sample
  THEN /\ len' = len + 1
       /\ ph' = IF Async THEN ph - 1 ELSE ph
       /\ emitted' = (emitted \/ inv)
       /\ IF len + 1 = MaxLen
          THEN /\ status' = "done" /\ computed' = 0 /\ skip' = 0
               /\ ncached' = 0 /\ mark' = FALSE /\ cached' = c
          ELSE /\ cached' = IF status = "running" /\ cached = c
                            THEN CachedAfter(computed - ph') ELSE c
               /\ ncached' = IF status = "running"
                             THEN NCachedAfter(computed - ph') ELSE ncached
               /\ UNCHANGED <<status, computed, skip, mark>>
  ELSE /\ cached' = c
       /\ UNCHANGED <<status, len, computed, ph, skip, ncached, mark, emitted>>

\* Scheduler.update_from_output of the oldest step in flight, its
\* synchronous load (if any) successful. A request in
\* discard_output drops the output (patch [00c.2 Preempt if a KV load failure]) and leaves it
\* when its last step in flight returned; the output of a finished request
\* is dropped (the request is gone); otherwise the output is appended
\* (also for a request preempted for memory meanwhile).
UpdateFromOutput ==
  /\ queue # <<>>
  /\ LET s == Head(queue) IN
     /\ s.e = 0 \/ ~LoadsFail
     /\ queue' = Tail(queue)
     /\ IF discard \/ status = "done"
        THEN /\ discard' = (discard /\ Tail(queue) # <<>>)
             /\ UNCHANGED <<status, len, computed, ph, skip, cached, ncached, mark,
                            emitted>>
        ELSE /\ Appended(s, s.invalid, cached)
             /\ UNCHANGED discard
  /\ UNCHANGED <<load, failures, preempts>>

\* Scheduler.update_from_output with invalid_block_ids: the synchronous
\* load of the oldest step failed from block j on
\* (Scheduler._handle_invalid_blocks, policy "recompute"). The invalid
\* blocks and those after them leave the prefix cache. A running request
\* truncates its computed tokens to block j, the tokens it had before its
\* steps in flight (patch [00c.3 Handle a failed sync KV load]), or to 0 if can_recompute_from says so
\* (patch [03.3 Allocate only the external blocks]); patch [00c.4 No new KV load] (MarkRule) marks it. With later steps
\* in flight it is preempted: their outputs are dropped (patch [00c.2 Preempt if a KV load failure],
\* KVConnectorRequest.discard_output), its placeholders reset; one that must start
\* over and cannot recompute from 0 is preempted too; otherwise it is
\* truncated in place (patch [00c.1 All sharers of a failed KV block], Uncache: num_cached_block truncated too, so
\* the blocks it computes again are published again). Either way
\* its step's output is skipped
\* (failed_kv_load_req_ids). A request preempted for memory while the step
\* was in flight holds no block; its blocks from block j on leave the
\* prefix cache all the same, it is marked, the step's output is dropped,
\* and those of its later steps in flight too (discard_output), its
\* placeholders reset (DropFreedOutput).
SyncLoadFailedAt(j) ==
  /\ queue # <<>> /\ Head(queue).e > 0 /\ CanFail
  /\ j \in FailBlocks(Head(queue).from - Head(queue).e, Head(queue).e)
  /\ LET s == Head(queue)
         t == j * B
         nc == IF CanRecomputeFrom(t) THEN t ELSE 0
         later == Tail(queue) # <<>> /\ LatePreempt
         tainted == [i \in 1..Len(Tail(queue)) |-> [Tail(queue)[i] EXCEPT !.invalid = TRUE]]
     IN
     /\ failures' = IF LoadsFail THEN failures ELSE failures + 1
     /\ IF discard \/ status = "done"
        THEN /\ queue' = Tail(queue)
             /\ discard' = (discard /\ Tail(queue) # <<>>)
             /\ cached' = Min(cached, j)
             /\ UNCHANGED <<status, len, computed, ph, skip, ncached, mark, emitted>>
        ELSE IF status = "running"
        THEN /\ queue' = tainted
             /\ cached' = Min(cached, j)
             /\ mark' = Marked(nc)
             /\ IF later \/ ~CanRecomputeFrom(nc)
                THEN /\ status' = "waiting" /\ computed' = 0 /\ skip' = 0
                     /\ ncached' = 0
                     /\ ph' = IF later /\ ResetPlaceholders THEN 0 ELSE ph
                     /\ discard' = later
                ELSE /\ computed' = nc
                     /\ ncached' = IF Uncache THEN Min(ncached, nc \div B) ELSE ncached
                     /\ UNCHANGED <<status, skip, ph, discard>>
             /\ UNCHANGED <<len, emitted>>
        ELSE IF DropFreedOutput
        THEN /\ queue' = Tail(queue)
             /\ discard' = (Tail(queue) # <<>>)
             /\ cached' = Min(cached, j)
             /\ mark' = TRUE
             /\ ph' = 0
             /\ UNCHANGED <<status, len, computed, skip, ncached, emitted>>
        ELSE /\ queue' = tainted
             /\ Appended(s, TRUE, Min(cached, j))
             /\ UNCHANGED discard
  /\ UNCHANGED <<load, preempts>>
SyncLoadFailed == \E j \in 0..(Ext \div B) : SyncLoadFailedAt(j)

\* Scheduler._update_from_kv_xfer_finished (finished_recving) and
\* _update_waiting_for_remote_kv: the asynchronous load succeeded; its
\* blocks are published now (cache_blocks) and the request waits to be
\* scheduled after its computed tokens.
FinishLoad ==
  /\ status = "loading" /\ ~LoadsFail
  /\ status' = "waiting" /\ load' = NoLoad
  /\ cached' = CachedAfter(computed) /\ ncached' = NCachedAfter(computed)
  /\ UNCHANGED <<len, computed, ph, queue, discard, skip, mark, failures, preempts,
                 emitted>>

\* Scheduler._handle_invalid_blocks and _update_waiting_for_remote_kv: the
\* asynchronous load failed from block j on. The request resumes from
\* block j, publishing the valid blocks, or, when that is token 0 or
\* can_recompute_from says no, its blocks are freed and it starts over;
\* patch [00c.4 No new KV load] (MarkRule) marks it.
LoadFailedAt(j) ==
  /\ status = "loading" /\ CanFail
  /\ j \in FailBlocks(load.from, load.e)
  /\ LET t == j * B
         nc == IF CanRecomputeFrom(t) THEN t ELSE 0
     IN
     /\ failures' = IF LoadsFail THEN failures ELSE failures + 1
     /\ status' = "waiting" /\ load' = NoLoad /\ computed' = nc
     /\ mark' = Marked(nc)
     /\ IF nc > 0
        THEN /\ cached' = CachedAfter(nc) /\ ncached' = NCachedAfter(nc)
             /\ UNCHANGED skip
        ELSE /\ skip' = 0 /\ ncached' = 0
             /\ UNCHANGED cached
  /\ UNCHANGED <<len, ph, queue, discard, preempts, emitted>>
LoadFailed == \E j \in 0..(Ext \div B) : LoadFailedAt(j)

\* The request finished: the system stutters (no deadlock).
Terminated == status = "done" /\ queue = <<>> /\ UNCHANGED vars

Next ==
    \/ ScheduleRunning \/ ScheduleWaiting \/ PreemptForMemory
    \/ UpdateFromOutput \/ SyncLoadFailed \/ FinishLoad \/ LoadFailed
    \/ Terminated

Spec == Init /\ [][Next]_vars

\* The scheduler's actions are weakly fair; the connector reports every
\* asynchronous load (succeeded, or failed under LoadsFail) and every
\* synchronous failure under LoadsFail. Preemption for memory is not forced.
Fairness ==
    /\ WF_vars(ScheduleRunning) /\ WF_vars(ScheduleWaiting)
    /\ WF_vars(UpdateFromOutput) /\ WF_vars(FinishLoad)
    /\ WF_vars(LoadsFail /\ LoadFailed) /\ WF_vars(LoadsFail /\ SyncLoadFailed)
FairSpec == Spec /\ Fairness

-----------------------------------------------------------------------------
(* Properties. *)

TypeOK ==
    /\ status \in {"waiting", "loading", "running", "done"}
    /\ len \in PromptLen..MaxLen /\ computed \in 0..MaxLen /\ ph \in 0..MaxLen
    /\ queue \in Seq(Steps) /\ Len(queue) <= D
    /\ discard \in BOOLEAN /\ load \in [from : 0..MaxLen, e : 0..Ext]
    /\ skip \in 0..MaxLen /\ cached \in 0..MaxLen /\ ncached \in 0..MaxLen
    /\ mark \in BOOLEAN /\ failures \in 0..MaxFailures /\ preempts \in 0..MaxPreempts
    /\ emitted \in BOOLEAN
    /\ (status = "done" => ~mark)

\* The in-flight fence (patch [00b.1 Don't free skipped blocks]): no slot of the sliding window table that
\* a step in flight reads (the window of its first token) or writes (its
\* tokens, the external tokens it loads from its window on) is null or
\* freed while the request runs.
NoFreeInFlight ==
    status = "running" =>
        \A i \in 1..Len(queue) : skip <= SkippedBlocks(queue[i].from)

\* No token sampled by a step that computed on KV a failed load left
\* invalid is appended to the request (patch [00c.2 Preempt if a KV load failure]).
NoInvalidOutput == ~emitted

\* Every position a step in flight computes holds a token by the time the
\* step runs: a prompt or output token, or the token an earlier step in
\* flight samples (AsyncScheduler schedules num_tokens +
\* num_output_placeholders - num_computed_tokens tokens: a placeholder
\* that no step in flight fills is a position with no token).
PlaceholdersInFlight ==
    status = "running" =>
        \A i \in 1..Len(queue) :
            queue[i].from + queue[i].n <= len + NumSampling(SubSeq(queue, 1, i - 1))

\* Blocks computed again after a failure are published to the prefix
\* cache again: every full block of the tokens a running request has
\* scheduled, less the output placeholders, is in the prefix cache
\* (allocate_slots caches the tokens it schedules; AsyncScheduler caches
\* num_computed_tokens - num_output_placeholders when an output returns).
Republished == status = "running" => cached >= Min(computed - ph, len) \div B

\* A connector that declines HMA (ConnectorHMA FALSE) gets a real block for
\* every external token, as on vLLM 0.13.0: no slot of the sliding window
\* table that a load in flight writes (asynchronous: from its first
\* external token; synchronous: in a step in flight) is null.
RealExternalBlocks ==
    ~ConnectorHMA =>
        /\ status = "loading" => skip <= load.from \div B
        /\ \A i \in 1..Len(queue) :
              queue[i].e > 0 => skip <= (queue[i].from - queue[i].e) \div B

\* Every request finishes.
Liveness == <>(status = "done")

\* What the models check (async-sched, async-sched-pp, async-loads,
\* async-memory-preempt, sync-republish-fixed, async-loads-fail-any(-pp),
\* sync-loads-fail, declined-hma); the findings (async-memory-preempt-keep,
\* async-in-place-chunk, sync-republish, async-loads-fail) are where the
\* assumptions do not hold.
THEOREM Spec => [](TypeOK /\ NoFreeInFlight)
THEOREM Spec => []RealExternalBlocks
THEOREM Spec => []NoInvalidOutput
THEOREM (Uncache \/ LoadMode = "async") => (Spec => []Republished)
THEOREM (MarkRule = "AnyFailure" \/ D = 1) => (FairSpec => Liveness)
=============================================================================
