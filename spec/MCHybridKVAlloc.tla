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
                     "PadDeclined"}

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
\* LateClaim (ClaimFirst, ClaimLate): the sliding-window group's hits are
\* claimed after the full-attention group allocated: ExclusiveOwnership.
MutLateClaimFirst(p) == ClaimedIn(p, "full")
MutLateClaimLate(p) == ClaimedIn(p, "swa")
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
    /\ \E i \in (event'.args.hitBlocks + 1)..Len(table'[event'.req]["swa"]) :
          table'[event'.req]["swa"][i] = Null
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
=============================================================================
