--------------------------- MODULE HybridKVAlloc ---------------------------
(***************************************************************************)
(* Block allocation of vLLM's hybrid KV cache manager (HMA) with a KV      *)
(* connector: as on vLLM 0.13.0 ("Legacy"), as stage 03's per-group      *)
(* allocation alone ("SeriesAllocOnly"), and as stage 03's commits do it *)
(* ("SeriesAsCoded"; see the policies below), with a sliding window or   *)
(* a Mamba group beside full attention (Kind; the Mamba stage,           *)
(* patches/09-mamba-hma).                                                 *)
(*                                                                         *)
(* Modelled:                                                               *)
(*  - one BlockPool of N physical blocks (ids 1..N) plus the null block   *)
(*    (id 0); per block its ref_cnt and its prefix-cache key; a key may   *)
(*    name several blocks (BlockHashToBlockMap), a hit takes any of them; *)
(*  - two KV cache groups drawing from that pool: "full" (full attention) *)
(*    and "swa" (sliding window of W tokens) or "mamba" (a Mamba group:   *)
(*    with prefix caching each block holds the layers' state after its   *)
(*    last token, mamba_block_size = B; Kind); both use block size B;    *)
(*    with a connector that declines HMA, "swa" alone (ConnectorHMA);     *)
(*  - per request: prefix-cache lookup, connector hits loaded             *)
(*    synchronously (inside the step) or asynchronously                  *)
(*    (WAITING_FOR_REMOTE_KVS), load completion, load failure from any    *)
(*    block on (recovered as Scheduler._handle_invalid_blocks does, with *)
(*    KVCacheManager.can_recompute_from), chunked prefill, decode steps   *)
(*    with draft (speculative) tokens, connector saves (none, inside the  *)
(*    step, or an asynchronous store that outlives it), preemption, abort,*)
(*    finish with a delayed free, eviction of cached blocks;              *)
(*  - the KV content of each block slot only as far as a failed load     *)
(*    leaves it invalid (`bad`), to state which tokens are read; a Mamba *)
(*    block's slot at a token's offset stands for the state after that  *)
(*    token.                                                              *)
(*                                                                         *)
(* Abstracted away:                                                        *)
(*  - token ids -> block hashes: every request has the same first Shared   *)
(*    tokens, so block i of group g hashes to <<g, i>> while it lies in    *)
(*    that prefix and to <<g, i, r>> after it;                             *)
(*  - tensors -> nothing; a transfer is the set of blocks it touches;      *)
(*  - the free queue's LRU order -> a set: allocation takes the lowest     *)
(*    free uncached ids and any choice of cached (evictable) free blocks,  *)
(*    a superset of what the LRU order allows;                             *)
(*  - the batch and its token budget: a request is scheduled for at most   *)
(*    Chunk tokens and has at most one step in flight; steps of different  *)
(*    requests may be in flight together (one batch). Asynchronous         *)
(*    scheduling (a request's next step scheduled before its step in       *)
(*    flight returned) is spec/AsyncSched.tla's subject; here it is only   *)
(*    its effect on a failed synchronous load (LateReport: reported after  *)
(*    the next step was scheduled, so patch                                *)
(*    [00c.2 Preempt if a KV load failure] preempts the request);           *)
(*  - the waiting queue's order (any waiting request may be scheduled),    *)
(*    except where the stall fix reads it (`order`, `stallHead`);          *)
(*  - num_computed_tokens of a request waiting for an asynchronous load    *)
(*    already counts the loaded tokens (stage 03 records them when the     *)
(*    load starts: num_computed_tokens_after_recving of the request's      *)
(*    KVConnectorRequest).                                                 *)
(*                                                                         *)
(* Every step sets `event` (action, request, blocks per group, args whose *)
(* names carry their unit: ...Tokens, ...Blocks, atSlot), so a behaviour  *)
(* can be replayed against the implementation; `event` is a               *)
(* history variable: the VIEW leaves it out, and the properties that read *)
(* it are action properties.                                              *)
(*                                                                         *)
(* TLC checks it through spec/MCHybridKVAlloc.tla, which adds the          *)
(* mutations (one protection of the code switched off) and the witnesses. *)
(***************************************************************************)
EXTENDS Integers, Sequences, FiniteSets, TLC

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
    LoadsFail,   \* TRUE: every load fails (a lost store), synchronous or asynchronous, at a block the connector chooses, without bound
    LateReport,  \* TRUE: a synchronous load's failure is reported after the request's next step was scheduled (AsyncScheduler): patch [00c.2 Preempt if a KV load failure] preempts the request
    MaxDraft,    \* draft (speculative) tokens per decode step; 0 = no spec decode
    SaveMode,    \* connector saves: "none", "step" (inside the step), "async" (outlive it)
    CanAbort,    \* TRUE: a client may abort its request
    Refusals,    \* TRUE: a refused allocation of a waiting request is a step (replays)
    Policy,      \* "Legacy" (0.13.0), "SeriesAllocOnly", "SeriesAsCoded" (below)
    ConnectorHMA, \* TRUE: the connector uses HMA (two KV cache groups); FALSE: it declines it, on a model whose only group is a sliding window (below)
    Kind         \* the second KV cache group: "swa" (a sliding window of W tokens) or "mamba" (a Mamba group, the Mamba stage; below)

ASSUME /\ N \in Nat \ {0} /\ B \in Nat \ {0} /\ W \in Nat \ {0, 1}
       /\ PromptLen \in Nat \ {0} /\ MaxLen > PromptLen /\ Shared <= PromptLen
       /\ Chunk \in Nat \ {0} /\ MaxExt \in Nat /\ MaxExt < PromptLen
       /\ MaxDraft \in Nat /\ MaxFailures \in Nat /\ AsyncLoad \in BOOLEAN
       /\ LoadsFail \in BOOLEAN /\ LateReport \in BOOLEAN
       /\ (LoadsFail => MaxFailures > 0)
       /\ SaveMode \in {"none", "step", "async"}
       /\ CanAbort \in BOOLEAN /\ Refusals \in BOOLEAN
       /\ Policy \in {"Legacy", "SeriesAllocOnly", "SeriesAsCoded"}
       /\ ConnectorHMA \in BOOLEAN
       /\ Kind \in {"swa", "mamba"}
       /\ (Kind = "mamba" => Policy = "SeriesAsCoded" /\ ConnectorHMA /\ MaxDraft = 0)

-----------------------------------------------------------------------------
(***************************************************************************)
(* The two versions of stage 03 the model knows, by the mechanisms of its  *)
(* failure paths (patches/03-connector-allocate/vllm/00NN):                *)
(*  - "SeriesAllocOnly": the per-group allocation (patches                 *)
(*    [03.2 Connector paths handle every KV cache group] to               *)
(*    [03.3 Allocate only the external blocks]) without the failure-path  *)
(*    fixes: no hold for in-flight stores, no stall fix, the first holder  *)
(*    of a shared invalid block recomputes it for all, a running request's *)
(*    load-failure range is num_cached_tokens, a request whose load failed *)
(*    loads again. Its models are the witnesses that each fix bites;       *)
(*  - "SeriesAsCoded": the commits of stage 03: patch [03a.1 Hold blocks]  *)
(*    holds the blocks a connector's store still reads                     *)
(*    (request_blocks_freed), patch [00a.4 Fix a stall] frees the blocks of *)
(*    waiting requests back from async loads when the first waiting        *)
(*    request cannot be allocated and nothing runs, patch                  *)
(*    [00c.1 All sharers of a failed KV block] makes every holder of an     *)
(*    invalid block compute it again, and publishes the blocks it computes *)
(*    again (uncache_blocks), patch [00c.3 Handle a failed sync KV load]    *)
(*    takes a running request's load-failure range from the tokens it      *)
(*    computed before its step, patch [00c.4 No new KV load] takes no       *)
(*    external tokens any more for a request a load failure affected.      *)
(* Patch [00b.1 Don't free skipped blocks] (in-flight fence) only matters   *)
(* with steps of one request in flight together (spec/AsyncSched.tla);     *)
(* patch [00c.2 Preempt if a KV load failure] (a failure reported after the *)
(* next step preempts) is LateReport; patches [00a.1 Don't leak ids] to     *)
(* [00a.3 Resume after loaded tokens] are the async-load paths below        *)
(* (FinishLoad, Abort while loading, resume point); patch                  *)
(* [03.1 Keep HMA on]'s HMA decision is the constant ConnectorHMA;        *)
(* patches [00d.1 Set up --kv-offloading-backend] (configuration) and      *)
(* [03a.2 Add KV connectors and token regions] (documentation) have no     *)
(* state. A proposal the code lacks gets a policy of its own.              *)
(***************************************************************************)
IsSeries == Policy \in {"SeriesAllocOnly", "SeriesAsCoded"}
Fixed == Policy = "SeriesAsCoded"
\* Patch [03a.1 Hold blocks]: before the scheduler frees blocks of a request (window slide,
\* preemption, stall fix, load-failure restart, abort), the connector names
\* those its stores still read (request_blocks_freed); they keep one
\* reference (KVCacheManager.held_blocks, a block at most once per request)
\* until finished_sending.
SaveHold == Fixed
\* Patch [00a.4 Fix a stall]: when the first waiting request cannot be allocated and nothing
\* runs, the other waiting requests back from async loads free their blocks
\* and start over (FreeWaiting).
StallFix == Fixed
\* Patch [00c.1 All sharers of a failed KV block]: every request that counts an invalid block as computed truncates
\* at its own first invalid block, and blocks from there on leave the prefix
\* cache (FixedScan); before it, the first holder recomputes for all and
\* policy "recompute" evicts nothing.
SharedInvalidFix == Fixed
\* Patch [00c.1 All sharers of a failed KV block]: KVCacheManager.uncache_blocks(req_id, num_computed_tokens) after
\* the truncation: num_cached_block becomes min(num_cached_block,
\* num_computed_tokens // block_size) in every KV cache group, so the blocks
\* the request computes again are published again (Publish, like
\* BlockPool.cache_full_blocks, skips blocks that already have a hash: a
\* sharer cached them again first).
Uncache == Fixed
\* Patch [00c.3 Handle a failed sync KV load]: a running request's load-failure range is the tokens it computed
\* before its step (num_computed_tokens less the tokens in flight that are
\* not external), not num_cached_tokens (which preemption never resets:
\* series-stale-read-preempt).
RangeByComputed == Fixed
\* Patch [00c.4 No new KV load]: Scheduler._update_requests_with_invalid_blocks marks every request
\* a load failure affects (KVConnectorRequest.load_failed); a marked
\* request takes no external tokens any more (it computes them); the mark
\* goes when the request finishes (Scheduler._free_request). Without it, a
\* connector that offers the same tokens and fails at every attempt keeps the
\* request loading for ever (series-loads-fail-alloc-only).
NoReload == Fixed
\* The requests a load failure marks, of those it affected (aff, with their
\* new num_computed_tokens nc): all of them.
Marked(aff, nc) == aff
\* Patches [03.1 Keep HMA on] and [03.3 Allocate only the external blocks]: one HMA decision. VllmConfig leaves the hybrid KV cache
\* manager on with a connector only if the connector supports it
\* (connector_supports_hma: a SupportsHMA subclass whose
\* supports_hma_with_config returns True); the scheduler's allocation and
\* its finish path read that decision (kv_connector_uses_hma, kept in
\* Scheduler.connector_uses_hma).
\*  - ConnectorHMA TRUE: the two KV cache groups; external tokens the
\*    sliding window skips get the null block (FreshSkip); a finish calls
\*    request_finished_all_groups with the table of every group.
\*  - ConnectorHMA FALSE: HMA is off. A model with full-attention layers then
\*    has one full-attention group (its sliding-window layers are unified
\*    into it), which skips no token; the difference shows on a model whose
\*    only KV cache group is a sliding window, so that is the layout here
\*    (Groups = {"swa"}). The scheduler allocates the external tokens as new
\*    tokens (num_new_tokens + num_external_computed_tokens, and no
\*    num_external_computed_tokens): a real block for every external token,
\*    only the local hit null-padded, as on vLLM 0.13.0; a finish calls
\*    request_finished with the table of the one group (block_ids[0]).
\* The null padding of skipped external tokens is that of a connector that
\* uses HMA.
PadExternal == ConnectorHMA
\* The full-attention group exists (HMA on).
HasFull == ConnectorHMA
\* The connector method a finish (or abort) calls (Scheduler._connector_finished).
FinishCall == IF ConnectorHMA THEN "request_finished_all_groups"
              ELSE "request_finished"
\* The Mamba stage ([09.1 Mamba groups with KV connectors]): a connector
\* that moves the state of Mamba layers
\* (SupportsHMA.supports_mamba_with_config) is used with a model whose
\* second KV cache group is a Mamba group (Kind = "mamba"): the commits of
\* stage 03 and the series after them, HMA on and prefix caching on (each
\* Mamba block holds the layers' state after its last token,
\* mamba_block_size = B; KVConnectorFactory.create_connector refuses a
\* Mamba group with either off) and no speculative decoding (vLLM 0.13.0
\* refuses it with the Mamba layers that have prefix caching). A Mamba layer reads
\* only the state after the last computed token (StateRead), so a Mamba
\* group skips every token before it (SkippedTokens); the computed tokens
\* that end with external ones end on a block boundary (ExtToLoad); a
\* running request keeps every block it holds (RemovedBlocks); a prefix
\* cache hit needs the state block of its last token (HitTail). A failed
\* load needs nothing of its own: Scheduler._update_requests_with_invalid_
\* blocks truncates at the first invalid block of every group and
\* can_recompute_from (CanRecomputeFrom) asks the Mamba group too.
IsMamba == Kind = "mamba"

-----------------------------------------------------------------------------
Null == 0                                 \* the null block (BlockPool.null_block)
Blocks == 1..N                            \* the physical blocks
\* kv_cache_group_id, by attention type: full attention and a sliding window
\* or a Mamba group (Kind), or with HMA off the sliding window alone
\* (ConnectorHMA).
Groups == IF HasFull THEN {"full", Kind} ELSE {Kind}
NoHash == <<>>                            \* block_hash of a block not in the cache
NoStep == [on |-> FALSE, from |-> 0, n |-> 0, d |-> 0, e |-> 0]  \* no step in flight
EmptyTables == [g \in Groups |-> <<>>]
NoBlocks == [g \in Groups |-> <<>>]

Min(a, b) == IF a < b THEN a ELSE b
Max(a, b) == IF a > b THEN a ELSE b
CeilDiv(a, b) == (a + b - 1) \div b       \* vllm.utils.math_utils.cdiv
\* num_cached_block of each group after uncache_blocks(req_id, nc) (Uncache).
Uncached(old, nc) == IF Uncache THEN [g \in Groups |-> Min(old[g], nc \div B)] ELSE old
Range(s) == {s[i] : i \in DOMAIN s}
Real(s) == Range(s) \ {Null}              \* the physical blocks a table names
Count(s, b) == Cardinality({i \in DOMAIN s : s[i] = b})
\* The k lowest ids of S (the free queue's order is abstracted to ids).
Lowest(S, k) == {x \in S : Cardinality({y \in S : y < x}) < k}
\* The blocks of S in ascending order.
SeqOf(S) == [i \in 1..Cardinality(S) |->
              CHOOSE x \in S : Cardinality({y \in S : y < x}) = i - 1]
Without(q, r) == SelectSeq(q, LAMBDA x : x # r)
\* The same function, evaluated once (TLC applies [x \in S |-> e] lazily).
SeqFcn(f) == CHOOSE v \in {f} : TRUE
RECURSIVE ChoiceSeqs(_)
\* Every sequence whose i-th element is in ss[i].
ChoiceSeqs(ss) == IF ss = <<>> THEN {<<>>}
                  ELSE {<<x>> \o rest : x \in Head(ss), rest \in ChoiceSeqs(Tail(ss))}

\* Trailing blocks a sliding-window hit needs (sliding_window_contiguous_blocks).
Contig == CeilDiv(W - 1, B)
\* Trailing blocks a hit of the second group needs: a sliding window's
\* Contig, a Mamba group's state block of the hit's last token
\* (MambaManager.find_longest_cache_hit; the null block before it).
HitTail == IF IsMamba THEN 1 ELSE Contig
\* SingleTypeKVCacheManager.get_num_skipped_tokens(n): tokens no layer of
\* group g reads again once n tokens are computed (the next token, n, reads
\* n-W+1..n in the window; a Mamba layer reads the state after token n-1).
SkippedTokens(g, n) ==
    CASE g = "swa" -> Max(0, n - W + 1)
      [] g = "mamba" -> Max(0, n - 1)
      [] OTHER -> 0
\* Blocks holding only skipped tokens (num_skipped_tokens // block_size).
SkippedBlocks(g, n) == SkippedTokens(g, n) \div B
\* The leading blocks of a request's table of group g that
\* remove_skipped_blocks frees once n tokens are computed: the skipped ones,
\* none in a Mamba group (MambaManager.remove_skipped_blocks keeps every
\* block of a request until the request is freed).
RemovedBlocks(g, n) == IF g = "mamba" THEN 0 ELSE SkippedBlocks(g, n)
\* The hash of block i (1-based) of request r in group g (token ids -> hashes).
Hash(g, r, i) == IF i * B <= Shared THEN <<g, i>> ELSE <<g, i, r>>
MaxBlocks == CeilDiv(MaxLen + MaxDraft, B)  \* longest block table
\* Table slot (1-based) of token position p (0-based).
Slot(p) == p \div B + 1

(***************************************************************************)
(* Attention, written from its definition (not from the skip rule): token *)
(* t of a full-attention layer reads every token 0..t; a sliding-window   *)
(* layer of window W reads the W tokens t-W+1..t (vLLM's sliding_window   *)
(* counts the token itself). A Mamba layer attends to no token: it        *)
(* computes token t from the state after token t-1, so a step of tokens   *)
(* from.. reads the state after token from-1 only (it computes the       *)
(* others), none from token 0; the state after token p is in the block of *)
(* token p (StateRead).                                                   *)
(***************************************************************************)
Attends(g, t) ==
    CASE g = "full" -> 0..t
      [] g = "swa" -> {p \in 0..t : t - p < W}
      [] OTHER -> {}
StateRead(t) == IF t = 0 THEN {} ELSE {t - 1}

VARIABLES
    ref,        \* BlockPool: ref_cnt of each physical block
    hash,       \* BlockPool: block_hash of each block (prefix-cache key), NoHash if not cached
    freeQ,      \* BlockPool.free_block_queue: blocks with ref_cnt 0, cached or not
    status,     \* Request.status: waiting, loading (WAITING_FOR_REMOTE_KVS), running, finishing (finished, blocks kept for a transfer), done
    len,        \* Request.num_tokens: prompt plus accepted output tokens
    computed,   \* Request.num_computed_tokens (advanced when the step is scheduled)
    table,      \* SingleTypeKVCacheManager.req_to_blocks, one block table per group
    ncached,    \* SingleTypeKVCacheManager.num_cached_block, per group
    step,       \* the step scheduled for the request and not yet returned: first token, verified tokens n, draft tokens d, external tokens e it loads synchronously
    loads,      \* table slots <<group, slot, block>> an asynchronous connector load writes, per request
    saves,      \* table slots <<group, slot, block>> a connector save reads, per request
    held,       \* blocks kept (ref held) for an in-flight save after the table let them go (SaveHold only)
    running,    \* Scheduler.running, in order; preemption takes the last
    failures,   \* connector load failures injected so far (LoadsFail: 1 once a load failed)
    bad,        \* block slots <<block, offset>> whose KV a failed load left invalid
    cachedTok,  \* Request.num_cached_tokens: set once, when first scheduled (-1 before)
    order,      \* Scheduler.waiting's order, front first (all requests; preemption moves one to the front)
    stallHead,  \* StallFix: the request patch [00a.4 Fix a stall] could not allocate (first in Scheduler.waiting) and those it freed (behind it)
    noLoad,     \* NoReload: requests a load failure affected (KVConnectorRequest.load_failed)
    event       \* the step just taken: action, request, blocks per group, arguments

vars == <<ref, hash, freeQ, status, len, computed, table, ncached, step, loads,
          saves, held, running, failures, bad, cachedTok, order, stallHead, noLoad,
          event>>
\* Distinct states as TLC counts them: `event` is history only; cachedTok is
\* read only when loads can fail; the waiting queue's order only by the
\* stall fix (which has victims only with async loads), and only among the
\* requests waiting or loading (a running request goes to the front when it
\* is preempted, a finished one never waits again).
WaitingOrder == SelectSeq(order, LAMBDA q : status[q] \in {"waiting", "loading"})
View == <<ref, hash, freeQ, status, len, computed, table, ncached, step, loads,
          saves, held, running, failures, bad,
          IF MaxFailures = 0 THEN 0 ELSE cachedTok,
          IF StallFix /\ AsyncLoad THEN WaitingOrder ELSE <<>>, stallHead, noLoad>>

Ev(act, r, blks, args) == [act |-> act, req |-> r, blocks |-> blks, args |-> args]
\* The arguments of an allocation's event (args) for plan p: with a Mamba
\* group also the external tokens the connector offered (offeredTokens),
\* of which extTokens are loaded (ExtToLoad).
WithOffer(args, p) ==
    IF IsMamba
    THEN [k \in DOMAIN args \cup {"offeredTokens"} |->
            IF k = "offeredTokens" THEN p.offered ELSE args[k]]
    ELSE args

-----------------------------------------------------------------------------
(* Prefix cache (BlockPool.get_cached_block, find_longest_cache_hit). *)
Lookup(h) == {b \in Blocks : hash[b] = h}
FullHit(r, h) == ~HasFull \/ \A i \in 1..h : Lookup(Hash("full", r, i)) # {}
OtherHit(r, h) ==
    \A i \in (Max(h - HitTail, 0) + 1)..h : Lookup(Hash(Kind, r, i)) # {}
\* HybridKVCacheCoordinator.find_longest_cache_hit, in blocks: the longest
\* full-attention prefix hit whose last HitTail blocks also hit in the
\* second group (a sliding window's last Contig blocks, a Mamba group's
\* state block); at most num_tokens - 1 tokens (one token is always
\* computed).
HitLen(r) ==
    LET ok == {h \in 0..((len[r] - 1) \div B) : FullHit(r, h) /\ OtherHit(r, h)}
    IN  CHOOSE h \in ok : \A h2 \in ok : h2 <= h
\* The hit blocks per group (get_one_block: any block of the key); the
\* second group's hit is null-padded before its last HitTail blocks.
HitChoices(r, h) ==
    {[g \in Groups |-> IF g = "full" THEN f ELSE s] :
        f \in IF HasFull THEN ChoiceSeqs([i \in 1..h |-> Lookup(Hash("full", r, i))])
              ELSE {<<>>},
        s \in ChoiceSeqs([i \in 1..h |-> IF i <= h - HitTail THEN {Null}
                                          ELSE Lookup(Hash(Kind, r, i))])}

Entries(r) == UNION {Real(table[r][g]) : g \in Groups}
AllOf(r) == IF HasFull THEN table[r]["full"] \o table[r][Kind] ELSE table[r][Kind]
\* The real blocks at slots lo..hi of tables tbls (all groups).
BlocksAt(tbls, lo, hi) ==
    {tbls[x[1]][x[2]] : x \in {x \in Groups \X (lo..hi) : x[2] <= Len(tbls[x[1]])}}
        \ {Null}
\* The table slots <<group, slot, block>> at slots lo..hi of tables tbls
\* (a transfer reads or writes a block at its place in the table).
SlotsAt(tbls, lo, hi) ==
    {<<x[1], x[2], tbls[x[1]][x[2]]>> :
        x \in {x \in Groups \X (lo..hi) : x[2] <= Len(tbls[x[1]]) /\ tbls[x[1]][x[2]] # Null}}
TB(T) == {x[3] : x \in T}                 \* the blocks of table slots T
\* Slots a synchronous load writes while the step is in flight.
SyncLoads(r) ==
    IF step[r].on /\ step[r].e > 0
    THEN SlotsAt(table[r], Slot(step[r].from - step[r].e), Slot(step[r].from - 1))
    ELSE {}
TransferSlots(r) == loads[r] \cup saves[r] \cup SyncLoads(r)
Transfers(r) == TB(TransferSlots(r))
InFlight == UNION {Transfers(r) : r \in Req}
\* A waiting request that holds blocks (back from an async load, or
\* truncated by a load failure).
Fresh(r) == status[r] = "waiting" /\ computed[r] = 0
\* The tokens a request had computed before its step in flight.
ReadFrom(r) == IF step[r].on THEN step[r].from ELSE computed[r]

(* Scheduler choices. *)
\* Connector.get_num_new_matched_tokens: external tokens past the local hit.
ExtChoices(r) ==
    IF Fresh(r) /\ r \notin noLoad THEN 0..Min(MaxExt, len[r] - 1 - HitLen(r) * B)
    ELSE {0}
\* KVCacheManager.get_num_external_computed_tokens
\* ([09.1 Mamba groups with KV connectors]): with a Mamba group
\* (KVCacheCoordinator.get_external_computed_tokens_alignment: the least
\* common multiple of the groups' alignments, the Mamba block size B here),
\* the computed tokens (request r's hit and the e external tokens the
\* connector offers after it) end on a block boundary before the request's
\* last token, as a hit does: the external tokens are shortened to it and
\* the request computes the rest; without one, all are loaded. In tokens: a
\* hit of hit tokens, a request of num tokens.
ExtToLoad(hit, e, num) ==
    IF IsMamba /\ e > 0
    THEN Max(0, (Min(hit + e, num - 1) \div B) * B - hit)
    ELSE e
\* The external tokens request r loads of the e its connector offers.
Loaded(r, e) == IF IsMamba THEN ExtToLoad(HitLen(r) * B, e, len[r]) ELSE e
\* A load is asynchronous only if tokens are loaded (the scheduler makes it
\* synchronous when the shortened count is 0).
AsyncChoices(r, e) ==
    IF Loaded(r, e) > 0 /\ AsyncLoad THEN {FALSE, TRUE} ELSE {FALSE}
\* Draft tokens proposed for a decode step (num_spec_tokens).
DraftChoices(r) ==
    IF computed[r] > 0 /\ computed[r] + 1 = len[r]
    THEN 0..Min(MaxDraft, MaxLen - len[r] - 1)
    ELSE {0}

(***************************************************************************)
(* KVCacheManager.allocate_slots, planned for all groups. A fresh request *)
(* (waiting, nothing computed) starts its tables from the hit `hit` (h    *)
(* blocks) and the external tokens it loads of the e its connector offers *)
(* (ExtToLoad); a request holding blocks first runs                       *)
(* remove_skipped_blocks. Returns the tables' prefix (`base`), the hits to *)
(* claim, the new blocks per group, the blocks leaving the tables, and     *)
(* get_num_blocks_to_allocate's count (`predicted`), computed as the code  *)
(* computes it, apart from the allocation itself.                         *)
(***************************************************************************)
\* vLLM 0.13.0 null-pads the local hit of a fresh table only.
PadsHitOnly == Policy = "Legacy"
\* The skipped prefix of a fresh table (save_new_computed_blocks) after a
\* local hit of h blocks, with c tokens computed (hit and external).
FreshSkip(g, c, h) ==
    IF g = "full" THEN 0
    ELSE IF PadsHitOnly
         THEN Max(h - Contig, 0)          \* 0.13.0: only the hit is padded
         ELSE IF ~PadExternal
         THEN SkippedBlocks(g, h * B)      \* HMA off: the external tokens are new tokens
         ELSE SkippedBlocks(g, c)          \* the series: everything skipped
\* Null entries at the head of a fresh table: its skipped prefix.
FreshPad(g, c, h) == FreshSkip(g, c, h)
\* The evictable (ref_cnt 0) hits of group g that a fresh table claims past
\* its skipped prefix of sk blocks (get_num_blocks_to_allocate counts them:
\* touching them takes them from the free queue).
EvictableHits(hit, g, sk, h) ==
    Cardinality({i \in (sk + 1)..h : hit[g][i] # Null /\ ref[hit[g][i]] = 0})
Plan(r, e, async, d, hit) ==
  LET fresh == Fresh(r)
      h == IF fresh THEN HitLen(r) ELSE 0
      x == IF fresh /\ IsMamba THEN ExtToLoad(h * B, e, len[r]) ELSE e
      c == IF fresh THEN h * B + x ELSE computed[r]
      n == IF async THEN 0 ELSE Min(Chunk, len[r] - c)
      nb == CeilDiv(c + n + d, B)
      s == RemovedBlocks(Kind, c)
      pad == [g \in Groups |-> FreshPad(g, c, h)]
      base == SeqFcn([g \in Groups |->
                IF fresh
                THEN [i \in 1..Max(pad[g], h) |->
                        IF i <= pad[g] THEN Null ELSE hit[g][i]]
                ELSE [i \in DOMAIN table[r][g] |->
                        IF i <= RemovedBlocks(g, c) THEN Null
                        ELSE table[r][g][i]]])
      removed == IF fresh THEN {}
                 ELSE {table[r][Kind][i] :
                         i \in 1..Min(s, Len(table[r][Kind]))} \ {Null}
      claimed == [g \in Groups |-> IF fresh THEN Real(base[g]) ELSE {}]
      newCount == [g \in Groups |-> Max(nb - Len(base[g]), 0)]
      toHeld == IF SaveHold THEN (removed \cap Transfers(r)) \ held[r] ELSE {}
      \* get_num_blocks_to_allocate, per group: new blocks past the skipped
      \* prefix and the hits, plus the evictable (ref_cnt 0) hits claimed;
      \* a request holding blocks: the slots its table still lacks.
      count(g) ==
        IF fresh
        THEN LET sk == FreshSkip(g, c, h)
             IN  Max(0, nb - Max(sk, h))
                 + EvictableHits(hit, g, sk, h)
        ELSE Max(0, nb - Len(table[r][g]))
  IN [fresh |-> fresh, h |-> h, c |-> c, n |-> n, d |-> d, e |-> x, offered |-> e,
      async |-> async, nb |-> nb, base |-> base, claimed |-> claimed,
      newCount |-> newCount, removed |-> removed, toHeld |-> toHeld,
      toFree |-> removed \ toHeld,
      predicted |-> (IF HasFull THEN count("full") ELSE 0) + count(Kind)]

\* Free queue after remove_skipped_blocks returned the plan's blocks.
FreeAfterRemove(p) == freeQ \cup {b \in p.toFree : ref[b] = 1}
\* Hits claimed (touched) before any group allocates, and after.
ClaimedIn(p, g) == IF g \in Groups THEN p.claimed[g] ELSE {}
ClaimFirst(p) == ClaimedIn(p, "full") \cup ClaimedIn(p, Kind)
ClaimLate(p) == {}
\* BlockPool.touch: every hit claimed gets one more reference.
Touched(p) == ClaimFirst(p) \cup ClaimLate(p)
\* BlockPool.get_new_blocks(k) from free set Q: the lowest uncached ids,
\* or any evictable cached blocks instead (eviction).
NewBlockChoices(Q, k) ==
    LET cached == {b \in Q : hash[b] # NoHash}
        plain == Q \ cached
    IN  {E \cup Lowest(plain, k - Cardinality(E)) :
           E \in {X \in SUBSET cached :
                    Cardinality(X) <= k /\ k - Cardinality(X) <= Cardinality(plain)}}
Fits(r, e, async, d, hit) ==
    \E p \in {Plan(r, e, async, d, hit)} : p.predicted <= Cardinality(FreeAfterRemove(p))
\* The next step of a request holding blocks does not fit (its hit is moot).
NextStepFits(r) == Fits(r, 0, FALSE, 0, NoBlocks)
\* Scheduler.schedule, waiting loop: allocate_slots returns None for waiting
\* request h (for some answer of the connector).
Refused(h) ==
    \E e \in ExtChoices(h),
       hit \in (IF Fresh(h) THEN HitChoices(h, HitLen(h)) ELSE {NoBlocks}) :
       \E async \in AsyncChoices(h, e) : ~Fits(h, e, async, 0, hit)
\* One answer of the connector for which h is refused, and its plan
\* (recorded in FreeWaiting's event for the replays; CHOOSE: one successor).
RefusalOf(h) ==
    CHOOSE x \in {x \in [ext : ExtChoices(h), async : BOOLEAN,
                         hit : IF Fresh(h) THEN HitChoices(h, HitLen(h)) ELSE {NoBlocks}] :
                    x.async \in AsyncChoices(h, x.ext) /\ ~Fits(h, x.ext, x.async, 0, x.hit)} :
        TRUE
\* Scheduler._free_blocks_of_waiting_requests(h) (patch [00a.4 Fix a stall]): the waiting
\* requests other than h that hold blocks no load writes any more
\* (num_computed_tokens > 0; the model moves a request back from its load to
\* "waiting" when the load is reported).
StallVictims(h) == {q \in Req \ {h} : status[q] = "waiting" /\ computed[q] > 0}
\* Scheduler.waiting's order, as far as patch [00a.4 Fix a stall] needs it: the requests it
\* freed stay behind the one it could not allocate until that one is
\* scheduled (any other order of the waiting queue is left open).
NoHead == [h |-> "none", vs |-> {}]
Yields(r) == stallHead # NoHead /\ r \in stallHead.vs
Pos(r) == CHOOSE i \in DOMAIN order : order[i] = r
\* h is the first waiting request in Scheduler.waiting (the ones before it
\* are loading: skipped).
FirstWaiting(h) == \A q \in Req \ {h} : status[q] = "waiting" => Pos(h) < Pos(q)

\* BlockPool.cache_full_blocks for request r: slots from[g]+1 .. to of each
\* group, skipping null blocks and blocks already cached. A key may name
\* several blocks (BlockHashToBlockMap keeps them all).
Publish(h0, r, tbl, from, to) ==
  [b \in Blocks |->
     LET cands == {gi \in Groups \X (1..MaxBlocks) :
                      /\ gi[2] > from[gi[1]] /\ gi[2] <= to
                      /\ gi[2] <= Len(tbl[gi[1]]) /\ tbl[gi[1]][gi[2]] = b}
     IN  IF cands = {} \/ h0[b] # NoHash THEN h0[b]
         ELSE LET gi == CHOOSE x \in cands : TRUE IN Hash(gi[1], r, gi[2])]
NewCached(old, to) == [g \in Groups |-> Max(old[g], to)]
\* The full blocks allocate_slots publishes for request r with plan p, up
\* to this slot: none while an asynchronous load writes them
\* (delay_cache_blocks), else those of the verified tokens (no draft token).
PublishTo(p, r) == IF p.async THEN 0 ELSE Min(p.c + p.n, len[r]) \div B

RECURSIVE FreeSeq(_)
\* The blocks KVCacheManager.free returns for the requests Qs (all groups).
FreeSeq(Qs) == IF Qs = {} THEN <<>>
               ELSE LET q == CHOOSE x \in Qs : TRUE IN AllOf(q) \o FreeSeq(Qs \ {q})
\* BlockPool.free_blocks of a sequence of blocks (repeats counted).
RefAfterFree(s) == [b \in Blocks |-> ref[b] - Count(s, b)]
FreeQAfterFree(s) ==
    freeQ \cup {b \in Range(s) \ {Null} : ref[b] - Count(s, b) = 0}

\* KVCacheManager.can_recompute_from(r, t): in every group, the first block
\* read by computing from token t on is real (or not allocated yet).
CanRecomputeFrom(r, t) ==
    \A g \in Groups :
        LET fb == SkippedBlocks(g, t) + 1
        IN  fb > Len(table[r][g]) \/ table[r][g][fb] # Null

\* The slots a step writes (its tokens, draft tokens included).
Written(r) ==
    {<<table[r][g][Slot(p)], p % B>> :
       <<g, p>> \in {x \in Groups \X (step[r].from..(step[r].from + step[r].n + step[r].d - 1)) :
                       Slot(x[2]) <= Len(table[r][x[1]]) /\ table[r][x[1]][Slot(x[2])] # Null}}
\* Slots of request r's tables at token positions lo..hi, in blocks of S.
SlotsIn(r, lo, hi, S) ==
    {<<table[r][g][Slot(p)], p % B>> :
       <<g, p>> \in {x \in Groups \X (lo..hi) :
                       Slot(x[2]) <= Len(table[r][x[1]]) /\ table[r][x[1]][Slot(x[2])] \in S}}

\* The 1-based slots of r's tables (any group) naming a block of S, up to rng.
SlotsOf(q, S, rng) ==
    {i \in 1..rng : \E g \in Groups : i <= Len(table[q][g]) /\ table[q][g][i] \in S}
LongestTable(q) == IF HasFull THEN Max(Len(table[q]["full"]), Len(table[q][Kind]))
                   ELSE Len(table[q][Kind])
SetMin(S) == CHOOSE x \in S : \A y \in S : x <= y

(***************************************************************************)
(* Scheduler._update_requests_with_invalid_blocks, as stage 03 does it,   *)
(* over the requests qs in order (async loads first, then Scheduler.running)*)
(* with invalid blocks inv. A request's range is its table slots (async)  *)
(* or num_cached_tokens (sync). The first request holding an unmarked     *)
(* invalid block recomputes from it (or from 0 if can_recompute_from says *)
(* no); a request whose invalid blocks were all marked by an earlier one  *)
(* reverts to num_cached_tokens. Returns [nc: new num_computed_tokens of  *)
(* the affected, marked, first: the recomputing ones, evict: their blocks *)
(* from the first invalid slot on (sync only)].                           *)
(***************************************************************************)
RECURSIVE ScanInvalid(_, _, _)
ScanInvalid(qs, inv, acc) ==
  IF qs = <<>> THEN acc
  ELSE
    LET q == Head(qs)
        sync == status[q] # "loading"
        rng == IF sync THEN CeilDiv(Max(cachedTok[q], 0), B) ELSE LongestTable(q)
        all == SlotsOf(q, inv, rng)
        unmarked == SlotsOf(q, inv \ acc.marked, rng)
        first == IF unmarked = {} THEN 0 ELSE SetMin(unmarked)
        t == (first - 1) * B
        nc == IF first = 0 THEN cachedTok[q]
              ELSE IF CanRecomputeFrom(q, t) THEN t ELSE 0
        marks == IF first = 0 THEN {}
                 ELSE {table[q][g][i] : <<g, i>> \in
                         {x \in Groups \X (first..rng) : x[2] <= Len(table[q][x[1]])}}
                      \cap inv
        evict == IF first = 0 \/ ~sync THEN {}
                 ELSE BlocksAt(table[q], first, LongestTable(q))
    IN ScanInvalid(Tail(qs), inv,
         IF all = {} THEN acc
         ELSE [nc |-> acc.nc @@ (q :> nc), marked |-> acc.marked \cup marks,
               first |-> acc.first \cup (IF first = 0 THEN {} ELSE {q}),
               evict |-> acc.evict \cup evict])
NoScan == [nc |-> <<>>, marked |-> {}, first |-> {}, evict |-> {}]

(***************************************************************************)
(* Scheduler._update_requests_with_invalid_blocks with SharedInvalidFix    *)
(* (patches [00c.1 All sharers of a failed KV block],                       *)
(* [03.2 Connector paths handle every KV cache group],                    *)
(* [03.3 Allocate only the external blocks]): every request that counts   *)
(* an invalid block as computed truncates at its own first invalid slot    *)
(* (over all groups), or starts over when can_recompute_from says no; no   *)
(* request counts on another one. Counted as computed:                     *)
(* KVConnectorRequest's num_computed_tokens_after_recving (loading, =      *)
(* computed in the model), num_cached_tokens (running; with                *)
(* RangeByComputed, the tokens computed before its step), computed         *)
(* (waiting with blocks). Its blocks from the first invalid slot on leave  *)
(* the prefix cache (evict_blocks, for every affected request).            *)
(***************************************************************************)
FixedScan(inv) ==
  LET rng(q) == IF status[q] = "running"
                THEN IF RangeByComputed THEN CeilDiv(ReadFrom(q), B)
                     ELSE CeilDiv(Max(cachedTok[q], 0), B)
                ELSE CeilDiv(computed[q], B)
      holders == {q \in Req :
                    /\ \/ status[q] \in {"loading", "running"}
                       \/ status[q] = "waiting" /\ computed[q] > 0
                    /\ SlotsOf(q, inv, rng(q)) # {}}
      first(q) == SetMin(SlotsOf(q, inv, rng(q)))
      nc(q) == IF CanRecomputeFrom(q, (first(q) - 1) * B) THEN (first(q) - 1) * B ELSE 0
  IN [nc |-> [q \in holders |-> nc(q)], marked |-> inv, first |-> holders,
      evict |-> UNION {BlocksAt(table[q], first(q), LongestTable(q)) : q \in holders}]

-----------------------------------------------------------------------------
(***************************************************************************)
(* Actions. Each names the vLLM code it stands for.                        *)
(***************************************************************************)

Init ==
    /\ ref = [b \in Blocks |-> 0]
    /\ hash = [b \in Blocks |-> NoHash]
    /\ freeQ = Blocks
    /\ status = [r \in Req |-> "waiting"]
    /\ len = [r \in Req |-> PromptLen]
    /\ computed = [r \in Req |-> 0]
    /\ table = [r \in Req |-> EmptyTables]
    /\ ncached = [r \in Req |-> [g \in Groups |-> 0]]
    /\ step = [r \in Req |-> NoStep]
    /\ loads = [r \in Req |-> {}]
    /\ saves = [r \in Req |-> {}]
    /\ held = [r \in Req |-> {}]
    /\ running = <<>>
    /\ failures = 0
    /\ bad = {}
    /\ cachedTok = [r \in Req |-> -1]
    /\ order \in {o \in [1..Cardinality(Req) -> Req] : Range(o) = Req}
    /\ stallHead = NoHead
    /\ noLoad = {}
    /\ event = Ev("Init", "none", NoBlocks, [none |-> 0])

\* Scheduler.schedule for request r: get_computed_blocks (the hit),
\* connector.get_num_new_matched_tokens (external tokens, sync or async),
\* allocate_slots (remove_skipped_blocks, get_num_blocks_to_allocate, touch
\* and save_new_computed_blocks, allocate_new_blocks = get_new_blocks with
\* eviction, cache_full_blocks) and connector.update_state_after_alloc.
AllocateSlots(r) ==
  /\ status[r] \in {"waiting", "running"} /\ ~step[r].on
  /\ ~Yields(r)
  /\ stallHead' = IF stallHead # NoHead /\ stallHead.h = r THEN NoHead ELSE stallHead
  /\ \E e \in ExtChoices(r), d \in DraftChoices(r),
        hit \in (IF Fresh(r) THEN HitChoices(r, HitLen(r)) ELSE {NoBlocks}) :
     \E async \in AsyncChoices(r, e) :
     \* (\E x \in {v} binds a value once: TLC evaluates a LET-bound function
     \* again at every application.)
     \E p \in {Plan(r, e, async, d, hit)} :
     \E q1 \in {FreeAfterRemove(p)} :
     /\ p.predicted <= Cardinality(q1)
     /\ \E nf \in NewBlockChoices(q1 \ ClaimFirst(p),
                                 IF HasFull THEN p.newCount["full"] ELSE 0) :
        \E ns \in NewBlockChoices(q1 \ (ClaimFirst(p) \cup nf \cup ClaimLate(p)),
                                  p.newCount[Kind]) :
        \E tbl \in {[g \in Groups |-> p.base[g] \o SeqOf(IF g = "full" THEN nf ELSE ns)]} :
        LET q3 == q1 \ (ClaimFirst(p) \cup nf \cup ClaimLate(p) \cup ns)
            touched == Touched(p)
            h1 == [b \in Blocks |-> IF b \in nf \cup ns THEN NoHash ELSE hash[b]]
            publishTo == PublishTo(p, r)
            from == IF p.fresh THEN [g \in Groups |-> Len(p.base[g])] ELSE ncached[r]
        IN
        /\ ref' = [b \in Blocks |->
                     ref[b] - (IF b \in p.toFree THEN 1 ELSE 0)
                            + (IF b \in touched THEN 1 ELSE 0)
                            + (IF b \in nf \cup ns THEN 1 ELSE 0)]
        /\ freeQ' = q3
        /\ hash' = Publish(h1, r, tbl, from, publishTo)
        /\ table' = [table EXCEPT ![r] = tbl]
        /\ ncached' = [ncached EXCEPT ![r] = NewCached(from, publishTo)]
        /\ held' = [held EXCEPT ![r] = held[r] \cup p.toHeld]
        /\ loads' = [loads EXCEPT ![r] =
                       IF p.async THEN SlotsAt(tbl, p.h + 1, CeilDiv(p.c, B)) ELSE {}]
        \* SaveMode "step": the connector saves the blocks this step fills
        \* while the step runs (wait_for_save at its end).
        /\ saves' = IF SaveMode = "step" /\ ~p.async
                    THEN [saves EXCEPT ![r] =
                            SlotsAt(tbl, p.c \div B + 1, Min(p.c + p.n, len[r]) \div B)]
                    ELSE saves
        /\ computed' = [computed EXCEPT ![r] = p.c + p.n + p.d]
        /\ step' = [step EXCEPT ![r] =
                      IF p.async THEN NoStep
                      ELSE [on |-> TRUE, from |-> p.c, n |-> p.n, d |-> p.d, e |-> p.e]]
        /\ running' = IF status[r] = "waiting" /\ ~p.async
                      THEN Append(running, r) ELSE running
        /\ status' = [status EXCEPT ![r] = IF p.async THEN "loading" ELSE "running"]
        /\ cachedTok' = IF ~p.async /\ cachedTok[r] < 0
                        THEN [cachedTok EXCEPT ![r] = p.c] ELSE cachedTok
        /\ bad' = {x \in bad : x[1] \notin nf \cup ns}
        /\ event' = Ev("AllocateSlots", r,
                       [g \in Groups |-> SeqOf(IF g = "full" THEN nf ELSE ns)],
                       WithOffer([hitBlocks |-> p.h, extTokens |-> p.e, async |-> p.async,
                                  newTokens |-> p.n, draftTokens |-> p.d,
                                  predictedBlocks |-> p.predicted,
                                  takenBlocks |-> Cardinality(q1) - Cardinality(q3)], p))
        /\ UNCHANGED <<len, failures, order, noLoad>>

\* Scheduler.schedule, waiting loop: allocate_slots returned None for a
\* waiting request (replays only: Refusals; no state changes).
Refuse(r) ==
  /\ Refusals /\ status[r] = "waiting"
  /\ \E e \in ExtChoices(r),
        hit \in (IF Fresh(r) THEN HitChoices(r, HitLen(r)) ELSE {NoBlocks}) :
     \E async \in AsyncChoices(r, e) :
       \E p \in {Plan(r, e, async, 0, hit)} :
       /\ p.predicted > Cardinality(FreeAfterRemove(p))
       /\ event' = Ev("Refused", r, NoBlocks,
                      WithOffer([hitBlocks |-> p.h, extTokens |-> p.e, async |-> async,
                                 newTokens |-> p.n, draftTokens |-> 0,
                                 predictedBlocks |-> p.predicted,
                                 freeBlocks |-> Cardinality(FreeAfterRemove(p))], p))
  /\ UNCHANGED <<ref, hash, freeQ, status, len, computed, table, ncached, step,
                 loads, saves, held, running, failures, bad, cachedTok, order,
                 stallHead, noLoad>>

\* request_finished -> delay_free_blocks: the free of a finished or aborted
\* request waits while a transfer runs or blocks are held for one.
DelaysFree(transfers, holds) == transfers # {} \/ holds # {}
\* Scheduler._free_request clears r's KVConnectorRequest.load_failed.
Unmark(marks, r) == marks \ {r}

\* The blocks of request v that SaveHold keeps when v's tables are freed
\* while it runs: those a store that outlives the step still reads (a step's
\* own loads and in-step saves are over when it returned).
Keep(v) == IF SaveHold /\ SaveMode = "async"
           THEN (Entries(v) \cap TB(saves[v])) \ held[v] ELSE {}

\* Scheduler.update_from_output: the step ran; a decode step accepts a of its
\* d draft tokens and samples one more token; with async saves the connector
\* starts storing the blocks that became full; a request that reached MaxLen
\* finishes (request_finished: the free is delayed while a transfer runs).
Execute(r) ==
  /\ step[r].on
  \* LoadsFail: a step's synchronous load fails (SyncLoadFailed) first.
  \* (Not a disjunction: TLC would enumerate each true disjunct.)
  /\ ~(LoadsFail /\ step[r].e > 0)
  /\ \E a \in 0..step[r].d :
     LET st == step[r]
         sampled == st.from + st.n = len[r]
         c2 == st.from + st.n + a
         len2 == IF sampled THEN len[r] + 1 + a ELSE len[r]
         sv == IF SaveMode = "async"
               THEN saves[r] \cup SlotsAt(table[r], (st.from \div B) + 1, c2 \div B)
               ELSE {}
         fin == len2 >= MaxLen
         delay == DelaysFree(sv, held[r])
         fr == AllOf(r) \o SeqOf(held[r])
     IN
     /\ computed' = [computed EXCEPT ![r] = c2]
     /\ len' = [len EXCEPT ![r] = len2]
     /\ step' = [step EXCEPT ![r] = NoStep]
     /\ saves' = [saves EXCEPT ![r] = sv]
     /\ bad' = bad \ Written(r)
     /\ IF fin /\ ~delay
        THEN /\ ref' = RefAfterFree(fr)
             /\ freeQ' = FreeQAfterFree(fr)
             /\ table' = [table EXCEPT ![r] = EmptyTables]
             /\ ncached' = [ncached EXCEPT ![r] = [g \in Groups |-> 0]]
             /\ held' = [held EXCEPT ![r] = {}]
             /\ status' = [status EXCEPT ![r] = "done"]
             /\ running' = Without(running, r)
             /\ event' = Ev("Finish", r, table[r], [acceptedTokens |-> a, call |-> FinishCall])
        ELSE IF fin
        THEN /\ status' = [status EXCEPT ![r] = "finishing"]
             /\ running' = Without(running, r)
             /\ event' = Ev("FinishDelayed", r, NoBlocks,
                               [acceptedTokens |-> a, call |-> FinishCall])
             /\ UNCHANGED <<ref, freeQ, table, ncached, held>>
        ELSE /\ event' = Ev("Execute", r, NoBlocks, [acceptedTokens |-> a])
             /\ UNCHANGED <<ref, freeQ, table, ncached, held, status, running>>
     \* Scheduler._free_request (called when the request finishes) clears its
     \* KVConnectorRequest.load_failed (KVConnectorRequests.finish).
     /\ noLoad' = IF fin THEN Unmark(noLoad, r) ELSE noLoad
  /\ UNCHANGED <<hash, loads, failures, cachedTok, order, stallHead>>

\* Scheduler.update_from_output with invalid_block_ids: request r's
\* synchronous load (inside its step) failed from table slot i on, reported
\* with the step's output (Scheduler._handle_invalid_blocks, policy
\* "recompute"). Affected requests lose their step's output and resume from
\* their new num_computed_tokens; one that must start over and lacks blocks
\* for it (can_recompute_from(0) false) is preempted after its invalid blocks
\* leave the prefix cache. If r is not affected (only without patch [00c.3 Handle a failed sync KV load]: its
\* range, num_cached_tokens, does not reach the invalid blocks) its step
\* returns normally later. With LateReport the failure comes after the
\* affected running requests' next steps were scheduled: patch [00c.2 Preempt if a KV load failure] preempts
\* them (Scheduler._preempt_request: tables freed, held blocks kept,
\* num_computed_tokens 0; their place in the waiting queue is left open).
SyncLoadFailed(r) ==
  /\ step[r].on /\ step[r].e > 0 /\ IF LoadsFail THEN TRUE ELSE failures < MaxFailures
  /\ \E i \in Slot(step[r].from - step[r].e)..Slot(step[r].from - 1) :
     LET inv == BlocksAt(table[r], i, Slot(step[r].from - 1))
         \* The requests holding an invalid block are in this batch: their
         \* step is in flight, or their async load started with it.
         holders == {q \in Req \ {r} : Entries(q) \cap inv # {}}
         loading == {q \in Req : status[q] = "loading"}
         scan(lq) == IF SharedInvalidFix THEN FixedScan(inv)
                     ELSE ScanInvalid(lq \o running, inv, NoScan)
     IN
     /\ \A q \in holders : step[q].on \/ status[q] = "loading"
     /\ \E lq \in {o \in [1..Cardinality(loading) -> loading] :
                     Range(o) = loading} :
        LET sc == scan(lq)
            aff == DOMAIN sc.nc
            \* Running requests that must start over and lack blocks for it;
            \* waiting ones back from a load start over anyway (patch [00c.1 All sharers of a failed KV block]).
            restart == {q \in aff :
                          \/ /\ status[q] # "loading" /\ sc.nc[q] = 0
                             /\ (~CanRecomputeFrom(q, 0) \/ status[q] = "waiting")
                          \/ LateReport /\ status[q] = "running"}
            keep == UNION {Keep(q) : q \in restart}
            fr == SelectSeq(FreeSeq(restart), LAMBDA x : x \notin keep)
            unhash == IF SharedInvalidFix THEN sc.evict
                      ELSE UNION {Entries(q) \cap sc.evict : q \in restart}
        IN
        \* LoadsFail: failures are not bounded; failures only says one happened.
        /\ failures' = IF LoadsFail THEN 1 ELSE failures + 1
        /\ bad' = bad \cup SlotsIn(r, (i - 1) * B, step[r].from - 1, inv)
        /\ hash' = [b \in Blocks |-> IF b \in unhash THEN NoHash ELSE hash[b]]
        /\ ref' = RefAfterFree(fr)
        /\ freeQ' = FreeQAfterFree(fr)
        /\ table' = [q \in Req |-> IF q \in restart THEN EmptyTables ELSE table[q]]
        \* KVCacheManager.uncache_blocks for the affected that keep their tables.
        /\ ncached' = [q \in Req |-> IF q \in restart THEN [g \in Groups |-> 0]
                                     ELSE IF q \in aff THEN Uncached(ncached[q], sc.nc[q])
                                     ELSE ncached[q]]
        /\ held' = [q \in Req |-> IF q \in restart THEN held[q] \cup Keep(q) ELSE held[q]]
        /\ computed' = [q \in Req |-> IF q \in restart THEN 0
                                      ELSE IF q \in aff THEN sc.nc[q] ELSE computed[q]]
        \* The affected lose their step's output; r's own step, if r is not
        \* affected, returns later (its load is over).
        /\ step' = [q \in Req |-> IF q \in aff /\ status[q] # "loading" THEN NoStep
                                  ELSE IF q = r THEN [step[r] EXCEPT !.e = 0]
                                  ELSE step[q]]
        /\ saves' = [q \in Req |-> IF q \in aff /\ SaveMode = "step" THEN {}
                                   ELSE saves[q]]
        /\ status' = [q \in Req |-> IF q \in restart THEN "waiting" ELSE status[q]]
        /\ running' = SelectSeq(running, LAMBDA x : x \notin restart)
        /\ noLoad' = IF NoReload THEN noLoad \cup Marked(aff, sc.nc) ELSE noLoad
        /\ event' = Ev("SyncLoadFailed", r, NoBlocks,
                       [atSlot |-> i, affected |-> aff, restart |-> restart,
                        computedTokens |-> IF r \in restart THEN 0
                                           ELSE IF r \in aff THEN sc.nc[r]
                                           ELSE computed[r]])
        /\ UNCHANGED <<len, loads, cachedTok, order, stallHead>>

\* Scheduler.schedule, running loop: allocate_slots returned None for
\* running request r, so the last running request is preempted (maybe r):
\* KVCacheManager.free; SaveHold keeps blocks a save still reads.
Preempt(r) ==
  /\ status[r] = "running" /\ ~step[r].on /\ running # <<>>
  /\ ~NextStepFits(r)
  /\ LET v == running[Len(running)]
         fr == SelectSeq(AllOf(v), LAMBDA x : x \notin Keep(v))
     IN
     /\ ~step[v].on
     /\ ref' = RefAfterFree(fr)
     /\ freeQ' = FreeQAfterFree(fr)
     /\ table' = [table EXCEPT ![v] = EmptyTables]
     /\ ncached' = [ncached EXCEPT ![v] = [g \in Groups |-> 0]]
     /\ held' = [held EXCEPT ![v] = held[v] \cup Keep(v)]
     /\ computed' = [computed EXCEPT ![v] = 0]
     /\ status' = [status EXCEPT ![v] = "waiting"]
     /\ running' = Without(running, v)
     /\ order' = <<v>> \o Without(order, v)
     /\ event' = Ev("Preempt", v, table[v], [by |-> r])
  /\ UNCHANGED <<hash, len, step, loads, saves, failures, bad, cachedTok, stallHead,
                 noLoad>>

\* Scheduler.schedule with StallFix (patch [00a.4 Fix a stall]): allocate_slots returned None
\* for h, the first waiting request that could be scheduled, and nothing
\* runs; Scheduler._free_blocks_of_waiting_requests frees the blocks of the
\* other waiting requests back from async loads (KVCacheManager.free, so
\* SaveHold keeps those a store reads); they start over.
FreeWaiting(h) ==
  /\ StallFix /\ status[h] = "waiting" /\ running = <<>> /\ ~Yields(h)
  /\ FirstWaiting(h)
  /\ StallVictims(h) # {}
  /\ Refused(h)
  /\ LET vs == StallVictims(h)
         fr == SelectSeq(FreeSeq(vs), LAMBDA x : x \notin UNION {Keep(v) : v \in vs})
         ans == RefusalOf(h)
         p == Plan(h, ans.ext, ans.async, 0, ans.hit)
     IN
     /\ ref' = RefAfterFree(fr)
     /\ freeQ' = FreeQAfterFree(fr)
     /\ table' = [q \in Req |-> IF q \in vs THEN EmptyTables ELSE table[q]]
     /\ ncached' = [q \in Req |-> IF q \in vs THEN [g \in Groups |-> 0] ELSE ncached[q]]
     /\ held' = [q \in Req |-> IF q \in vs THEN held[q] \cup Keep(q) ELSE held[q]]
     /\ computed' = [q \in Req |-> IF q \in vs THEN 0 ELSE computed[q]]
     /\ stallHead' = [h |-> h, vs |-> vs]
     /\ event' = Ev("FreeWaiting", h, NoBlocks,
                    WithOffer([freed |-> vs, hitBlocks |-> p.h, extTokens |-> p.e,
                               async |-> ans.async, newTokens |-> p.n,
                               predictedBlocks |-> p.predicted], p))
  /\ UNCHANGED <<hash, status, len, step, loads, saves, running, failures, bad,
                 cachedTok, order, noLoad>>

\* The delayed free of a finished request, when its last transfer ended.
FreeFinished(r) ==
    /\ ref' = RefAfterFree(AllOf(r) \o SeqOf(held[r]))
    /\ freeQ' = FreeQAfterFree(AllOf(r) \o SeqOf(held[r]))
    /\ table' = [table EXCEPT ![r] = EmptyTables]
    /\ ncached' = [ncached EXCEPT ![r] = [g \in Groups |-> 0]]
    /\ held' = [held EXCEPT ![r] = {}]
    /\ status' = [status EXCEPT ![r] = "done"]

\* Scheduler._update_from_kv_xfer_finished (finished_recving) and
\* _update_waiting_for_remote_kv: the async load succeeded; cache_blocks
\* publishes the loaded blocks now, not before. A request finished during
\* its load is freed now; one whose computed tokens a load failure of
\* another request set to 0 is freed and starts over.
\* With LoadsFail no load succeeds, but a load whose request has no valid
\* token left to fail on (a sharer's failure set computed to 0, patch [00c.1 All sharers of a failed KV block]) is
\* still reported: the code frees the request and it starts over, failed or
\* not (series-loads-fail-shared; LoadReported).
LoadReported(r) ==
    \/ ~LoadsFail
    \/ computed[r] = 0
FinishLoad(r) ==
  /\ loads[r] # {}
  /\ LoadReported(r)
  /\ loads' = [loads EXCEPT ![r] = {}]
  /\ IF status[r] = "finishing" /\ saves[r] = {}
     THEN /\ FreeFinished(r)
          /\ event' = Ev("FinishLoadFree", r, table[r], [none |-> 0])
          /\ UNCHANGED <<hash, computed>>
     ELSE IF status[r] = "finishing"
     THEN /\ event' = Ev("FinishLoad", r, NoBlocks, [none |-> 0])
          /\ UNCHANGED <<ref, freeQ, table, ncached, held, status, hash, computed>>
     ELSE IF computed[r] = 0
     THEN /\ ref' = RefAfterFree(AllOf(r))
          /\ freeQ' = FreeQAfterFree(AllOf(r))
          /\ table' = [table EXCEPT ![r] = EmptyTables]
          /\ ncached' = [ncached EXCEPT ![r] = [g \in Groups |-> 0]]
          /\ status' = [status EXCEPT ![r] = "waiting"]
          /\ event' = Ev("FinishLoad", r, table[r], [computedTokens |-> 0])
          /\ UNCHANGED <<hash, held, computed>>
     ELSE /\ hash' = Publish(hash, r, table[r], ncached[r], computed[r] \div B)
          /\ ncached' = [ncached EXCEPT ![r] = NewCached(ncached[r], computed[r] \div B)]
          /\ status' = [status EXCEPT ![r] = "waiting"]
          /\ event' = Ev("FinishLoad", r, NoBlocks, [computedTokens |-> computed[r]])
          /\ UNCHANGED <<ref, freeQ, table, held, computed>>
  /\ UNCHANGED <<len, step, saves, running, failures, bad, cachedTok, order,
                 stallHead, noLoad>>

\* Scheduler._handle_invalid_blocks + _update_waiting_for_remote_kv: the
\* async load failed from table slot i on. The request keeps its blocks and
\* resumes from slot i (publishing the valid ones), or, when that is token 0
\* or can_recompute_from says the tokens from there read a null block, its
\* blocks are freed and it starts over. A request finished during its load
\* is freed.
LoadFailed(r) ==
  /\ loads[r] # {} /\ (failures < MaxFailures \/ LoadsFail)
  /\ \E i \in {j \in SlotsOf(r, TB(loads[r]), LongestTable(r)) : (j - 1) * B < computed[r]} :
     LET t == (i - 1) * B
         nc == IF CanRecomputeFrom(r, t) THEN t ELSE 0
         inv == BlocksAt(table[r], i, LongestTable(r)) \cap TB(loads[r])
     IN
     \* LoadsFail: failures are not bounded; failures only says one happened.
     /\ failures' = IF LoadsFail THEN 1 ELSE failures + 1
     /\ loads' = [loads EXCEPT ![r] = {}]
     /\ noLoad' = IF NoReload /\ status[r] # "finishing"
                  THEN noLoad \cup Marked({r}, [q \in {r} |-> nc]) ELSE noLoad
     /\ IF status[r] = "finishing"
        THEN /\ IF saves[r] = {}
                THEN FreeFinished(r)
                ELSE UNCHANGED <<ref, freeQ, table, ncached, held, status>>
             /\ event' = Ev("LoadFailed", r, table[r], [atSlot |-> i, computedTokens |-> -1])
             /\ UNCHANGED <<hash, computed, bad>>
        ELSE /\ bad' = bad \cup SlotsIn(r, t, computed[r] - 1, inv)
             /\ computed' = [computed EXCEPT ![r] = nc]
             /\ status' = [status EXCEPT ![r] = "waiting"]
             /\ IF nc > 0
                THEN /\ hash' = Publish(hash, r, table[r], Uncached(ncached[r], nc), nc \div B)
                     /\ ncached' = [ncached EXCEPT ![r] =
                                      NewCached(Uncached(ncached[r], nc), nc \div B)]
                     /\ event' = Ev("LoadFailed", r, NoBlocks,
                                     [atSlot |-> i, computedTokens |-> nc])
                     /\ UNCHANGED <<ref, freeQ, table, held>>
                ELSE /\ ref' = RefAfterFree(AllOf(r))
                     /\ freeQ' = FreeQAfterFree(AllOf(r))
                     /\ table' = [table EXCEPT ![r] = EmptyTables]
                     /\ ncached' = [ncached EXCEPT ![r] = [g \in Groups |-> 0]]
                     /\ event' = Ev("LoadFailed", r, table[r], [atSlot |-> i, computedTokens |-> 0])
                     /\ UNCHANGED <<hash, held>>
  /\ UNCHANGED <<len, step, saves, running, cachedTok, order, stallHead>>

\* finished_sending: the connector's asynchronous store ended; blocks held
\* for it are freed; a finished request's delayed free happens now.
SaveDone(r) ==
  /\ saves[r] # {} /\ SaveMode = "async"
  /\ saves' = [saves EXCEPT ![r] = {}]
  /\ IF status[r] = "finishing" /\ loads[r] = {}
     THEN FreeFinished(r)
     ELSE /\ ref' = RefAfterFree(SeqOf(held[r]))
          /\ freeQ' = FreeQAfterFree(SeqOf(held[r]))
          /\ held' = [held EXCEPT ![r] = {}]
          /\ UNCHANGED <<table, ncached, status>>
  /\ event' = Ev("SaveDone", r, NoBlocks, [none |-> 0])
  /\ UNCHANGED <<hash, len, computed, step, loads, running, failures, bad, cachedTok,
                 order, stallHead, noLoad>>

\* Scheduler.finish_requests(FINISHED_ABORTED): the client aborts request r
\* (not while its step is in flight); the free is delayed while a transfer
\* runs (KVConnectorRequest.recving, request_finished -> delay_free_blocks:
\* KVConnectorRequest.sending).
Abort(r) ==
  /\ CanAbort /\ status[r] \in {"waiting", "loading", "running"} /\ ~step[r].on
  /\ running' = Without(running, r)
  /\ IF DelaysFree(Transfers(r), held[r])
     THEN /\ status' = [status EXCEPT ![r] = "finishing"]
          /\ event' = Ev("AbortDelayed", r, NoBlocks, [call |-> FinishCall])
          /\ UNCHANGED <<ref, freeQ, table, ncached, held>>
     ELSE /\ FreeFinished(r)
          /\ event' = Ev("Abort", r, table[r], [call |-> FinishCall])
  /\ stallHead' = IF stallHead # NoHead /\ stallHead.h = r THEN NoHead ELSE stallHead
  /\ noLoad' = Unmark(noLoad, r)
  /\ UNCHANGED <<hash, len, computed, step, loads, saves, failures, bad, cachedTok,
                 order>>

\* Every request is done: the system stutters (no deadlock).
Terminated == (\A r \in Req : status[r] = "done") /\ UNCHANGED vars

Next ==
    \/ \E r \in Req :
          \/ AllocateSlots(r) \/ Execute(r) \/ Preempt(r) \/ FreeWaiting(r)
          \/ SyncLoadFailed(r) \/ FinishLoad(r) \/ LoadFailed(r) \/ SaveDone(r)
          \/ Abort(r) \/ Refuse(r)
    \/ Terminated

Spec == Init /\ [][Next]_vars

(***************************************************************************)
(* Fairness, one condition per action (the assumptions of Liveness): the  *)
(* scheduler serves a request that can be scheduled infinitely often      *)
(* (strong fairness, as FCFS with enough budget does), the model runner   *)
(* returns every step, a request that cannot grow is eventually preempted *)
(* and the connector finishes every transfer (weak fairness). Load        *)
(* failures, aborts and refusals are not forced, except that a connector  *)
(* whose loads all fail (LoadsFail) eventually reports each failure,      *)
(* asynchronous or synchronous.                                            *)
(***************************************************************************)
Fairness ==
    /\ \A r \in Req : SF_vars(AllocateSlots(r))
    /\ \A r \in Req : WF_vars(Execute(r))
    /\ \A r \in Req : WF_vars(Preempt(r))
    /\ \A r \in Req : WF_vars(FreeWaiting(r))
    /\ \A r \in Req : WF_vars(FinishLoad(r))
    /\ \A r \in Req : WF_vars(SaveDone(r))
    /\ \A r \in Req : WF_vars(LoadsFail /\ LoadFailed(r))
    /\ \A r \in Req : WF_vars(LoadsFail /\ SyncLoadFailed(r))
FairSpec == Spec /\ Fairness

-----------------------------------------------------------------------------
(***************************************************************************)
(* Properties. Each names the vLLM code whose correctness it stands for.  *)
(***************************************************************************)

Statuses == {"waiting", "loading", "running", "finishing", "done"}
Hashes == {<<g, i>> : g \in Groups, i \in 1..MaxBlocks}
          \cup {<<g, i, r>> : g \in Groups, i \in 1..MaxBlocks, r \in Req}
Acts == {"Init", "AllocateSlots", "Refused", "Execute", "Finish", "FinishDelayed",
         "SyncLoadFailed", "Preempt", "FreeWaiting", "FinishLoad",
         "FinishLoadFree", "LoadFailed", "SaveDone", "Abort", "AbortDelayed"}
Tables == [Groups -> Seq(Blocks \cup {Null})]

\* Every variable has the shape its vLLM counterpart has.
TypeOK ==
    /\ ref \in [Blocks -> Nat]
    /\ hash \in [Blocks -> Hashes \cup {NoHash}]
    /\ freeQ \subseteq Blocks
    /\ status \in [Req -> Statuses]
    /\ len \in [Req -> PromptLen..MaxLen]
    /\ computed \in [Req -> 0..(MaxLen + MaxDraft)]
    /\ table \in [Req -> Tables]
    /\ \A r \in Req, g \in Groups : Len(table[r][g]) <= MaxBlocks
    /\ ncached \in [Req -> [Groups -> 0..MaxBlocks]]
    /\ step \in [Req -> [on : BOOLEAN, from : 0..MaxLen, n : 0..Chunk,
                         d : 0..MaxDraft, e : 0..MaxExt]]
    /\ \A r \in Req : ~step[r].on => step[r] = NoStep
    /\ loads \in [Req -> SUBSET (Groups \X (1..MaxBlocks) \X Blocks)]
    /\ saves \in [Req -> SUBSET (Groups \X (1..MaxBlocks) \X Blocks)]
    /\ held \in [Req -> SUBSET Blocks]
    /\ running \in Seq(Req)
    /\ Cardinality(Range(running)) = Len(running)
    /\ Range(running) = {r \in Req : status[r] = "running"}
    /\ failures \in 0..MaxFailures
    /\ bad \subseteq Blocks \X (0..(B - 1))
    /\ cachedTok \in [Req -> -1..MaxLen]
    /\ order \in [1..Cardinality(Req) -> Req] /\ Range(order) = Req
    /\ stallHead = NoHead \/ stallHead \in [h : Req, vs : SUBSET Req]
    /\ noLoad \subseteq Req /\ (~NoReload => noLoad = {})
    /\ \A q \in noLoad : status[q] \in {"waiting", "loading", "running"}
    /\ event.act \in Acts /\ event.req \in Req \cup {"none"}
    /\ event.blocks \in [Groups -> Seq(Blocks \cup {Null})]

\* BlockPool: free_block_queue holds exactly the blocks with ref_cnt 0, so
\* free (uncached or cached-unreferenced) + referenced = N; the null block
\* is outside Blocks and never enters the queue, a transfer or a hold.
Conservation ==
    /\ \A b \in freeQ : ref[b] = 0
    /\ Cardinality(freeQ) + Cardinality({b \in Blocks : ref[b] > 0}) = N
    /\ Null \notin freeQ \cup InFlight \cup UNION {held[r] : r \in Req}

\* Positions of block b in a block table.
At(t, b) == {i \in DOMAIN t : t[i] = b}
Holders(b) == {r \in Req : b \in held[r]}
WasHit(b) == hash[b] # NoHash \/ failures > 0

\* BlockPool.get_new_blocks / touch: a block has one owner (one request, one
\* group, one position), unless it is a prefix-cache hit shared by several
\* requests at the same position of the same group, carrying its hash (or,
\* once a load failed, a hit that evict_blocks took out of the cache since).
ExclusiveOwnership ==
    /\ \A r \in Req, g \in Groups :          \* once per table
          \A b \in Real(table[r][g]) : Cardinality(At(table[r][g], b)) = 1
    /\ \A r \in Req :                        \* never in two groups of a request
          /\ HasFull => Real(table[r]["full"]) \cap Real(table[r][Kind]) = {}
          /\ \A b \in held[r] \cap Entries(r) : WasHit(b)
    /\ \A r1, r2 \in Req : r1 # r2 =>        \* shared only as the same hit
          /\ \A g1, g2 \in Groups :
               \A b \in Real(table[r1][g1]) \cap Real(table[r2][g2]) :
                  /\ g1 = g2
                  /\ WasHit(b)
                  /\ At(table[r1][g1], b) = At(table[r2][g2], b)
          /\ \A b \in held[r1] \cap (Entries(r2) \cup held[r2]) : WasHit(b)

\* Scheduler + KVConnector: a block a load writes or a save reads stays at
\* its place in the request's table (or held for the transfer) and out of
\* the free queue, so it is never evicted or re-allocated, until the
\* connector reports the transfer finished.
NoTransferRace ==
    \A r \in Req : \A x \in TransferSlots(r) :
        /\ \/ x[2] <= Len(table[r][x[1]]) /\ table[r][x[1]][x[2]] = x[3]
           \/ x[3] \in held[r]
        /\ x[3] \notin freeQ

\* BlockPool.touch / free_blocks: ref_cnt counts the table entries (and
\* holds) that name the block.
RefCount ==
    \A b \in Blocks :
        ref[b] = Cardinality({rg \in Req \X Groups : b \in Range(table[rg[1]][rg[2]])})
                 + Cardinality(Holders(b))

\* SingleTypeKVCacheManager: null blocks only form a prefix of a
\* sliding-window (or Mamba) table; a full-attention table never holds one.
NullPrefix ==
    \A r \in Req :
      /\ HasFull => Null \notin Range(table[r]["full"])
      /\ \A i, j \in DOMAIN table[r][Kind] :
            i < j /\ table[r][Kind][j] = Null => table[r][Kind][i] = Null

\* The tokens a request reads: those of its step in flight, or its next
\* token (which reads the tokens before it).
Needed(r, g) ==
    IF step[r].on
    THEN UNION {Attends(g, t) : t \in step[r].from..(step[r].from + step[r].n + step[r].d - 1)}
    ELSE Attends(g, computed[r]) \ {computed[r]}
Reads(r) == status[r] \in {"waiting", "loading", "running"}

\* Attention (the definition above, not the skip rule): for every request
\* that holds blocks, each table covers its computed tokens, and every slot
\* that a token in flight or its next token attends to is a real block.
WindowCovered ==
    \A r \in Req : Reads(r) =>
      \A g \in Groups :
        /\ CeilDiv(computed[r], B) <= Len(table[r][g])
        /\ \A p \in Needed(r, g) :
             Slot(p) <= Len(table[r][g]) /\ table[r][g][Slot(p)] # Null

\* Connector load failures (_handle_invalid_blocks): no request reads a
\* slot that a failed load left invalid, unless another holder of the block
\* will recompute it first (it counts fewer computed tokens and runs: the
\* scheduler puts running requests before waiting ones in a batch).
Recomputes(q, g, p, b) ==
    /\ status[q] \in {"waiting", "running"}
    /\ Slot(p) <= Len(table[q][g]) /\ table[q][g][Slot(p)] = b
    /\ ReadFrom(q) <= p
NoStaleRead ==
    \A r \in Req : status[r] \in {"waiting", "running"} =>
      \A g \in Groups : \A p \in Needed(r, g) :
        (p < ReadFrom(r) /\ Slot(p) <= Len(table[r][g]) /\ table[r][g][Slot(p)] # Null)
          => LET b == table[r][g][Slot(p)] IN
             <<b, p % B>> \notin bad \/ \E q \in Req \ {r} : Recomputes(q, g, p, b)

\* The recompute rule of a Mamba group (Scheduler._update_requests_with_
\* invalid_blocks, KVCacheManager.can_recompute_from): a waiting or running
\* request's step in flight, or its next step, reads in the Mamba group the
\* state after its last computed token (StateRead), and that state is
\* valid: its block is real and no failed load left it invalid (unless
\* another holder of the block computes it first, as in NoStaleRead). So
\* after a failed load, of a state block or of an attention block, the
\* request computes again from a state it holds that is valid, or from the
\* start (which reads none); its one num_computed_tokens is that point in
\* every group (NoStaleRead and WindowCovered check the attention groups).
MambaGroups == Groups \cap {"mamba"}
ValidStateRead ==
    \A r \in Req : status[r] \in {"waiting", "running"} =>
      \A g \in MambaGroups : \A p \in StateRead(ReadFrom(r)) :
        /\ Slot(p) <= Len(table[r][g]) /\ table[r][g][Slot(p)] # Null
        /\ LET b == table[r][g][Slot(p)] IN
           <<b, p % B>> \notin bad \/ \E q \in Req \ {r} : Recomputes(q, g, p, b)

\* BlockPool.cache_full_blocks: a block an asynchronous load writes is not
\* in the prefix cache (delay_cache_blocks until the load finished), and a
\* block holding a token past num_tokens (an unverified draft or an empty
\* slot) never is.
NoPrematurePublish ==
    /\ \A r \in Req : \A b \in TB(loads[r]) : hash[b] = NoHash
    /\ \A r \in Req, g \in Groups : \A i \in DOMAIN table[r][g] :
          (table[r][g][i] # Null /\ i * B > len[r]) => hash[table[r][g][i]] = NoHash

\* SlidingWindowManager, an action property: right after allocate_slots
\* the request's sliding-window table holds at most ceil((W-1)/B) + 1 real
\* blocks plus those of the tokens scheduled now (and, for a connector that
\* declines HMA, those of the external tokens: it gets a block for each).
WindowMax(args) ==
    Contig + 1 + CeilDiv(args.newTokens + args.draftTokens
                         + (IF ConnectorHMA THEN 0 ELSE args.extTokens), B)
WindowBound ==
    [][(event'.act = "AllocateSlots" /\ Kind = "swa") =>
         Cardinality(Real(table'[event'.req]["swa"])) <= WindowMax(event'.args)]_vars

\* A Mamba group ([09.1 Mamba groups with KV connectors] with the skip rule
\* of [01.1 Count blocks to allocate] and the null padding of
\* [03.3 Allocate only the external blocks]), an action property:
\* right after allocate_slots gave a request c tokens computed before the
\* step (a prefix cache hit and external tokens), c ends on a block
\* boundary and the request's Mamba table holds the state after token c-1
\* only: the null block before the block of that token, which is real. The
\* blocks after it (the tokens of the step) are real (NullPrefix), and
\* ExactAdmission counts exactly those.
MambaTableShape ==
    [][(event'.act = "AllocateSlots" /\ IsMamba) =>
         LET c == event'.args.hitBlocks * B + event'.args.extTokens
             t == table'[event'.req]["mamba"]
         IN  c > 0 => /\ c % B = 0
                      /\ c \div B <= Len(t) /\ t[c \div B] # Null
                      /\ \A i \in 1..(c \div B - 1) : t[i] = Null]_vars

\* What the code does with a Mamba group, an action property (not a
\* requirement: ValidStateRead is the rule): a failed load leaves every
\* request it affects with no computed token, so each computes again from
\* the start. A Mamba table's first real block is the state block of its
\* hit or load, after the null block, and a load writes up to that state
\* block: the block before the first invalid one is the null block. A
\* change that kept a valid state before the failed block would make the
\* request resume there, and this property fail.
FailureStartsOver ==
    [][IsMamba =>
         /\ event'.act = "LoadFailed" => event'.args.computedTokens <= 0
         /\ event'.act = "SyncLoadFailed" =>
              \A q \in event'.args.affected : computed'[q] = 0]_vars

\* A connector that declines HMA (ConnectorHMA FALSE) gets what vLLM 0.13.0
\* gave it, an action property: right after allocate_slots every slot of
\* the external tokens (the slots after the local hit up to the last
\* external token) is a real block, so the connector loads each of them.
ExternalSlots(args) ==
    (args.hitBlocks + 1)..CeilDiv(args.hitBlocks * B + args.extTokens, B)
RealExternalBlocks ==
    [][(event'.act = "AllocateSlots" /\ ~ConnectorHMA) =>
         \A i \in ExternalSlots(event'.args) :
            i <= Len(table'[event'.req][Kind]) /\ table'[event'.req][Kind][i] # Null]_vars

\* KVCacheManager.allocate_slots, an action property:
\* get_num_blocks_to_allocate (computed as the code does) equals the blocks
\* then taken from the free queue (touched evictable hits + get_new_blocks).
ExactAdmission ==
    [][event'.act = "AllocateSlots" => event'.args.predictedBlocks = event'.args.takenBlocks]_vars

\* The scheduler under Fairness: every request eventually finishes.
Liveness == \A r \in Req : <>(status[r] = "done")

\* Symmetry of the request ids (all prompts look alike).
Symmetry == Permutations(Req)

-----------------------------------------------------------------------------
(***************************************************************************)
(* Theorems, each under the assumptions it needs (TLC checks them on the  *)
(* models of spec/manifest.toml; the expected failures are recorded there).*)
(***************************************************************************)
\* Stores that outlive the step are held (patch [03a.1 Hold blocks]), or there are none.
SavesSafe == SaveMode # "async" \/ SaveHold
\* Load failures cannot leave a shared block unrecomputed: every holder
\* recomputes (patch [00c.1 All sharers of a failed KV block]) and counts what it computed before its step as
\* computed (patch [00c.3 Handle a failed sync KV load]; without it the code counts num_cached_tokens).
FailuresSafe == MaxFailures = 0 \/ (SharedInvalidFix /\ RangeByComputed)
\* Blocks vLLM's start-up check demands for one request of MaxLen tokens
\* (check_enough_kv_cache_memory, KVCacheSpec.max_memory_usage_bytes per
\* group: full attention ceil(max_model_len/B), a sliding window
\* ceil(min(W-1+max_num_batched_tokens, max_model_len)/B)+1, a Mamba group
\* ceil(max_model_len/mamba_block_size)).
OneRequestBlocks == (IF HasFull THEN CeilDiv(MaxLen, B) ELSE 0)
                    + (IF IsMamba THEN CeilDiv(MaxLen, B)
                       ELSE CeilDiv(Min(W - 1 + Chunk, MaxLen), B) + 1)
PoolChecked == N >= OneRequestBlocks
\* No request waits for an async load while others hold the blocks it
\* needs: no async loads, or the stall fix (patch [00a.4 Fix a stall]) on a pool that passes
\* vLLM's start-up check (on a smaller pool a request back from its load
\* may need more blocks than the pool has, and patch [00a.4 Fix a stall] never frees the
\* blocks of the request it cannot allocate).
NoStall == ~AsyncLoad \/ (StallFix /\ PoolChecked)

THEOREM Spec => []TypeOK
THEOREM (IsSeries) => (Spec => []Conservation)
THEOREM (IsSeries) => (Spec => []ExclusiveOwnership)
THEOREM (IsSeries /\ SavesSafe) => (Spec => []NoTransferRace)
THEOREM (IsSeries) => (Spec => []RefCount)
THEOREM (IsSeries) => (Spec => []NullPrefix)
THEOREM (IsSeries) => (Spec => []WindowCovered)
THEOREM (IsSeries /\ FailuresSafe) => (Spec => []NoStaleRead)
THEOREM (IsSeries) => (Spec => []NoPrematurePublish)
THEOREM (IsSeries) => (Spec => WindowBound)
THEOREM (IsSeries) => (Spec => ExactAdmission)
\* The one HMA decision (patches [03.1 Keep HMA on], [03.3 Allocate only the external blocks]): a connector that declines HMA gets
\* a real block for every external token (mutations/series-pad-declined).
THEOREM Spec => RealExternalBlocks
\* A Mamba group (the Mamba stage on the series: Kind = "mamba" needs
\* SeriesAsCoded; without one these hold trivially): the state block after
\* the computed tokens, null before it (mutations/mamba-unaligned,
\* mutations/mamba-no-skip), and the recompute rule after a failed load
\* (mutations/mamba-recompute-unchecked); ownership of state blocks is
\* ExclusiveOwnership, Conservation and RefCount above
\* (mutations/mamba-late-claim).
THEOREM Spec => MambaTableShape
THEOREM Spec => []ValidStateRead
THEOREM Spec => FailureStartsOver
\* Deadlock freedom (TLC's deadlock check): some action is always enabled
\* until every request is done.
THEOREM (IsSeries /\ NoStall /\ ~CanAbort) => (Spec => [](ENABLED Next))
\* A connector whose loads all fail: only patch [00c.4 No new KV load] (NoReload) ends the loop of
\* failed loads, also for a failure past block 0 that is preempted after it
\* (series-loads-fail-alloc-only, series-loads-fail, series-loads-fail-late;
\* mutations/mark-only-no-valid-token).
LoadsEnd == ~LoadsFail \/ NoReload
THEOREM (IsSeries /\ NoStall /\ ~CanAbort /\ LoadsEnd)
            => (FairSpec => Liveness)
=============================================================================
