-------------------------- MODULE MCHybridKVAlloc --------------------------
(***************************************************************************)
(* Model checking of spec/HybridKVAlloc.tla (tlaplus/Examples' MC module): *)
(* what TLC runs for every model of spec/manifest.toml whose module is not *)
(* named, and for the traces the replays drive vLLM through.               *)
(*                                                                         *)
(*  - Mutation names the one protection of the code a mutation model       *)
(*    switches off ("none": the code). Its cfg replaces the spec's         *)
(*    definition of that protection by the broken one below               *)
(*    (`SaveHold <- MutFreeInFlight`); the name is what the reports and    *)
(*    the traces carry.                                                    *)
(*  - The witnesses: situations a model must reach for its properties to  *)
(*    mean something.                                                      *)
(***************************************************************************)
EXTENDS HybridKVAlloc

CONSTANTS
    Mutation     \* "none", or the one protection of the code that is switched off

ASSUME Mutation \in {"none", "EarlyPublish", "PublishDraft", "LateClaim",
                     "FreeInFlight", "EagerFree", "AllocSkipped", "PadFull",
                     "UnderCount", "SkipTouch", "LeakSkipped", "SkipCeil",
                     "RangeByCached", "IgnoreZeroedLoad",
                     "KeepLoadFailedMark", "MarkOnlyNoValidToken",
                     "PadDeclined", "MambaUnaligned", "MambaNoSkip",
                     "MambaRecomputeUnchecked"}

-----------------------------------------------------------------------------
(***************************************************************************)
(* Mutations: each replaces one definition of the spec (the cfg line       *)
(* `Definition <- Mut<Mutation>`) and breaks the property it guards, as    *)
(* spec/manifest.toml records.                                             *)
(***************************************************************************)
\* FreeInFlight (SaveHold): remove_skipped_blocks, preemption and abort free
\* blocks a store still reads (patch [03a.1 Hold blocks] off): NoTransferRace.
MutFreeInFlight == FALSE
\* RangeByCached (RangeByComputed): a running request's load-failure range is
\* num_cached_tokens, which preemption never resets (patch [00c.3 Handle a failed sync KV load] off): NoStaleRead.
MutRangeByCached == FALSE
\* MarkOnlyNoValidToken (Marked): patch [00c.4 No new KV load] marks only a request the failure
\* left with no valid computed token (num_computed_tokens == 0): a load that
\* fails past block 0 and is preempted after it (LateReport) looks up again
\* and loads the same tokens again, for ever: Liveness.
MutMarkOnlyNoValidToken(aff, nc) == {q \in aff : nc[q] = 0}
\* PadDeclined (PadExternal): the null padding of skipped external tokens for
\* every connector (an allocation that asks isinstance(connector,
\* SupportsHMA) while the configuration asked supports_hma_with_config):
\* RealExternalBlocks.
MutPadDeclined == TRUE
\* SkipCeil (SkippedBlocks): the skip rule rounds up, so one block a token
\* still reads is nulled: WindowCovered.
MutSkipCeil(g, n) == CeilDiv(SkippedTokens(g, n), B)
\* AllocSkipped (PadsHitOnly): sliding-window blocks for skipped external
\* tokens, as on vLLM 0.13.0: WindowBound.
MutAllocSkipped == TRUE
\* PadFull (FreshPad): the full-attention table null-padded like a sliding
\* window: NullPrefix.
MutPadFull(g, c, h) ==
    IF g = "full" THEN Min(SkippedBlocks("swa", c), h) ELSE FreshSkip(g, c, h)
\* UnderCount (EvictableHits): admission does not count the evictable hits it
\* claims: ExactAdmission.
MutUnderCount(hit, g, sk, h) == 0
\* LeakSkipped (FreeAfterRemove): skipped blocks do not return to the free
\* queue: Conservation.
MutLeakSkipped(p) == freeQ
\* LateClaim (ClaimFirst, ClaimLate): the hits of the second group (sliding
\* window or Mamba) are claimed after the full-attention group allocated:
\* ExclusiveOwnership.
MutLateClaimFirst(p) == ClaimedIn(p, "full")
MutLateClaimLate(p) == ClaimedIn(p, Kind)
\* SkipTouch (Touched): hit blocks saved in the table without touching them:
\* RefCount.
MutSkipTouch(p) == {}
\* EarlyPublish (PublishTo): external blocks published at allocation, before
\* the asynchronous load completed: NoPrematurePublish.
MutEarlyPublish(p, r) == Min(p.c + p.n, len[r]) \div B
\* PublishDraft (PublishTo): blocks cached up to the draft tokens (no cap at
\* num_tokens): NoPrematurePublish.
MutPublishDraft(p, r) == IF p.async THEN 0 ELSE (p.c + p.n + p.d) \div B
\* EagerFree (DelaysFree): a finish or abort frees at once while a transfer
\* is in flight: NoTransferRace.
MutEagerFree(transfers, holds) == FALSE
\* KeepLoadFailedMark (Unmark): Scheduler._free_request keeps a finished
\* request's load_failed mark: TypeOK.
MutKeepLoadFailedMark(marks, r) == marks
\* IgnoreZeroedLoad (LoadReported): the load of a request that a sharer's
\* failure left with no valid token is never reported: deadlock.
MutIgnoreZeroedLoad(r) == ~LoadsFail
\* MambaUnaligned (ExtToLoad): with a Mamba group every external token the
\* connector offers is loaded (KVCacheManager.get_num_external_computed_
\* tokens off, [09.1 Mamba groups with KV connectors]): the computed tokens
\* may end inside a block, whose state is not after its last token:
\* MambaTableShape.
MutMambaUnaligned(hit, e, num) == e
\* MambaNoSkip (SkippedBlocks): a Mamba group skips no token, as vLLM
\* 0.13.0's MambaManager (the skip rule of [01.1 Count blocks to allocate]
\* off): every external token gets a real Mamba block: MambaTableShape.
MutMambaNoSkip(g, n) == IF g = "mamba" THEN 0 ELSE SkippedTokens(g, n) \div B
\* MambaRecomputeUnchecked (CanRecomputeFrom): can_recompute_from asks only
\* the attention groups (a Mamba manager that answers True: "its state can be
\* recomputed"): after a failed load the request resumes at its first
\* invalid block, where the Mamba group holds the null block, not a state:
\* ValidStateRead.
MutMambaRecomputeUnchecked(r, t) ==
    \A g \in Groups \ {"mamba"} :
        LET fb == SkippedBlocks(g, t) + 1
        IN  fb > Len(table[r][g]) \/ table[r][g][fb] # Null

-----------------------------------------------------------------------------
(***************************************************************************)
(* Witnesses: situations a model must reach for its properties to mean     *)
(* something. Each Witness<X> says "X never happens"; a model that claims  *)
(* its properties is expected to violate the witnesses listed for it in    *)
(* spec/manifest.toml (TLC's trace is the shortest way there).             *)
(***************************************************************************)
AllocNow == event'.act = "AllocateSlots"
NewNow == UNION {Range(event'.blocks[g]) : g \in Groups}
ReachHeld == \E r \in Req : held'[r] # {}
ReachPreemptOther == event'.act = "Preempt" /\ event'.args.by # event'.req
ReachEviction == AllocNow /\ \E b \in NewNow : hash[b] # NoHash
ReachWindowAtBound ==
    AllocNow /\ Cardinality(Real(table'[event'.req]["swa"])) = WindowMax(event'.args)
ReachSwaBeyondTwo == \E r \in Req : Cardinality(Real(table'[r]["swa"])) > 2
ReachNullPadExternal ==
    AllocNow /\ event'.args.extTokens > 0
    /\ \E i \in (event'.args.hitBlocks + 1)..Len(table'[event'.req][Kind]) :
          table'[event'.req][Kind][i] = Null
\* External tokens past the window, each with a real block (a declining connector).
ReachRealPastWindow ==
    AllocNow /\ event'.args.extTokens > 0
    /\ \E i \in ExternalSlots(event'.args) :
          /\ i <= SkippedBlocks("swa", event'.args.hitBlocks * B + event'.args.extTokens)
          /\ i <= Len(table'[event'.req]["swa"])
          /\ table'[event'.req]["swa"][i] # Null
ReachDraft == AllocNow /\ event'.args.draftTokens > 0
ReachAsyncSave == \E r \in Req : saves'[r] # {} /\ status'[r] = "running" /\ ~step'[r].on
ReachLoadFailure == event'.act \in {"LoadFailed", "SyncLoadFailed"}
ReachAsyncFailKeep == event'.act = "LoadFailed" /\ event'.args.computedTokens > 0
ReachAsyncFailRestart ==
    event'.act = "LoadFailed" /\ event'.args.computedTokens = 0 /\ event'.args.atSlot > 1
ReachSyncFailKeep == event'.act = "SyncLoadFailed" /\ event'.args.computedTokens > 0
ReachSyncFailRestart == event'.act = "SyncLoadFailed" /\ event'.args.restart # {}
ReachSharedInvalid ==
    event'.act = "SyncLoadFailed" /\ event'.args.affected \ {event'.req} # {}
ReachFailAfterAbort == event'.act = "LoadFailed" /\ event'.args.computedTokens = -1
ReachRefused == event'.act = "Refused"
ReachFreeWaiting == event'.act = "FreeWaiting"
\* A Mamba group: external tokens shortened to a block boundary, some of
\* them loaded (the connector offered more than the request loads).
ReachMambaShortened ==
    AllocNow /\ IsMamba /\ event'.args.extTokens > 0
    /\ event'.args.offeredTokens > event'.args.extTokens
\* A Mamba state block in the tables of two requests (a prefix cache hit).
ReachMambaStateShared ==
    IsMamba /\ \E r1, r2 \in Req :
        r1 # r2 /\ Real(table'[r1]["mamba"]) \cap Real(table'[r2]["mamba"]) # {}
WitnessHeld == [][~ReachHeld]_vars
WitnessPreemptOther == [][~ReachPreemptOther]_vars
WitnessEviction == [][~ReachEviction]_vars
WitnessWindowAtBound == [][~ReachWindowAtBound]_vars
WitnessSwaBeyondTwo == [][~ReachSwaBeyondTwo]_vars
WitnessNullPadExternal == [][~ReachNullPadExternal]_vars
WitnessRealPastWindow == [][~ReachRealPastWindow]_vars
WitnessDraft == [][~ReachDraft]_vars
WitnessAsyncSave == [][~ReachAsyncSave]_vars
WitnessLoadFailure == [][~ReachLoadFailure]_vars
WitnessAsyncFailKeep == [][~ReachAsyncFailKeep]_vars
WitnessAsyncFailRestart == [][~ReachAsyncFailRestart]_vars
WitnessSyncFailKeep == [][~ReachSyncFailKeep]_vars
WitnessSyncFailRestart == [][~ReachSyncFailRestart]_vars
WitnessSharedInvalid == [][~ReachSharedInvalid]_vars
WitnessFailAfterAbort == [][~ReachFailAfterAbort]_vars
WitnessRefused == [][~ReachRefused]_vars
WitnessFreeWaiting == [][~ReachFreeWaiting]_vars
WitnessMambaShortened == [][~ReachMambaShortened]_vars
WitnessMambaStateShared == [][~ReachMambaStateShared]_vars
=============================================================================
