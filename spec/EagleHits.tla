------------------------------ MODULE EagleHits ------------------------------
(***************************************************************************)
(* Prefix cache hits with EAGLE on hybrid models (stage 05, patch 5A):    *)
(* HybridKVCacheCoordinator.find_longest_cache_hit as the code computes   *)
(* it, checked against the rule of the stage README (LongestServableHit). *)
(* A small model of its own: one lookup of one request, for every request *)
(* length, every set of cached blocks per KV cache group, with and without *)
(* EAGLE, and every attention type of the second group.                  *)
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
    Mutation  \* "none", or "Base": vLLM 0.13.0's lookup (each type drops EAGLE's block on its own)

ASSUME /\ B \in Nat \ {0} /\ W \in Nat \ {0, 1} /\ C \in Nat \ {0} /\ C % B = 0
       /\ MaxLen \in Nat \ {0} /\ Mutation \in {"none", "Base"}

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
(* The code. Fix == patch 5A is applied (Mutation = "none").               *)
(***************************************************************************)
Fix == Mutation = "none"
\* Block hashes a hit may use (KVCacheCoordinator.hit_block_hashes): with
\* EAGLE (patch 5A) those ending at or before max_cache_hit_length; 0.13.0
\* passes all of them.
NumHashes(n, e) == IF e /\ Fix THEN (n - 1) \div B ELSE n \div B
\* Patch 5A looks one block past the hit with EAGLE; 0.13.0 does not.
Look(e) == IF e /\ Fix THEN 1 ELSE 0
\* Blocks lo, lo+1, ... that are all in S, up to (excluding) hi.
RunFrom(S, lo, hi) ==
    SetMax({k \in 0..Max(hi - lo, 0) : \A i \in lo..(lo + k - 1) : i \in S})
Drop(e, k) == IF e /\ k > 0 THEN k - 1 ELSE k   \* EAGLE's block, computed again

\* FullAttentionManager.find_longest_cache_hit, in blocks.
FullHit(S, maxLen, n, e) ==
    Drop(e, RunFrom(S, 0, Min(maxLen \div B + Look(e), NumHashes(n, e))))

\* SlidingWindowManager.find_longest_cache_hit, in blocks: from right to
\* left, the first run of contiguous hits of ceil((W-1)/B) blocks (plus
\* EAGLE's with patch 5A); without one, the run from block 0.
SwaHit(S, maxLen, n, e) ==
    LET contig == CeilDiv(W - 1, B) + Look(e)
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

\* Witnesses: lookups the property must see (each "never happens" is
\* expected to be violated).
WitnessEagleHit == [](~(eagle /\ hit > 0))
WitnessEagleSwaRun == [](~(eagle /\ kind = "swa" /\ hit >= W))
WitnessEagleChunkBack ==
    [](~(eagle /\ kind = "chunked" /\ hit > 0 /\ hit < ((len - 1) \div C) * C))

THEOREM (Mutation = "none") => (Spec => []LongestServableHit)
=============================================================================
