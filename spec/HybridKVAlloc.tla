--------------------------- MODULE HybridKVAlloc ---------------------------
(***************************************************************************)
(* Block allocation of vLLM's hybrid KV cache manager (HMA) with a KV      *)
(* connector, as on vLLM 0.13.0 ("Legacy") and as our patch series        *)
(* allocates it ("Series").                                                *)
(*                                                                         *)
(* Modelled:                                                               *)
(*  - one BlockPool of N physical blocks (ids 1..N) plus the null block   *)
(*    (id 0); per block its ref_cnt, its prefix-cache hash and whether a  *)
(*    connector transfer reads or writes it;                              *)
(*  - two KV cache groups drawing from that pool: "full" (full attention) *)
(*    and "swa" (sliding window of W tokens); both use block size B;      *)
(*  - requests as processes: prefix-cache lookup, connector hits loaded   *)
(*    synchronously (inside the step) or asynchronously                  *)
(*    (WAITING_FOR_REMOTE_KVS), load completion and failure, chunked      *)
(*    prefill, decode steps with optional draft (speculative) tokens that  *)
(*    slide the window, connector saves that outlive the step, preemption,*)
(*    abort, finish with a delayed free, eviction of cached blocks.       *)
(*                                                                         *)
(* Abstracted away:                                                        *)
(*  - token ids -> block hashes: every request has the same first Shared  *)
(*    tokens, so block i of group g hashes to <<g, i>> while it lies in   *)
(*    that prefix and to <<g, i, r>> after it (a preempted request can hit *)
(*    its own blocks again); the hash key carries the group, as vLLM's    *)
(*    BlockHashWithGroupId does;                                          *)
(*  - tensors -> nothing; a transfer is the set of blocks it touches;     *)
(*  - the free queue's LRU order -> a set: allocation takes the lowest    *)
(*    free uncached ids and any choice of cached (evictable) free blocks, *)
(*    a superset of what the LRU order allows;                            *)
(*  - the prefix cache keeps one block per hash (first writer wins);      *)
(*  - the scheduler's token budget is per request (Chunk); the batch,     *)
(*    the model runner and asynchronous scheduling are not modelled: a    *)
(*    request is not rescheduled, preempted or aborted while its step is  *)
(*    in flight, and GPU reads are ordered by the stream, so only         *)
(*    connector transfers run concurrently with the block manager;        *)
(*  - num_computed_tokens of a request waiting for an asynchronous load   *)
(*    already counts the external tokens (0.13.0 sets it when the load    *)
(*    finished); a failed load invalidates all of them and the request    *)
(*    restarts from its (possibly new) prefix-cache hit.                  *)
(*                                                                         *)
(* Every step sets `event` (action, request, blocks per group, args), so  *)
(* a behaviour can be replayed against the implementation.                *)
(***************************************************************************)
EXTENDS Naturals, Sequences, FiniteSets, TLC

CONSTANTS
    N,           \* physical blocks in the BlockPool, ids 1..N (0 is the null block)
    Req,         \* request ids (a symmetry set where prompts allow it)
    B,           \* block size in tokens, same for both KV cache groups
    W,           \* sliding window of the "swa" group, in tokens
    PromptLen,   \* prompt length of every request, in tokens
    MaxLen,      \* a request finishes when it holds this many tokens
    Shared,      \* leading tokens common to all prompts (prefix-cache sharing)
    Chunk,       \* token budget of one request in one step (chunked prefill)
    MaxExt,      \* largest num_external_computed_tokens the connector reports
    AsyncLoad,   \* TRUE: the connector may load asynchronously (load_kv_async)
    MaxFailures, \* connector load failures allowed in one behaviour
    MaxDraft,    \* draft (speculative) tokens per decode step; 0 = no spec decode
    Save,        \* TRUE: the connector saves computed blocks after each step
    CanAbort,    \* TRUE: a client may abort its request
    Policy,      \* "Legacy" (vLLM 0.13.0) or "Series" (our patch series)
    Mutation     \* "none", or the one Series protection that is switched off

ASSUME /\ N \in Nat \ {0} /\ B \in Nat \ {0} /\ W \in Nat \ {0, 1}
       /\ PromptLen \in Nat \ {0} /\ MaxLen > PromptLen /\ Shared <= PromptLen
       /\ Chunk \in Nat \ {0} /\ MaxExt < PromptLen /\ MaxDraft \in Nat
       /\ MaxFailures \in Nat /\ AsyncLoad \in BOOLEAN /\ Save \in BOOLEAN
       /\ CanAbort \in BOOLEAN /\ Policy \in {"Legacy", "Series"}
       /\ Mutation \in {"none", "EarlyPublish", "PublishDraft", "LateClaim",
                        "FreeInFlight", "EagerFree", "AllocSkipped", "PadFull",
                        "UnderCount", "SkipTouch", "LeakSkipped"}

Null == 0                                 \* the null block (BlockPool.null_block)
Blocks == 1..N                            \* the physical blocks
Groups == {"full", "swa"}                 \* kv_cache_group_id, by attention type
NoHash == <<>>                            \* block_hash of a block not in the cache
NoStep == [on |-> FALSE, from |-> 0, n |-> 0, d |-> 0]  \* no step in flight

Min(a, b) == IF a < b THEN a ELSE b
Max(a, b) == IF a > b THEN a ELSE b
CeilDiv(a, b) == (a + b - 1) \div b       \* vllm.utils.math_utils.cdiv
Range(s) == {s[i] : i \in DOMAIN s}
Real(s) == Range(s) \ {Null}              \* the physical blocks a table names
Count(s, b) == Cardinality({i \in DOMAIN s : s[i] = b})
\* The k lowest ids of S (the free queue's order is abstracted to ids).
Lowest(S, k) == {x \in S : Cardinality({y \in S : y < x}) < k}
\* The blocks of S in ascending order.
Ascending(S) == [i \in 1..Cardinality(S) |->
                  CHOOSE x \in S : Cardinality({y \in S : y < x}) = i - 1]

\* Trailing blocks a sliding-window hit needs (sliding_window_contiguous_blocks).
Contig == CeilDiv(W - 1, B)
\* get_num_skipped_tokens(n) / B: blocks left of the window after n computed tokens.
SkippedBlocks(g, n) == IF g = "swa" THEN Max(0, n - W + 1) \div B ELSE 0
\* The hash of block i (1-based) of request r in group g (token ids -> hashes).
Hash(g, r, i) == IF i * B <= Shared THEN <<g, i>> ELSE <<g, i, r>>
MaxBlocks == CeilDiv(MaxLen + MaxDraft, B)  \* longest block table
ConnIds == {<<r, "connector">> : r \in Req} \* connector side of each request
ClientIds == IF CanAbort THEN {<<r, "client">> : r \in Req} ELSE {}

(* --algorithm HybridKVAlloc
variables
    \* BlockPool: ref_cnt of each physical block.
    ref = [b \in Blocks |-> 0],
    \* BlockPool: block_hash of each block (prefix-cache key), NoHash if not cached.
    hash = [b \in Blocks |-> NoHash],
    \* BlockPool.free_block_queue: blocks with ref_cnt 0, cached or not.
    freeQ = Blocks,
    \* Request.status: waiting, loading (WAITING_FOR_REMOTE_KVS), running,
    \* finishing (finished, blocks kept for a transfer: delayed free), done.
    status = [r \in Req |-> "waiting"],
    \* Request.num_tokens: prompt plus accepted output tokens.
    len = [r \in Req |-> PromptLen],
    \* Request.num_computed_tokens (advanced when the step is scheduled).
    computed = [r \in Req |-> 0],
    \* SingleTypeKVCacheManager.req_to_blocks, one block table per group.
    table = [r \in Req |-> [g \in Groups |-> <<>>]],
    \* SingleTypeKVCacheManager.num_cached_block, per group.
    ncached = [r \in Req |-> [g \in Groups |-> 0]],
    \* The step scheduled for the request and not yet executed: its first
    \* token, verified tokens n and draft tokens d.
    step = [r \in Req |-> NoStep],
    \* Blocks an asynchronous connector load is writing into, per request.
    loads = [r \in Req |-> {}],
    \* Blocks a connector save is reading from, per request.
    saves = [r \in Req |-> {}],
    \* Series: skipped or preempted blocks kept (ref held) until their save ends.
    held = [r \in Req |-> {}],
    \* Scheduler.running, in order; preemption takes the last.
    running = <<>>,
    \* Load failures injected so far.
    failures = 0,
    \* The step just taken: action, request, blocks per group, arguments.
    event = [act |-> "Init", req |-> "none",
             blocks |-> [g \in Groups |-> <<>>], args |-> [none |-> 0]];

define
    \* ---- Prefix cache (BlockPool.get_cached_block) ----
    Lookup(h) == {b \in Blocks : hash[b] = h}
    HitBlock(g, r, i) == CHOOSE b \in Lookup(Hash(g, r, i)) : TRUE
    FullHit(r, h) == \A i \in 1..h : Lookup(Hash("full", r, i)) # {}
    SwaHit(r, h) ==
        \A i \in (Max(h - Contig, 0) + 1)..h : Lookup(Hash("swa", r, i)) # {}
    \* HybridKVCacheCoordinator.find_longest_cache_hit, in blocks: the longest
    \* full-attention prefix hit whose last Contig blocks also hit in "swa";
    \* at most num_tokens - 1 tokens (one token is always computed).
    HitLen(r) ==
        LET ok == {h \in 0..((len[r] - 1) \div B) : FullHit(r, h) /\ SwaHit(r, h)}
        IN  CHOOSE h \in ok : \A h2 \in ok : h2 <= h

    Entries(r) == UNION {Real(table[r][g]) : g \in Groups}
    Transfers(r) == loads[r] \cup saves[r]
    InFlight == UNION {Transfers(r) : r \in Req}

    \* ---- Scheduler choices ----
    \* Connector.get_num_new_matched_tokens: external tokens past the local hit.
    ExtChoices(r) ==
        IF computed[r] = 0
        THEN 0..Min(MaxExt, len[r] - 1 - HitLen(r) * B)
        ELSE {0}
    AsyncChoices(e) == IF e > 0 /\ AsyncLoad THEN {FALSE, TRUE} ELSE {FALSE}
    \* Draft tokens proposed for a decode step (num_spec_tokens).
    DraftChoices(r) ==
        IF computed[r] > 0 /\ computed[r] + 1 = len[r]
        THEN 0..Min(MaxDraft, MaxLen - len[r] - 1)
        ELSE {0}

    \* ---- KVCacheManager.allocate_slots, planned for all groups ----
    \* Fresh request (num_computed_tokens = 0): GetComputedBlocks gives h hit
    \* blocks, the connector e external tokens. Running or resumed request:
    \* RemoveSkippedBlocks first. Returns the new tables' prefix (`base`),
    \* the hits to claim, the new blocks needed per group, and the blocks
    \* leaving the tables.
    Plan(r, e, async, d) ==
      LET fresh == computed[r] = 0
          h == IF fresh THEN HitLen(r) ELSE 0
          c == IF fresh THEN h * B + e ELSE computed[r]
          n == IF async THEN 0 ELSE Min(Chunk, len[r] - c)
          nb == CeilDiv(c + n + d, B)
          s == SkippedBlocks("swa", c)
          \* Null entries at the head of a fresh table.
          pad == [g \in Groups |->
                   IF g = "full" THEN (IF Mutation = "PadFull" THEN Min(s, h) ELSE 0)
                   ELSE IF Policy = "Legacy" \/ Mutation = "AllocSkipped"
                        THEN Max(h - Contig, 0)   \* 0.13.0: only the hit is padded
                        ELSE s]                   \* Series: everything skipped
          base == [g \in Groups |->
                    IF fresh
                    THEN [i \in 1..Max(pad[g], h) |->
                            IF i <= pad[g] THEN Null ELSE HitBlock(g, r, i)]
                    ELSE [i \in DOMAIN table[r][g] |->
                            IF i <= SkippedBlocks(g, c) THEN Null
                            ELSE table[r][g][i]]]
          removed == IF fresh THEN {}
                     ELSE {table[r]["swa"][i] :
                             i \in 1..Min(s, Len(table[r]["swa"]))} \ {Null}
          claimed == [g \in Groups |-> Real(base[g]) \ (IF fresh THEN {} ELSE Entries(r))]
          newCount == [g \in Groups |-> Max(nb - Len(base[g]), 0)]
          toHeld == IF Policy = "Series" /\ Mutation # "FreeInFlight"
                    THEN (removed \cap Transfers(r)) \ held[r] ELSE {}
          evictable == {b \in claimed["full"] \cup claimed["swa"] : ref[b] = 0}
      IN [fresh |-> fresh, h |-> h, c |-> c, n |-> n, d |-> d, e |-> e,
          async |-> async, nb |-> nb, base |-> base, claimed |-> claimed,
          newCount |-> newCount, removed |-> removed, toHeld |-> toHeld,
          toFree |-> removed \ toHeld,
          \* KVCacheCoordinator.get_num_blocks_to_allocate: blocks that will
          \* leave the free queue (new blocks + evictable hits it claims).
          predicted |-> newCount["full"] + newCount["swa"]
                        + IF Mutation = "UnderCount" THEN 0
                          ELSE Cardinality(evictable)]

    \* Free queue after RemoveSkippedBlocks returned the plan's blocks.
    FreeAfterRemove(p) ==
        IF Mutation = "LeakSkipped" THEN freeQ
        ELSE freeQ \cup {b \in p.toFree : ref[b] = 1}
    \* Hits claimed (touched) before any group allocates, and after.
    ClaimFirst(p) == IF Mutation = "LateClaim" THEN p.claimed["full"]
                     ELSE p.claimed["full"] \cup p.claimed["swa"]
    ClaimLate(p) == IF Mutation = "LateClaim" THEN p.claimed["swa"] ELSE {}
    \* BlockPool.get_new_blocks(k) from free set Q: the lowest uncached ids,
    \* or any evictable cached blocks instead (eviction).
    NewBlockChoices(Q, k) ==
        LET cached == {b \in Q : hash[b] # NoHash}
            plain == Q \ cached
        IN  {E \cup Lowest(plain, k - Cardinality(E)) :
               E \in {X \in SUBSET cached :
                        Cardinality(X) <= k /\ k - Cardinality(X) <= Cardinality(plain)}}
    Fits(r, e, async, d) ==
        LET p == Plan(r, e, async, d) IN p.predicted <= Cardinality(FreeAfterRemove(p))

    \* BlockPool.cache_full_blocks for request r: blocks from[g]+1 .. to of
    \* each group, skipping null blocks, blocks already cached, and hashes
    \* some other block already holds.
    Publish(h0, r, tbl, from, to) ==
      [b \in Blocks |->
         LET cands == {gi \in Groups \X (1..MaxBlocks) :
                          /\ gi[2] > from[gi[1]] /\ gi[2] <= to
                          /\ gi[2] <= Len(tbl[gi[1]]) /\ tbl[gi[1]][gi[2]] = b}
         IN  IF cands = {} \/ h0[b] # NoHash THEN h0[b]
             ELSE LET gi == CHOOSE x \in cands : TRUE
                      key == Hash(gi[1], r, gi[2])
                  IN  IF \E b2 \in Blocks : h0[b2] = key THEN NoHash ELSE key]
    NewCached(r, old, to) == [g \in Groups |-> Max(old[g], to)]

    \* BlockPool.free_blocks of a sequence of blocks (repeats counted).
    RefAfterFree(s) == [b \in Blocks |-> ref[b] - Count(s, b)]
    FreeQAfterFree(s) ==
        freeQ \cup {b \in Range(s) \ {Null} : ref[b] - Count(s, b) = 0}
    \* The real blocks at positions lo..hi of tables tbls (all groups).
    BlocksAt(tbls, lo, hi) ==
        {tbls[x[1]][x[2]] : x \in {x \in Groups \X (lo..hi) : x[2] <= Len(tbls[x[1]])}}
            \ {Null}
    AllOf(r) == table[r]["full"] \o table[r]["swa"]
    SeqOf(S) == Ascending(S)
    Ev(act, r, blks, args) == [act |-> act, req |-> r, blocks |-> blks, args |-> args]
    NoBlocks == [g \in Groups |-> <<>>]
    EmptyTables == [g \in Groups |-> <<>>]
    Without(q, r) == SelectSeq(q, LAMBDA x : x # r)
end define;

\* ---------------------------------------------------------------------------
\* The scheduler and model runner acting for one request.
fair+ process engine \in Req
begin
Engine:
  while status[self] # "done" do
    either
      \* Scheduler.schedule -> KVCacheManager.get_computed_blocks (TouchHits
      \* planning), connector.get_num_new_matched_tokens, allocate_slots
      \* (RemoveSkippedBlocks, get_num_blocks_to_allocate, touch,
      \* save_new_computed_blocks, allocate_new_blocks = GetNewBlocks with
      \* eviction, CacheFullBlocks) and connector.update_state_after_alloc.
      await status[self] \in {"waiting", "running"} /\ ~step[self].on;
      with e \in ExtChoices(self), async \in AsyncChoices(e),
           d \in DraftChoices(self), p \in {Plan(self, e, async, d)},
           q1 \in {FreeAfterRemove(p)} do
        await p.predicted <= Cardinality(q1);
        with nf \in NewBlockChoices(q1 \ ClaimFirst(p), p.newCount["full"]),
             ns \in NewBlockChoices(q1 \ (ClaimFirst(p) \cup nf \cup ClaimLate(p)),
                                   p.newCount["swa"]),
             q3 \in {q1 \ (ClaimFirst(p) \cup nf \cup ClaimLate(p) \cup ns)},
             touched \in {IF Mutation = "SkipTouch" THEN {}
                       ELSE ClaimFirst(p) \cup ClaimLate(p)},
             tbl \in {[g \in Groups |->
                      p.base[g] \o SeqOf(IF g = "full" THEN nf ELSE ns)]},
             h1 \in {[b \in Blocks |-> IF b \in nf \cup ns THEN NoHash ELSE hash[b]]},
             publishTo \in {IF p.async /\ Mutation # "EarlyPublish" THEN 0
                         ELSE IF Mutation = "PublishDraft"
                              THEN (p.c + p.n + p.d) \div B
                              ELSE Min(p.c + p.n, len[self]) \div B},
             from \in {IF p.fresh THEN [g \in Groups |-> Len(p.base[g])]
                    ELSE ncached[self]} do
          ref := [b \in Blocks |->
                    ref[b] - (IF b \in p.toFree THEN 1 ELSE 0)
                           + (IF b \in touched THEN 1 ELSE 0)
                           + (IF b \in nf THEN 1 ELSE 0)
                           + (IF b \in ns THEN 1 ELSE 0)];
          freeQ := q3;
          hash := Publish(h1, self, tbl, from, publishTo);
          table[self] := tbl;
          ncached[self] := NewCached(self, from, publishTo);
          held[self] := held[self] \cup p.toHeld;
          loads[self] := IF p.async THEN BlocksAt(tbl, p.h + 1, CeilDiv(p.c, B))
                         ELSE {};
          computed[self] := p.c + p.n + p.d;
          step[self] := IF p.async THEN NoStep
                        ELSE [on |-> TRUE, from |-> p.c, n |-> p.n, d |-> p.d];
          running := IF status[self] = "waiting" /\ ~p.async
                     THEN Append(running, self) ELSE running;
          status[self] := IF p.async THEN "loading" ELSE "running";
          event := Ev("AllocateSlots", self,
                      [g \in Groups |-> SeqOf(IF g = "full" THEN nf ELSE ns)],
                      [hit |-> p.h, ext |-> p.e, async |-> p.async, n |-> p.n,
                       d |-> p.d, predicted |-> p.predicted,
                       taken |-> Cardinality(q1) - Cardinality(q3)]);
        end with;
      end with;
    or
      \* Scheduler.update_from_output: the step ran; a decode step accepts
      \* a of its d draft tokens and samples one more token; the connector
      \* starts saving the blocks that became full; a request that reached
      \* MaxLen finishes (request_finished: delayed free while transfers run).
      await step[self].on;
      with a \in 0..step[self].d,
           st \in {step[self]},
           sampled \in {st.from + st.n = len[self]},
           c2 \in {st.from + st.n + a},
           len2 \in {IF sampled THEN len[self] + 1 + a ELSE len[self]},
           sv \in {IF Save THEN BlocksAt(table[self], (st.from \div B) + 1, c2 \div B)
                ELSE {}},
           fin \in {len2 >= MaxLen},
           delay \in {Mutation # "EagerFree" /\ (saves[self] \cup sv \cup held[self]) # {}} do
        computed[self] := c2;
        len[self] := len2;
        step[self] := NoStep;
        saves[self] := saves[self] \cup sv;
        if fin /\ ~delay then
          \* KVCacheManager.free: all groups, tail first (order abstracted).
          event := Ev("Finish", self, table[self], [accepted |-> a]);
          ref := RefAfterFree(AllOf(self) \o SeqOf(held[self]));
          freeQ := FreeQAfterFree(AllOf(self) \o SeqOf(held[self]));
          table[self] := EmptyTables;
          ncached[self] := [g \in Groups |-> 0];
          held[self] := {};
          status[self] := "done";
          running := Without(running, self);
        elsif fin then
          status[self] := "finishing";
          running := Without(running, self);
          event := Ev("FinishDelayed", self, NoBlocks, [accepted |-> a]);
        else
          event := Ev("Execute", self, NoBlocks, [accepted |-> a]);
        end if;
      end with;
    or
      \* Scheduler.schedule: allocate_slots returned None for this running
      \* request, so the last running request is preempted (maybe itself):
      \* KVCacheManager.free; Series keeps blocks a save still reads.
      await status[self] = "running" /\ ~step[self].on /\ running # <<>>
            /\ ~Fits(self, 0, FALSE, 0);
      with v \in {running[Len(running)]},
           keep \in {IF Policy = "Series" /\ Mutation # "FreeInFlight"
                  THEN (Entries(v) \cap Transfers(v)) \ held[v] ELSE {}},
           fr \in {SelectSeq(AllOf(v), LAMBDA x : x \notin keep)} do
        await ~step[v].on;
        event := Ev("Preempt", v, table[v], [by |-> self]);
        ref := RefAfterFree(fr);
        freeQ := FreeQAfterFree(fr);
        table[v] := EmptyTables;
        ncached[v] := [g \in Groups |-> 0];
        held[v] := held[v] \cup keep;
        computed[v] := 0;
        status[v] := "waiting";
        running := Without(running, v);
      end with;
    end either;
  end while;
end process;

\* ---------------------------------------------------------------------------
\* The connector's worker side, reporting through get_finished.
fair process connector \in ConnIds
begin
Connector:
  while status[self[1]] # "done" do
    either
      \* _update_waiting_for_remote_kv, load succeeded (FinishLoad):
      \* cache_blocks publishes the loaded blocks now, not before.
      await loads[self[1]] # {};
      with r \in {self[1]},
           last \in {status[r] = "finishing" /\ saves[r] = {}} do
        loads[r] := {};
        if last then
          event := Ev("FinishLoadFree", r, table[r], [none |-> 0]);
          ref := RefAfterFree(AllOf(r) \o SeqOf(held[r]));
          freeQ := FreeQAfterFree(AllOf(r) \o SeqOf(held[r]));
          table[r] := EmptyTables;
          ncached[r] := [g \in Groups |-> 0];
          held[r] := {};
          status[r] := "done";
        elsif status[r] = "finishing" then
          event := Ev("FinishLoad", r, NoBlocks, [none |-> 0]);
        else
          hash := Publish(hash, r, table[r], ncached[r], computed[r] \div B);
          ncached[r] := NewCached(r, ncached[r], computed[r] \div B);
          status[r] := "waiting";
          event := Ev("FinishLoad", r, NoBlocks, [none |-> 0]);
        end if;
      end with;
    or
      \* _update_waiting_for_remote_kv after _handle_invalid_blocks (LoadFailed):
      \* nothing valid was computed, so the request's blocks are freed and it
      \* is scheduled again from scratch.
      await loads[self[1]] # {} /\ failures < MaxFailures;
      with r \in {self[1]} do
        event := Ev("LoadFailed", r, table[r], [none |-> 0]);
        loads[r] := {};
        failures := failures + 1;
        ref := RefAfterFree(AllOf(r));
        freeQ := FreeQAfterFree(AllOf(r));
        table[r] := EmptyTables;
        ncached[r] := [g \in Groups |-> 0];
        computed[r] := 0;
        if status[r] = "finishing" /\ saves[r] = {} then
          status[r] := "done";
        elsif status[r] = "loading" then
          status[r] := "waiting";
        end if;
      end with;
    or
      \* finished_sending (SaveDone): blocks held for the save are freed; a
      \* finished request's delayed free happens now.
      await saves[self[1]] # {};
      with r \in {self[1]},
           last \in {status[r] = "finishing" /\ loads[r] = {}},
           fr \in {(IF last THEN AllOf(r) ELSE <<>>) \o SeqOf(held[r])} do
        saves[r] := {};
        ref := RefAfterFree(fr);
        freeQ := FreeQAfterFree(fr);
        held[r] := {};
        if last then
          table[r] := EmptyTables;
          ncached[r] := [g \in Groups |-> 0];
          status[r] := "done";
        end if;
        event := Ev("SaveDone", r, NoBlocks, [none |-> 0]);
      end with;
    end either;
  end while;
end process;

\* ---------------------------------------------------------------------------
\* A client that may abort its request (Scheduler.finish_requests).
process client \in ClientIds
begin
Client:
  either
    await status[self[1]] \in {"waiting", "loading", "running"}
          /\ ~step[self[1]].on;
    with r \in {self[1]},
         delay \in {Mutation # "EagerFree" /\ (Transfers(r) \cup held[r]) # {}} do
      running := Without(running, r);
      if delay then
        status[r] := "finishing";
        event := Ev("AbortDelayed", r, NoBlocks, [none |-> 0]);
      else
        event := Ev("Abort", r, table[r], [none |-> 0]);
        ref := RefAfterFree(AllOf(r) \o SeqOf(held[r]));
        freeQ := FreeQAfterFree(AllOf(r) \o SeqOf(held[r]));
        table[r] := EmptyTables;
        ncached[r] := [g \in Groups |-> 0];
        held[r] := {};
        status[r] := "done";
      end if;
    end with;
  or
    \* The client never aborts.
    event := Ev("NoAbort", self[1], NoBlocks, [none |-> 0]);
  end either;
end process;
end algorithm; *)
\* BEGIN TRANSLATION - the hash of the PCal code: PCal-53088e2437dd0a5c45bddd76ff90ff47
VARIABLES ref, hash, freeQ, status, len, computed, table, ncached, step, 
          loads, saves, held, running, failures, event, pc

(* define statement *)
Lookup(h) == {b \in Blocks : hash[b] = h}
HitBlock(g, r, i) == CHOOSE b \in Lookup(Hash(g, r, i)) : TRUE
FullHit(r, h) == \A i \in 1..h : Lookup(Hash("full", r, i)) # {}
SwaHit(r, h) ==
    \A i \in (Max(h - Contig, 0) + 1)..h : Lookup(Hash("swa", r, i)) # {}



HitLen(r) ==
    LET ok == {h \in 0..((len[r] - 1) \div B) : FullHit(r, h) /\ SwaHit(r, h)}
    IN  CHOOSE h \in ok : \A h2 \in ok : h2 <= h

Entries(r) == UNION {Real(table[r][g]) : g \in Groups}
Transfers(r) == loads[r] \cup saves[r]
InFlight == UNION {Transfers(r) : r \in Req}



ExtChoices(r) ==
    IF computed[r] = 0
    THEN 0..Min(MaxExt, len[r] - 1 - HitLen(r) * B)
    ELSE {0}
AsyncChoices(e) == IF e > 0 /\ AsyncLoad THEN {FALSE, TRUE} ELSE {FALSE}

DraftChoices(r) ==
    IF computed[r] > 0 /\ computed[r] + 1 = len[r]
    THEN 0..Min(MaxDraft, MaxLen - len[r] - 1)
    ELSE {0}







Plan(r, e, async, d) ==
  LET fresh == computed[r] = 0
      h == IF fresh THEN HitLen(r) ELSE 0
      c == IF fresh THEN h * B + e ELSE computed[r]
      n == IF async THEN 0 ELSE Min(Chunk, len[r] - c)
      nb == CeilDiv(c + n + d, B)
      s == SkippedBlocks("swa", c)

      pad == [g \in Groups |->
               IF g = "full" THEN (IF Mutation = "PadFull" THEN Min(s, h) ELSE 0)
               ELSE IF Policy = "Legacy" \/ Mutation = "AllocSkipped"
                    THEN Max(h - Contig, 0)
                    ELSE s]
      base == [g \in Groups |->
                IF fresh
                THEN [i \in 1..Max(pad[g], h) |->
                        IF i <= pad[g] THEN Null ELSE HitBlock(g, r, i)]
                ELSE [i \in DOMAIN table[r][g] |->
                        IF i <= SkippedBlocks(g, c) THEN Null
                        ELSE table[r][g][i]]]
      removed == IF fresh THEN {}
                 ELSE {table[r]["swa"][i] :
                         i \in 1..Min(s, Len(table[r]["swa"]))} \ {Null}
      claimed == [g \in Groups |-> Real(base[g]) \ (IF fresh THEN {} ELSE Entries(r))]
      newCount == [g \in Groups |-> Max(nb - Len(base[g]), 0)]
      toHeld == IF Policy = "Series" /\ Mutation # "FreeInFlight"
                THEN (removed \cap Transfers(r)) \ held[r] ELSE {}
      evictable == {b \in claimed["full"] \cup claimed["swa"] : ref[b] = 0}
  IN [fresh |-> fresh, h |-> h, c |-> c, n |-> n, d |-> d, e |-> e,
      async |-> async, nb |-> nb, base |-> base, claimed |-> claimed,
      newCount |-> newCount, removed |-> removed, toHeld |-> toHeld,
      toFree |-> removed \ toHeld,


      predicted |-> newCount["full"] + newCount["swa"]
                    + IF Mutation = "UnderCount" THEN 0
                      ELSE Cardinality(evictable)]


FreeAfterRemove(p) ==
    IF Mutation = "LeakSkipped" THEN freeQ
    ELSE freeQ \cup {b \in p.toFree : ref[b] = 1}

ClaimFirst(p) == IF Mutation = "LateClaim" THEN p.claimed["full"]
                 ELSE p.claimed["full"] \cup p.claimed["swa"]
ClaimLate(p) == IF Mutation = "LateClaim" THEN p.claimed["swa"] ELSE {}


NewBlockChoices(Q, k) ==
    LET cached == {b \in Q : hash[b] # NoHash}
        plain == Q \ cached
    IN  {E \cup Lowest(plain, k - Cardinality(E)) :
           E \in {X \in SUBSET cached :
                    Cardinality(X) <= k /\ k - Cardinality(X) <= Cardinality(plain)}}
Fits(r, e, async, d) ==
    LET p == Plan(r, e, async, d) IN p.predicted <= Cardinality(FreeAfterRemove(p))




Publish(h0, r, tbl, from, to) ==
  [b \in Blocks |->
     LET cands == {gi \in Groups \X (1..MaxBlocks) :
                      /\ gi[2] > from[gi[1]] /\ gi[2] <= to
                      /\ gi[2] <= Len(tbl[gi[1]]) /\ tbl[gi[1]][gi[2]] = b}
     IN  IF cands = {} \/ h0[b] # NoHash THEN h0[b]
         ELSE LET gi == CHOOSE x \in cands : TRUE
                  key == Hash(gi[1], r, gi[2])
              IN  IF \E b2 \in Blocks : h0[b2] = key THEN NoHash ELSE key]
NewCached(r, old, to) == [g \in Groups |-> Max(old[g], to)]


RefAfterFree(s) == [b \in Blocks |-> ref[b] - Count(s, b)]
FreeQAfterFree(s) ==
    freeQ \cup {b \in Range(s) \ {Null} : ref[b] - Count(s, b) = 0}

BlocksAt(tbls, lo, hi) ==
    {tbls[x[1]][x[2]] : x \in {x \in Groups \X (lo..hi) : x[2] <= Len(tbls[x[1]])}}
        \ {Null}
AllOf(r) == table[r]["full"] \o table[r]["swa"]
SeqOf(S) == Ascending(S)
Ev(act, r, blks, args) == [act |-> act, req |-> r, blocks |-> blks, args |-> args]
NoBlocks == [g \in Groups |-> <<>>]
EmptyTables == [g \in Groups |-> <<>>]
Without(q, r) == SelectSeq(q, LAMBDA x : x # r)


vars == << ref, hash, freeQ, status, len, computed, table, ncached, step, 
           loads, saves, held, running, failures, event, pc >>

ProcSet == (Req) \cup (ConnIds) \cup (ClientIds)

Init == (* Global variables *)
        /\ ref = [b \in Blocks |-> 0]
        /\ hash = [b \in Blocks |-> NoHash]
        /\ freeQ = Blocks
        /\ status = [r \in Req |-> "waiting"]
        /\ len = [r \in Req |-> PromptLen]
        /\ computed = [r \in Req |-> 0]
        /\ table = [r \in Req |-> [g \in Groups |-> <<>>]]
        /\ ncached = [r \in Req |-> [g \in Groups |-> 0]]
        /\ step = [r \in Req |-> NoStep]
        /\ loads = [r \in Req |-> {}]
        /\ saves = [r \in Req |-> {}]
        /\ held = [r \in Req |-> {}]
        /\ running = <<>>
        /\ failures = 0
        /\ event = [act |-> "Init", req |-> "none",
                    blocks |-> [g \in Groups |-> <<>>], args |-> [none |-> 0]]
        /\ pc = [self \in ProcSet |-> CASE self \in Req -> "Engine"
                                        [] self \in ConnIds -> "Connector"
                                        [] self \in ClientIds -> "Client"]

Engine(self) == /\ pc[self] = "Engine"
                /\ IF status[self] # "done"
                      THEN /\ \/ /\ status[self] \in {"waiting", "running"} /\ ~step[self].on
                                 /\ \E e \in ExtChoices(self):
                                      \E async \in AsyncChoices(e):
                                        \E d \in DraftChoices(self):
                                          \E p \in {Plan(self, e, async, d)}:
                                            \E q1 \in {FreeAfterRemove(p)}:
                                              /\ p.predicted <= Cardinality(q1)
                                              /\ \E nf \in NewBlockChoices(q1 \ ClaimFirst(p), p.newCount["full"]):
                                                   \E ns \in NewBlockChoices(q1 \ (ClaimFirst(p) \cup nf \cup ClaimLate(p)),
                                                                            p.newCount["swa"]):
                                                     \E q3 \in {q1 \ (ClaimFirst(p) \cup nf \cup ClaimLate(p) \cup ns)}:
                                                       \E touched \in   {IF Mutation = "SkipTouch" THEN {}
                                                                      ELSE ClaimFirst(p) \cup ClaimLate(p)}:
                                                         \E tbl \in {[g \in Groups |->
                                                                     p.base[g] \o SeqOf(IF g = "full" THEN nf ELSE ns)]}:
                                                           \E h1 \in {[b \in Blocks |-> IF b \in nf \cup ns THEN NoHash ELSE hash[b]]}:
                                                             \E publishTo \in   {IF p.async /\ Mutation # "EarlyPublish" THEN 0
                                                                              ELSE IF Mutation = "PublishDraft"
                                                                                   THEN (p.c + p.n + p.d) \div B
                                                                                   ELSE Min(p.c + p.n, len[self]) \div B}:
                                                               \E from \in   {IF p.fresh THEN [g \in Groups |-> Len(p.base[g])]
                                                                           ELSE ncached[self]}:
                                                                 /\ ref' = [b \in Blocks |->
                                                                              ref[b] - (IF b \in p.toFree THEN 1 ELSE 0)
                                                                                     + (IF b \in touched THEN 1 ELSE 0)
                                                                                     + (IF b \in nf THEN 1 ELSE 0)
                                                                                     + (IF b \in ns THEN 1 ELSE 0)]
                                                                 /\ freeQ' = q3
                                                                 /\ hash' = Publish(h1, self, tbl, from, publishTo)
                                                                 /\ table' = [table EXCEPT ![self] = tbl]
                                                                 /\ ncached' = [ncached EXCEPT ![self] = NewCached(self, from, publishTo)]
                                                                 /\ held' = [held EXCEPT ![self] = held[self] \cup p.toHeld]
                                                                 /\ loads' = [loads EXCEPT ![self] = IF p.async THEN BlocksAt(tbl, p.h + 1, CeilDiv(p.c, B))
                                                                                                     ELSE {}]
                                                                 /\ computed' = [computed EXCEPT ![self] = p.c + p.n + p.d]
                                                                 /\ step' = [step EXCEPT ![self] = IF p.async THEN NoStep
                                                                                                   ELSE [on |-> TRUE, from |-> p.c, n |-> p.n, d |-> p.d]]
                                                                 /\ running' = (IF status[self] = "waiting" /\ ~p.async
                                                                                THEN Append(running, self) ELSE running)
                                                                 /\ status' = [status EXCEPT ![self] = IF p.async THEN "loading" ELSE "running"]
                                                                 /\ event' = Ev("AllocateSlots", self,
                                                                                [g \in Groups |-> SeqOf(IF g = "full" THEN nf ELSE ns)],
                                                                                [hit |-> p.h, ext |-> p.e, async |-> p.async, n |-> p.n,
                                                                                 d |-> p.d, predicted |-> p.predicted,
                                                                                 taken |-> Cardinality(q1) - Cardinality(q3)])
                                 /\ UNCHANGED <<len, saves>>
                              \/ /\ step[self].on
                                 /\ \E a \in 0..step[self].d:
                                      \E st \in {step[self]}:
                                        \E sampled \in {st.from + st.n = len[self]}:
                                          \E c2 \in {st.from + st.n + a}:
                                            \E len2 \in {IF sampled THEN len[self] + 1 + a ELSE len[self]}:
                                              \E sv \in   {IF Save THEN BlocksAt(table[self], (st.from \div B) + 1, c2 \div B)
                                                        ELSE {}}:
                                                \E fin \in {len2 >= MaxLen}:
                                                  \E delay \in {Mutation # "EagerFree" /\ (saves[self] \cup sv \cup held[self]) # {}}:
                                                    /\ computed' = [computed EXCEPT ![self] = c2]
                                                    /\ len' = [len EXCEPT ![self] = len2]
                                                    /\ step' = [step EXCEPT ![self] = NoStep]
                                                    /\ saves' = [saves EXCEPT ![self] = saves[self] \cup sv]
                                                    /\ IF fin /\ ~delay
                                                          THEN /\ event' = Ev("Finish", self, table[self], [accepted |-> a])
                                                               /\ ref' = RefAfterFree(AllOf(self) \o SeqOf(held[self]))
                                                               /\ freeQ' = FreeQAfterFree(AllOf(self) \o SeqOf(held[self]))
                                                               /\ table' = [table EXCEPT ![self] = EmptyTables]
                                                               /\ ncached' = [ncached EXCEPT ![self] = [g \in Groups |-> 0]]
                                                               /\ held' = [held EXCEPT ![self] = {}]
                                                               /\ status' = [status EXCEPT ![self] = "done"]
                                                               /\ running' = Without(running, self)
                                                          ELSE /\ IF fin
                                                                     THEN /\ status' = [status EXCEPT ![self] = "finishing"]
                                                                          /\ running' = Without(running, self)
                                                                          /\ event' = Ev("FinishDelayed", self, NoBlocks, [accepted |-> a])
                                                                     ELSE /\ event' = Ev("Execute", self, NoBlocks, [accepted |-> a])
                                                                          /\ UNCHANGED << status, 
                                                                                          running >>
                                                               /\ UNCHANGED << ref, 
                                                                               freeQ, 
                                                                               table, 
                                                                               ncached, 
                                                                               held >>
                                 /\ UNCHANGED <<hash, loads>>
                              \/ /\ status[self] = "running" /\ ~step[self].on /\ running # <<>>
                                    /\ ~Fits(self, 0, FALSE, 0)
                                 /\ \E v \in {running[Len(running)]}:
                                      \E keep \in   {IF Policy = "Series" /\ Mutation # "FreeInFlight"
                                                  THEN (Entries(v) \cap Transfers(v)) \ held[v] ELSE {}}:
                                        \E fr \in {SelectSeq(AllOf(v), LAMBDA x : x \notin keep)}:
                                          /\ ~step[v].on
                                          /\ event' = Ev("Preempt", v, table[v], [by |-> self])
                                          /\ ref' = RefAfterFree(fr)
                                          /\ freeQ' = FreeQAfterFree(fr)
                                          /\ table' = [table EXCEPT ![v] = EmptyTables]
                                          /\ ncached' = [ncached EXCEPT ![v] = [g \in Groups |-> 0]]
                                          /\ held' = [held EXCEPT ![v] = held[v] \cup keep]
                                          /\ computed' = [computed EXCEPT ![v] = 0]
                                          /\ status' = [status EXCEPT ![v] = "waiting"]
                                          /\ running' = Without(running, v)
                                 /\ UNCHANGED <<hash, len, step, loads, saves>>
                           /\ pc' = [pc EXCEPT ![self] = "Engine"]
                      ELSE /\ pc' = [pc EXCEPT ![self] = "Done"]
                           /\ UNCHANGED << ref, hash, freeQ, status, len, 
                                           computed, table, ncached, step, 
                                           loads, saves, held, running, event >>
                /\ UNCHANGED failures

engine(self) == Engine(self)

Connector(self) == /\ pc[self] = "Connector"
                   /\ IF status[self[1]] # "done"
                         THEN /\ \/ /\ loads[self[1]] # {}
                                    /\ \E r \in {self[1]}:
                                         \E last \in {status[r] = "finishing" /\ saves[r] = {}}:
                                           /\ loads' = [loads EXCEPT ![r] = {}]
                                           /\ IF last
                                                 THEN /\ event' = Ev("FinishLoadFree", r, table[r], [none |-> 0])
                                                      /\ ref' = RefAfterFree(AllOf(r) \o SeqOf(held[r]))
                                                      /\ freeQ' = FreeQAfterFree(AllOf(r) \o SeqOf(held[r]))
                                                      /\ table' = [table EXCEPT ![r] = EmptyTables]
                                                      /\ ncached' = [ncached EXCEPT ![r] = [g \in Groups |-> 0]]
                                                      /\ held' = [held EXCEPT ![r] = {}]
                                                      /\ status' = [status EXCEPT ![r] = "done"]
                                                      /\ hash' = hash
                                                 ELSE /\ IF status[r] = "finishing"
                                                            THEN /\ event' = Ev("FinishLoad", r, NoBlocks, [none |-> 0])
                                                                 /\ UNCHANGED << hash, 
                                                                                 status, 
                                                                                 ncached >>
                                                            ELSE /\ hash' = Publish(hash, r, table[r], ncached[r], computed[r] \div B)
                                                                 /\ ncached' = [ncached EXCEPT ![r] = NewCached(r, ncached[r], computed[r] \div B)]
                                                                 /\ status' = [status EXCEPT ![r] = "waiting"]
                                                                 /\ event' = Ev("FinishLoad", r, NoBlocks, [none |-> 0])
                                                      /\ UNCHANGED << ref, 
                                                                      freeQ, 
                                                                      table, 
                                                                      held >>
                                    /\ UNCHANGED <<computed, saves, failures>>
                                 \/ /\ loads[self[1]] # {} /\ failures < MaxFailures
                                    /\ \E r \in {self[1]}:
                                         /\ event' = Ev("LoadFailed", r, table[r], [none |-> 0])
                                         /\ loads' = [loads EXCEPT ![r] = {}]
                                         /\ failures' = failures + 1
                                         /\ ref' = RefAfterFree(AllOf(r))
                                         /\ freeQ' = FreeQAfterFree(AllOf(r))
                                         /\ table' = [table EXCEPT ![r] = EmptyTables]
                                         /\ ncached' = [ncached EXCEPT ![r] = [g \in Groups |-> 0]]
                                         /\ computed' = [computed EXCEPT ![r] = 0]
                                         /\ IF status[r] = "finishing" /\ saves[r] = {}
                                               THEN /\ status' = [status EXCEPT ![r] = "done"]
                                               ELSE /\ IF status[r] = "loading"
                                                          THEN /\ status' = [status EXCEPT ![r] = "waiting"]
                                                          ELSE /\ TRUE
                                                               /\ UNCHANGED status
                                    /\ UNCHANGED <<hash, saves, held>>
                                 \/ /\ saves[self[1]] # {}
                                    /\ \E r \in {self[1]}:
                                         \E last \in {status[r] = "finishing" /\ loads[r] = {}}:
                                           \E fr \in {(IF last THEN AllOf(r) ELSE <<>>) \o SeqOf(held[r])}:
                                             /\ saves' = [saves EXCEPT ![r] = {}]
                                             /\ ref' = RefAfterFree(fr)
                                             /\ freeQ' = FreeQAfterFree(fr)
                                             /\ held' = [held EXCEPT ![r] = {}]
                                             /\ IF last
                                                   THEN /\ table' = [table EXCEPT ![r] = EmptyTables]
                                                        /\ ncached' = [ncached EXCEPT ![r] = [g \in Groups |-> 0]]
                                                        /\ status' = [status EXCEPT ![r] = "done"]
                                                   ELSE /\ TRUE
                                                        /\ UNCHANGED << status, 
                                                                        table, 
                                                                        ncached >>
                                             /\ event' = Ev("SaveDone", r, NoBlocks, [none |-> 0])
                                    /\ UNCHANGED <<hash, computed, loads, failures>>
                              /\ pc' = [pc EXCEPT ![self] = "Connector"]
                         ELSE /\ pc' = [pc EXCEPT ![self] = "Done"]
                              /\ UNCHANGED << ref, hash, freeQ, status, 
                                              computed, table, ncached, loads, 
                                              saves, held, failures, event >>
                   /\ UNCHANGED << len, step, running >>

connector(self) == Connector(self)

Client(self) == /\ pc[self] = "Client"
                /\ \/ /\ status[self[1]] \in {"waiting", "loading", "running"}
                         /\ ~step[self[1]].on
                      /\ \E r \in {self[1]}:
                           \E delay \in {Mutation # "EagerFree" /\ (Transfers(r) \cup held[r]) # {}}:
                             /\ running' = Without(running, r)
                             /\ IF delay
                                   THEN /\ status' = [status EXCEPT ![r] = "finishing"]
                                        /\ event' = Ev("AbortDelayed", r, NoBlocks, [none |-> 0])
                                        /\ UNCHANGED << ref, freeQ, table, 
                                                        ncached, held >>
                                   ELSE /\ event' = Ev("Abort", r, table[r], [none |-> 0])
                                        /\ ref' = RefAfterFree(AllOf(r) \o SeqOf(held[r]))
                                        /\ freeQ' = FreeQAfterFree(AllOf(r) \o SeqOf(held[r]))
                                        /\ table' = [table EXCEPT ![r] = EmptyTables]
                                        /\ ncached' = [ncached EXCEPT ![r] = [g \in Groups |-> 0]]
                                        /\ held' = [held EXCEPT ![r] = {}]
                                        /\ status' = [status EXCEPT ![r] = "done"]
                   \/ /\ event' = Ev("NoAbort", self[1], NoBlocks, [none |-> 0])
                      /\ UNCHANGED <<ref, freeQ, status, table, ncached, held, running>>
                /\ pc' = [pc EXCEPT ![self] = "Done"]
                /\ UNCHANGED << hash, len, computed, step, loads, saves, 
                                failures >>

client(self) == Client(self)

(* Allow infinite stuttering to prevent deadlock on termination. *)
Terminating == /\ \A self \in ProcSet: pc[self] = "Done"
               /\ UNCHANGED vars

Next == (\E self \in Req: engine(self))
           \/ (\E self \in ConnIds: connector(self))
           \/ (\E self \in ClientIds: client(self))
           \/ Terminating

Spec == /\ Init /\ [][Next]_vars
        /\ \A self \in Req : SF_vars(engine(self))
        /\ \A self \in ConnIds : WF_vars(connector(self))

Termination == <>(\A self \in ProcSet: pc[self] = "Done")

\* END TRANSLATION - the hash of the generated TLA code (remove to silence divergence warnings): TLA-48cb46fd42d2459dab51a6aa383c56f2

-----------------------------------------------------------------------------
(***************************************************************************)
(* Properties. Each names the vLLM code whose correctness it stands for.  *)
(***************************************************************************)

Statuses == {"waiting", "loading", "running", "finishing", "done"}
Hashes == {<<g, i>> : g \in Groups, i \in 1..MaxBlocks}
          \cup {<<g, i, r>> : g \in Groups, i \in 1..MaxBlocks, r \in Req}

\* Every variable has the shape its vLLM counterpart has.
TypeOK ==
    /\ ref \in [Blocks -> Nat]
    /\ hash \in [Blocks -> Hashes \cup {NoHash}]
    /\ freeQ \subseteq Blocks
    /\ status \in [Req -> Statuses]
    /\ len \in [Req -> PromptLen..MaxLen]
    /\ computed \in [Req -> 0..(MaxLen + MaxDraft)]
    /\ \A r \in Req, g \in Groups :
          /\ table[r][g] \in Seq(Blocks \cup {Null})
          /\ Len(table[r][g]) <= MaxBlocks
          /\ ncached[r][g] \in 0..MaxBlocks
    /\ \A r \in Req : /\ loads[r] \subseteq Blocks /\ saves[r] \subseteq Blocks
                      /\ held[r] \subseteq Blocks
    /\ \A r \in Req : step[r].on \in BOOLEAN
    /\ running \in Seq(Req)
    /\ failures \in 0..MaxFailures

\* BlockPool: free_block_queue holds exactly the blocks with ref_cnt 0, so
\* free (uncached or cached-unreferenced) + referenced = N; the null block
\* (BlockPool.null_block) is outside Blocks and never enters the queue, a
\* transfer or a hold (free_blocks / get_new_blocks / cache_full_blocks
\* skip it).
Conservation ==
    /\ \A b \in freeQ : ref[b] = 0
    /\ Cardinality(freeQ) + Cardinality({b \in Blocks : ref[b] > 0}) = N
    /\ Null \notin freeQ \cup InFlight \cup UNION {held[r] : r \in Req}

\* Positions of block b in a block table.
At(t, b) == {i \in DOMAIN t : t[i] = b}
Holders(b) == {r \in Req : b \in held[r]}

\* BlockPool.get_new_blocks / touch: a block has one owner (one request, one
\* group, one position), unless it is a prefix-cache hit shared by several
\* requests at the same position of the same group, carrying its hash.
ExclusiveOwnership ==
    /\ \A r \in Req, g \in Groups :          \* once per table
          \A b \in Real(table[r][g]) : Cardinality(At(table[r][g], b)) = 1
    /\ \A r \in Req :                        \* never in two groups of a request
          /\ Real(table[r]["full"]) \cap Real(table[r]["swa"]) = {}
          /\ \A b \in held[r] \cap Entries(r) : hash[b] # NoHash  \* its own hit
    /\ \A r1, r2 \in Req : r1 # r2 =>        \* shared only as the same hit
          /\ \A g1, g2 \in Groups :
               \A b \in Real(table[r1][g1]) \cap Real(table[r2][g2]) :
                  /\ g1 = g2 /\ hash[b] # NoHash
                  /\ At(table[r1][g1], b) = At(table[r2][g2], b)
          /\ \A b \in held[r1] \cap (Entries(r2) \cup held[r2]) : hash[b] # NoHash

\* Scheduler + KVConnector: a block a load writes or a save reads stays
\* owned by its request and out of the free queue (so it is never evicted
\* or re-allocated) until the connector reports the transfer finished.
NoTransferRace ==
    \A r \in Req : \A b \in Transfers(r) :
        /\ b \in Entries(r) \cup held[r]
        /\ b \notin freeQ

\* BlockPool.touch / free_blocks: ref_cnt counts the table entries (and
\* Series holds) that name the block.
RefCount ==
    \A b \in Blocks :
        ref[b] = Cardinality({rg \in Req \X Groups : b \in Range(table[rg[1]][rg[2]])})
                 + Cardinality(Holders(b))

\* SingleTypeKVCacheManager: null blocks only form a prefix of a
\* sliding-window table (remove_skipped_blocks, find_longest_cache_hit);
\* a full-attention table never holds one.
NullPrefix ==
    \A r \in Req :
      /\ Null \notin Range(table[r]["full"])
      /\ \A i, j \in DOMAIN table[r]["swa"] :
            i < j /\ table[r]["swa"][j] = Null => table[r]["swa"][i] = Null

\* SlidingWindowManager: right after allocate_slots (tables only grow
\* there) the request's sliding-window table holds at most
\* ceil((W-1)/B) + 1 real blocks plus those of the tokens scheduled now.
WindowBound ==
    event.act = "AllocateSlots" =>
        Cardinality(Real(table[event.req]["swa"]))
            <= Contig + 1 + CeilDiv(event.args.n + event.args.d, B)

\* KVCacheManager.allocate_slots: get_num_blocks_to_allocate predicts
\* exactly the blocks then taken from the free queue (touched evictable
\* hits + get_new_blocks), for all groups together.
ExactAdmission ==
    event.act = "AllocateSlots" => event.args.predicted = event.args.taken

\* BlockPool.cache_full_blocks: a block being loaded by the connector is
\* not in the prefix cache (delay_cache_blocks until the load finished),
\* and a block holding a token past num_tokens (an unverified draft or an
\* empty slot) never is.
NoPrematurePublish ==
    /\ \A r \in Req : \A b \in loads[r] : hash[b] = NoHash
    /\ \A r \in Req, g \in Groups : \A i \in DOMAIN table[r][g] :
          (table[r][g][i] # Null /\ i * B > len[r]) => hash[table[r][g][i]] = NoHash

\* Scheduler under fairness: every request eventually finishes (or is
\* aborted) when its in-window needs fit the pool.
Liveness == \A r \in Req : <>(status[r] = "done")

\* Symmetry of the request ids (all prompts look alike).
Symmetry == Permutations(Req)

THEOREM Spec => []TypeOK
THEOREM Spec => []Conservation
THEOREM Spec => []ExclusiveOwnership
THEOREM Spec => []NoTransferRace
THEOREM Spec => []RefCount
THEOREM Spec => []NullPrefix
THEOREM Spec => []WindowBound
THEOREM Spec => []ExactAdmission
THEOREM Spec => []NoPrematurePublish
THEOREM Spec => Liveness
=============================================================================
