---------------------------- MODULE MCEagleHits ----------------------------
(***************************************************************************)
(* Model checking of spec/EagleHits.tla (tlaplus/Examples' MC module): the *)
(* module TLC runs for the EagleHits models of spec/manifest.toml.         *)
(* Mutation names the one rule of the code a mutation model switches off  *)
(* ("none": the code); its cfg replaces the spec's definition by the       *)
(* broken one below. The witnesses: lookups the properties must see.      *)
(***************************************************************************)
EXTENDS EagleHits

CONSTANTS
    Mutation  \* "none", or the one rule of the code that is switched off

ASSUME Mutation \in {"none", "Base", "NoKeep", "KeepOne"}

\* Base (Fix): at stage 5, vLLM 0.13.0's lookup (each type drops EAGLE's
\* block on its own): LongestServableHit.
MutBase == FALSE
\* NoKeep (KeptDrops): a connector-loaded prefix keeps no block before its
\* window: LoadedPrefixHit.
MutNoKeep == 0
\* KeepOne (KeptDrops): at stage 3, it keeps the one block of stage 5:
\* LoadedPrefixHit.
MutKeepOne == 1

\* Witnesses: lookups the property must see (each "never happens" is
\* expected to be violated).
WitnessEagleHit == [](~(eagle /\ hit > 0))
WitnessEagleSwaRun == [](~(eagle /\ kind = "swa" /\ hit >= W))
\* A loaded prefix whose hit needs the kept block (the window of HitEnd(x)
\* starts a block before the window of x) and gets a hit.
WitnessEagleLoadedKept ==
    [](~(eagle /\ kind = "swa" /\ hit > 0
         /\ \E x \in 1..(len - 1) :
              /\ x % B = 0 /\ FirstReal(x, TRUE) < FirstReal(x, FALSE)
              /\ Coordinator(kind, eagle, len, LoadedCache(x, TRUE)) > 0))
WitnessEagleChunkBack ==
    [](~(eagle /\ kind = "chunked" /\ hit > 0 /\ hit < ((len - 1) \div C) * C))
=============================================================================
