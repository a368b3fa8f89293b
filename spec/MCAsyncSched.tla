---------------------------- MODULE MCAsyncSched ----------------------------
(***************************************************************************)
(* Model checking of spec/AsyncSched.tla (tlaplus/Examples' MC module):    *)
(* the module TLC runs for the AsyncSched models of spec/manifest.toml and *)
(* for the behaviours the asynchronous scheduling replays drive vLLM       *)
(* through.                                                                *)
(*                                                                         *)
(*  - Mutation names the one protection of the code a model switches off  *)
(*    ("none": the code). Its cfg replaces the spec's definition of that   *)
(*    protection by the broken one below (`Fence <- MutNoFence`); the name *)
(*    is what the reports and the traces carry.                           *)
(*  - The witnesses: situations a model must reach for its properties to  *)
(*    mean something.                                                      *)
(***************************************************************************)
EXTENDS AsyncSched

CONSTANTS
    Mutation  \* "none", or the one protection of the code that is switched off

ASSUME Mutation \in {"none", "NoFence", "NoLatePreempt", "KeepPlaceholders",
                     "PadDeclined", "KeepFreedOutput"}

-----------------------------------------------------------------------------
(***************************************************************************)
(* Mutations: each replaces one definition of the spec (the cfg line       *)
(* `Definition <- Mut<Mutation>`) and breaks the property it guards, as    *)
(* spec/manifest.toml records.                                             *)
(***************************************************************************)
\* NoFence (Fence): remove_skipped_blocks counts num_computed_tokens, not
\* num_computed_tokens - num_in_flight_tokens (patch [00b.1 Don't free skipped blocks] off):
\* NoFreeInFlight.
MutNoFence == FALSE
\* NoLatePreempt (LatePreempt): a request whose load failure is reported
\* after its next step was scheduled is truncated in place, as on vLLM
\* 0.13.0, and the outputs of its later steps are kept (patch [00c.2 Preempt if a KV load failure] off):
\* NoInvalidOutput.
MutNoLatePreempt == FALSE
\* KeepPlaceholders (ResetPlaceholders): the request patch [00c.2 Preempt if a KV load failure] preempts
\* keeps its output placeholders: PlaceholdersInFlight.
MutKeepPlaceholders == FALSE
\* PadDeclined (PadExternal): the null padding of skipped external tokens for
\* every connector (an allocation that asks isinstance(connector,
\* SupportsHMA) while the configuration asked supports_hma_with_config):
\* RealExternalBlocks.
MutPadDeclined == TRUE
\* KeepFreedOutput (DropFreedOutput): a request preempted for memory while
\* the step of its synchronous load is in flight holds no block, is not
\* affected when that load fails, and the step's output is appended:
\* NoInvalidOutput.
MutKeepFreedOutput == FALSE

-----------------------------------------------------------------------------
(***************************************************************************)
(* Witnesses: situations a model must reach for its properties to mean     *)
(* something. Each Witness<X> says "X never happens"; a model that claims  *)
(* its properties is expected to violate the witnesses listed for it in    *)
(* spec/manifest.toml (TLC's trace is the shortest way there).             *)
(***************************************************************************)
ReachLatePreempt == discard' /\ ~discard
ReachDiscard == discard /\ Len(queue') < Len(queue)
\* A load failure that leaves valid tokens (the defect's trigger), and one
\* that leaves none.
ReachSyncFailKeep ==
    \E j \in 1..(Ext \div B) : CanRecomputeFrom(j * B) /\ status = "running"
                                /\ ~discard /\ SyncLoadFailedAt(j)
ReachAsyncFailKeep == status = "loading" /\ LoadFailed /\ computed' > 0
ReachFailRestart ==
    \/ status = "loading" /\ LoadFailed /\ computed' = 0
    \/ status = "running" /\ ~discard /\ SyncLoadFailed /\ computed' = 0
ReachInPlace == status = "running" /\ SyncLoadFailed /\ status' = "running"
ReachSlideInFlight == status = "running" /\ skip' > skip /\ queue # <<>>
ReachMemoryPreempt == preempts' > preempts /\ queue # <<>>
ReachRepublish == status' = "running" /\ cached' > cached /\ failures > 0
ReachMarked == mark' /\ ~mark
\* A load of external tokens that reach past the window: a connector that
\* uses HMA would get null blocks for some of them.
ReachExternalPastWindow ==
    /\ status = "waiting" /\ computed = 0 /\ ~mark
    /\ status' \in {"loading", "running"}
    /\ LET h == Min(cached, (len - 1) \div B) * B
       IN  SkippedBlocks(h + ExtOffer(h)) > SkippedBlocks(h)
WitnessLatePreempt == [][~ReachLatePreempt]_vars
WitnessDiscard == [][~ReachDiscard]_vars
WitnessSyncFailKeep == [][~ReachSyncFailKeep]_vars
WitnessAsyncFailKeep == [][~ReachAsyncFailKeep]_vars
WitnessFailRestart == [][~ReachFailRestart]_vars
WitnessInPlace == [][~ReachInPlace]_vars
WitnessSlideInFlight == [][~ReachSlideInFlight]_vars
WitnessMemoryPreempt == [][~ReachMemoryPreempt]_vars
WitnessRepublish == [][~ReachRepublish]_vars
WitnessMarked == [][~ReachMarked]_vars
WitnessExternalPastWindow == [][~ReachExternalPastWindow]_vars
=============================================================================
