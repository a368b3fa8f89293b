------------------------------ MODULE EagleHits ------------------------------
(***************************************************************************)
(* Prefix cache hits with EAGLE on hybrid models (stage 05, patch          *)
(* [05.1 EAGLE prefix cache hit]):                                         *)
(* HybridKVCacheCoordinator.find_longest_cache_hit as the code computes    *)
(* it, checked against the rule of the stage README (LongestServableHit).  *)
(* Stage = 3: stages 03-04, vLLM 0.13.0's lookup and the null prefix of    *)
(* stage 03, checked for a connector-loaded prefix (LoadedPrefixHit). A    *)
(* small model of its own: one lookup of one request, for every request    *)
(* length, every set of cached blocks per KV cache group, with and without *)
(* EAGLE, and every attention type of the second group.                    *)
(*                                                                         *)
(* Modelled: two KV cache groups of block size B, full attention and one  *)
(* of sliding window (W tokens), chunked local attention (C tokens) or    *)
(* Mamba (the pairs HybridKVCacheCoordinator accepts); the request's      *)
(* block hashes (one per full block of its tokens); which of them each    *)
(* group holds in the prefix cache; the code's search per attention type  *)
(* (FullAttentionManager, SlidingWindowManager, ChunkedLocalAttention-    *)
(* Manager, MambaManager.find_longest_cache_hit) and the coordinator's    *)
(* combination (full attention first, the other type within its hit).     *)
(* Abstracted away: block ids (a cached block is a block index), groups   *)
(* of different block sizes (alignment_tokens = B), DCP/PCP.              *)
(***************************************************************************)
EXTENDS Integers, FiniteSets

CONSTANTS
    B,        \* block size in tokens, both groups
    W,        \* sliding window in tokens (the window counts the token itself)
    C,        \* attention_chunk_size of chunked local attention, in tokens
    MaxLen,   \* longest request, in tokens
    Stage     \* 3: stages 03-04 (vLLM 0.13.0's lookup); 5: stage 05 on (patch [05.1 EAGLE prefix cache hit]'s)

ASSUME /\ B \in Nat \ {0} /\ W \in Nat \ {0, 1} /\ C \in Nat \ {0} /\ C % B = 0
       /\ MaxLen \in Nat \ {0} /\ Stage \in {3, 5}

Kinds == {"swa", "chunked", "mamba"}     \* attention type of the second group
Groups == {"full", "other"}
Min(a, b) == IF a < b THEN a ELSE b
Max(a, b) == IF a > b THEN a ELSE b
CeilDiv(a, b) == (a + b - 1) \div b
SetMax(S) == CHOOSE x \in S : \A y \in S : y <= x

VARIABLES
    kind,    \* attention type of the second KV cache group
    eagle,   \* use_eagle (EAGLE or MTP speculative decoding)
    len,     \* request.num_tokens
    cached,  \* per group: indices of the request's blocks that are prefix cache hits
    hit      \* tokens of the hit find_longest_cache_hit returns (-1: an assertion fails)
vars == <<kind, eagle, len, cached, hit>>

\* Blocks that have a block hash: the full blocks of the request.
Hashed(n) == {i \in 0..(MaxLen \div B - 1) : (i + 1) * B <= n}

(***************************************************************************)
(* The code. Fix == patch [05.1 EAGLE prefix cache hit] is applied (Stage  *)
(* = 5).                                                                   *)
(***************************************************************************)
Fix == Stage = 5
\* Block hashes a hit may use (KVCacheCoordinator.hit_block_hashes): with
\* EAGLE (patch [05.1 EAGLE prefix cache hit]) those ending at or before max_cache_hit_length; 0.13.0
\* passes all of them.
NumHashes(n, e) == IF e /\ Fix THEN (n - 1) \div B ELSE n \div B
\* Patch [05.1 EAGLE prefix cache hit] looks one block past the hit with EAGLE; 0.13.0 does not.
Look(e) == IF e /\ Fix THEN 1 ELSE 0
\* Blocks lo, lo+1, ... that are all in S, up to (excluding) hi.
RunFrom(S, lo, hi) ==
    SetMax({k \in 0..Max(hi - lo, 0) : \A i \in lo..(lo + k - 1) : i \in S})
Drop(e, k) == IF e /\ k > 0 THEN k - 1 ELSE k   \* EAGLE's block, computed again

\* FullAttentionManager.find_longest_cache_hit, in blocks.
FullHit(S, maxLen, n, e) ==
    Drop(e, RunFrom(S, 0, Min(maxLen \div B + Look(e), NumHashes(n, e))))

\* SlidingWindowManager.find_longest_cache_hit, in blocks: from right to
\* left, the first run of contiguous hits of ceil((W-1)/B) blocks plus one
\* with EAGLE (patch [05.1 EAGLE prefix cache hit]: EAGLE's block, which may lie past max_length;
\* 0.13.0: within it); without one, the run from block 0.
SwaHit(S, maxLen, n, e) ==
    LET contig == CeilDiv(W - 1, B) + (IF e THEN 1 ELSE 0)
        mnb == Min(maxLen \div B + Look(e), NumHashes(n, e))
        ends == {j \in 0..(mnb - 1) :
                   j + 1 >= contig /\ \A i \in (j - contig + 1)..j : i \in S}
    IN  Drop(e, IF ends # {} THEN SetMax(ends) + 1 ELSE RunFrom(S, 0, mnb))

\* ChunkedLocalAttentionManager.find_longest_cache_hit, in blocks (-1: the
\* assertion of 0.13.0 against EAGLE).
RECURSIVE ChunkLoop(_, _, _, _)
ChunkLoop(S, start, end, e) ==
    LET sb == start \div B
        m == RunFrom(S, sb, end)
    IN  IF ~e THEN sb + m
        ELSE IF m > 0 THEN sb + m - 1
        ELSE IF start = 0 THEN 0
        ELSE ChunkLoop(S, start - C, sb, e)
ChunkHit(S, maxLen, n, e) ==
    IF e /\ ~Fix THEN -1
    ELSE ChunkLoop(S, (maxLen \div C) * C,
                   Min(maxLen \div B + Look(e), NumHashes(n, e)), e)

\* MambaManager.find_longest_cache_hit, in blocks: the last cached state
\* block within max_length (EAGLE changes nothing).
MambaHit(S, maxLen, n, e) ==
    LET cand == {i \in 0..(Min(maxLen \div B, NumHashes(n, e)) - 1) : i \in S}
    IN  IF cand = {} THEN 0 ELSE SetMax(cand) + 1

OtherHit(k, S, maxLen, n, e) ==
    CASE k = "swa" -> SwaHit(S, maxLen, n, e)
      [] k = "chunked" -> ChunkHit(S, maxLen, n, e)
      [] k = "mamba" -> MambaHit(S, maxLen, n, e)

\* HybridKVCacheCoordinator.find_longest_cache_hit: full attention first
\* (max_cache_hit_length = num_tokens - 1), the other type within its hit.
Coordinator(k, e, n, cs) ==
    LET f == FullHit(cs["full"], n - 1, n, e) * B
        o == OtherHit(k, cs["other"], f, n, e)
    IN  IF o < 0 THEN -1 ELSE o * B

(***************************************************************************)
(* The rule (stage 05 README), written from the attention types: a group *)
(* serves a hit of L tokens when every block that computing the tokens    *)
(* from L on reads, and with EAGLE the block after the hit (computed      *)
(* again), is a prefix cache hit of that group and ends at or before the  *)
(* request's maximum cache hit length (num_tokens - 1).                   *)
(***************************************************************************)
Needed(k, L, e) ==
    LET x == L \div B
        extra == IF e THEN {x} ELSE {}
    IN  CASE k = "full" -> (0..(x - 1)) \cup extra
          [] k = "swa" -> ((Max(0, L - W + 1) \div B)..(x - 1)) \cup extra
          [] k = "chunked" -> ((((L \div C) * C) \div B)..(x - 1)) \cup extra
          [] k = "mamba" -> IF L = 0 THEN {} ELSE {x - 1}
Servable(k, e, n, cs, L) ==
    \/ L = 0
    \/ /\ L % B = 0 /\ L <= n - 1
       /\ \A i \in Needed("full", L, e) : (i + 1) * B <= n - 1 /\ i \in cs["full"]
       /\ \A i \in Needed(k, L, e) : (i + 1) * B <= n - 1 /\ i \in cs["other"]

Init ==
    /\ kind \in Kinds
    /\ eagle \in BOOLEAN
    /\ len \in 1..MaxLen
    /\ cached \in [Groups -> SUBSET Hashed(len)]
    /\ hit = Coordinator(kind, eagle, len, cached)

\* One lookup per request: nothing changes after it.
Next == UNCHANGED vars
Spec == Init /\ [][Next]_vars

TypeOK ==
    /\ kind \in Kinds /\ eagle \in BOOLEAN /\ len \in 1..MaxLen
    /\ cached \in [Groups -> SUBSET Hashed(len)]
    /\ hit \in -1..MaxLen

\* KVCacheManager.get_computed_blocks with EAGLE on hybrid models: the hit
\* taken is the longest that every KV cache group serves.
LongestServableHit ==
    hit = SetMax({L \in 0..(len - 1) : Servable(kind, eagle, len, cached, L)})

(***************************************************************************)
(* A prefix a KV connector loaded (stage 03, allocate_slots): the request *)
(* computes from x = min(external, num_tokens - 1) on, and a sliding      *)
(* window group gets blocks only from a window on; the blocks before it   *)
(* are never real, so never cached. The null-prefix rule with EAGLE: the  *)
(* tables start at the window of the end of the hit a later request      *)
(* takes in the loaded tokens: the last block boundary before x (the      *)
(* block after it computed again), one block earlier at stage 3 with a    *)
(* sliding window group, whose lookup drops a second block; without       *)
(* EAGLE at the window of x. NullPrefix and WindowBound of                *)
(* spec/HybridKVAlloc.tla are stated for that start: at most one block    *)
(* more, two at stage 3 (KeptBlocks).                                     *)
(***************************************************************************)
HitEnd(x) == ((x - 1) \div B) * B
\* The blocks the lookup drops for EAGLE at the end of the blocks both
\* groups hold (the coordinator's num_eagle_dropped_blocks): one, but two
\* with 0.13.0's lookup and a sliding window group (full attention drops
\* one, the sliding window searches within that hit and drops another).
Dropped == IF Stage = 3 /\ kind = "swa" THEN 2 ELSE 1
\* The hit's end the null prefix keeps the window of: HitEnd(x), one block
\* earlier for each further block the lookup drops.
KeptDrops == Dropped
SkipStart(x, e) ==
    IF e /\ KeptDrops > 0 THEN Max(0, HitEnd(x) - (KeptDrops - 1) * B) ELSE x
FirstReal(x, e) == Max(0, SkipStart(x, e) - W + 1) \div B
\* The blocks each group caches once the request computed its prompt:
\* full attention all of them, the sliding window group from FirstReal on.
LoadedCache(x, e) ==
    [g \in Groups |-> IF g = "full" THEN Hashed(len)
                      ELSE {i \in Hashed(len) : i >= FirstReal(x, e)}]
AllCached == [g \in Groups |-> Hashed(len)]
\* The same prompt again, after a load of x tokens: it hits as if the
\* request had computed its prompt itself (every block cached), unless the
\* prompt ends in the block after HitEnd(x) with x inside a block (its
\* longest hit is then one block shorter and reads a block before the kept
\* one: the stated limitation).
LoadedPrefixHit ==
    kind = "swa" =>
      \A x \in 1..(len - 1) :
        (x % B = 0 \/ HitEnd(x) + B <= len - 1)
          => Coordinator(kind, eagle, len, LoadedCache(x, eagle))
               = Coordinator(kind, eagle, len, AllCached)
\* The memory the rule costs: at most one block per sliding window group
\* (two at stage 3, whose lookup drops two).
MaxKept == IF Stage = 3 THEN 2 ELSE 1
KeptBlocks ==
    \A x \in 1..(len - 1) :
      FirstReal(x, FALSE) - FirstReal(x, eagle) \in 0..MaxKept

THEOREM (Stage = 5) => (Spec => []LongestServableHit)
THEOREM Spec => [](LoadedPrefixHit /\ KeptBlocks)
=============================================================================
