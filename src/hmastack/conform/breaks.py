"""What conformance runs and breaks: the suites run at stage 03 (``SUITES``), the
suites of a later stage (``STAGE_SUITES``) and the deliberately broken copies
(``BREAKS``): each a one-line edit that removes one protection of the series,
in the tree of the stage that adds it, and the suites that must catch it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

STAGE = 3


STAGE_TESTS = Path("tests") / "stages"


SUITE_DIR = STAGE_TESTS / "s03_connector_allocate"


MODEL_CFG = SUITE_DIR / "fixtures" / "replay-saves.cfg"


@dataclass(frozen=True)
class Suite:
    name: str
    kind: str  # "replay" or "random"
    file: str  # under tests/stages/s03_connector_allocate/
    # On a broken tree only this test of the file runs (the file's explicit
    # regression tests would otherwise catch the break before the random test).
    broken_only: str = ""
    # A glob of further files of the directory that run with ``file`` on the
    # series' tree (the random test's explicit regression tests), not on a
    # broken tree that runs ``broken_only``.
    also: str = ""
    # The directory of ``file``, under tests/stages/.
    directory: str = SUITE_DIR.name


SUITES = (
    Suite("replay through the KVCacheManager", "replay", "test_replay.py"),
    Suite("replay through the Scheduler", "replay", "test_scheduler_replay.py"),
    Suite(
        "replay of asynchronous scheduling through the AsyncScheduler",
        "replay",
        "test_async_replay.py",
    ),
    Suite(
        "random Scheduler state machine",
        "random",
        "test_scheduler_state_machine.py",
        broken_only="test_scheduler_state_machine",
        also="test_machine_*.py",
    ),
)


# The suites of the stages after 03 that conformance runs, per stage: on that
# stage's tree, and on the broken copies of the breaks of that stage.
STAGE_SUITES = {
    4: (
        Suite(
            "random MultiConnector hold state machine",
            "random",
            "test_multi_connector_holds.py",
            broken_only="test_multi_connector_hold_machine",
            directory="s04_lmcache",
        ),
    ),
}


def suites_of(stage: int) -> tuple[Suite, ...]:
    return SUITES if stage == STAGE else STAGE_SUITES[stage]


@dataclass(frozen=True)
class Break:
    """One protection of the series removed by replacing ``old`` (which must occur
    exactly once in ``path`` of the vLLM tree at ``stage``) with ``new``."""

    name: str
    protection: str
    path: str
    old: str
    new: str
    # The patch whose protection it removes (spec.manifest.PATCH_ID: "3.14",
    # "base"), listed with it in docs/glossary.md.
    patch: str = ""
    # The kinds of suite that must catch it ("replay", "random").
    caught_by: tuple[str, ...] = ("replay", "random")
    # Why a kind of suite is not expected to catch it.
    not_by_replay: str = ""
    not_by_random: str = ""
    # The stage whose tree is broken and whose suites run (``suites_of``).
    stage: int = STAGE


BREAKS = {
    b.name: b
    for b in (
        Break(
            name="allocate-skipped-external",
            patch="3.13",
            protection=(
                "external tokens outside the sliding window get the null block "
                "(broken: every external token gets a real block again, as in "
                "0.13.0's allocate-then-free)"
            ),
            path="vllm/v1/core/kv_cache_manager.py",
            old="num_skipped_computed_tokens = num_computed_tokens",
            new=(
                "num_skipped_computed_tokens = "
                "request.num_computed_tokens + num_new_computed_tokens"
            ),
        ),
        Break(
            name="free-aborted-load",
            patch="3.2",
            protection=(
                "a request aborted while its asynchronous load runs keeps its "
                "blocks until the connector reports the load finished (broken: "
                "they are freed at once, while the load still writes them)"
            ),
            path="vllm/v1/core/sched/kv_connector_requests.py",
            old="return not record.sending and not record.recving",
            new="return not record.sending",
        ),
        Break(
            name="keep-skipped-blocks",
            patch="base",
            protection=(
                "allocate_slots frees the blocks of skipped tokens (outside the "
                "window) of a running request before it allocates (broken: "
                "they are kept)"
            ),
            path="vllm/v1/core/kv_cache_manager.py",
            old="self.coordinator.remove_skipped_blocks(",
            new="(lambda *args: None)(",
        ),
        Break(
            name="resume-after-table-slots",
            patch="3.3",
            protection=(
                "a request resumes after its loaded tokens when an async load "
                "finished (broken: after every slot of its block tables, as "
                "in 0.13.0)"
            ),
            path="vllm/v1/core/sched/scheduler.py",
            old="num_computed_tokens = min(num_loaded_tokens, request.num_tokens)",
            new=(
                "num_computed_tokens = min(max(map(len, self.kv_cache_manager"
                ".get_block_ids(request.request_id))) * self.block_size, "
                "request.num_tokens)"
            ),
        ),
        Break(
            name="publish-before-load",
            patch="base",
            protection=(
                "blocks an asynchronous load writes are not put in the prefix "
                "cache before the load finished (broken: delay_cache_blocks is "
                "ignored)"
            ),
            path="vllm/v1/core/kv_cache_manager.py",
            old="if not self.enable_caching or delay_cache_blocks:",
            new="if not self.enable_caching:",
        ),
        Break(
            name="no-in-flight-fence",
            patch="3.4",
            protection=(
                "skipped blocks are freed only after the steps that read or "
                "write them returned (broken: the tokens of the steps in flight "
                "count, as in 0.13.0)"
            ),
            path="vllm/v1/core/kv_cache_manager.py",
            old="request.num_computed_tokens - request.num_in_flight_tokens",
            new="request.num_computed_tokens",
        ),
        Break(
            name="reload-after-failed-load",
            patch="3.9",
            protection=(
                "a request whose KV load failed and left it no valid token takes "
                "no external tokens any more (broken: it loads again, and a "
                "connector whose loads keep failing keeps it loading for ever)"
            ),
            path="vllm/v1/core/sched/scheduler.py",
            old="                            ext_tokens, load_kv_async = 0, False\n",
            new="                            pass\n",
        ),
        Break(
            name="reload-after-failure-past-block-0",
            patch="3.9",
            protection=(
                "a request whose KV load failed past its first block takes no "
                "external tokens any more either (broken: preempted with a later "
                "step in flight, or by a full pool, it loads the same tokens "
                "again, and a connector whose loads keep failing keeps it "
                "loading for ever)"
            ),
            path="vllm/v1/core/sched/scheduler.py",
            old=(
                "            # could fail again.\n"
                "            self.kv_connector_requests.load_failed(req_id)\n"
            ),
            new=(
                "            # could fail again.\n"
                "            if request.num_computed_tokens == 0:\n"
                "                self.kv_connector_requests.load_failed(req_id)\n"
            ),
            caught_by=("replay",),
            not_by_random=(
                "no schedule of the random test's CI set fails a load past "
                "block 0 whose request then looks up again; the explicit "
                "test_machine_load_failures.py::"
                "test_sync_load_failing_past_block_0_is_not_loaded_again "
                "(NoReload) catches it"
            ),
        ),
        Break(
            name="keep-output-of-freed-load",
            patch="3.16",
            protection=(
                "a request preempted for memory while the step of its "
                "synchronous load is in flight is affected when that load "
                "fails: the step's output and those of its later steps in "
                "flight are dropped (broken: it holds no block, is not "
                "affected, and the token sampled on the invalid KV is emitted)"
            ),
            path="vllm/v1/core/sched/scheduler.py",
            old=(
                "        self._keep_blocks_of_load_in_flight(request)\n"
                "        self.kv_cache_manager.free(request)\n"
                "        self.encoder_cache_manager.free(request)\n"
            ),
            new=(
                "        self.kv_cache_manager.free(request)\n"
                "        self.encoder_cache_manager.free(request)\n"
            ),
        ),
        Break(
            name="stale-cached-count",
            patch="3.5",
            protection=(
                "after a KV load failure a request counts as cached only its "
                "blocks before the first invalid one, so the blocks it computes "
                "again are cached again (broken: they stay out of the prefix "
                "cache)"
            ),
            path="vllm/v1/core/sched/scheduler.py",
            old=(
                "            self.kv_cache_manager.uncache_blocks("
                "req_id, request.num_computed_tokens)\n"
            ),
            new="",
        ),
        Break(
            name="free-held-blocks",
            patch="3.14",
            protection=(
                "blocks that a connector's store still reads are held when they "
                "leave a block table (broken: freed at once)"
            ),
            path="vllm/v1/core/kv_cache_manager.py",
            old="        if read_block_ids:\n",
            new="        if False:\n",
        ),
        Break(
            name="free-stored-load-untracked",
            patch="3.19",
            protection=(
                "a request whose connector stores it, aborted while the step of "
                "its synchronous load is in flight, keeps the blocks of that load "
                "tracked, so that a failure of the load takes the blocks computed "
                "on it out of the prefix cache (broken: the delayed free tracks "
                "nothing, and they stay prefix cache hits)"
            ),
            path="vllm/v1/core/sched/scheduler.py",
            old=(
                "            # blocks computed on it.\n"
                "            self._keep_blocks_of_load_in_flight(request)\n"
            ),
            new="            # blocks computed on it.\n            pass\n",
            caught_by=("random",),
            not_by_replay=(
                "the model has no delayed free of a request whose synchronous "
                "load's step is in flight: no replayed behaviour aborts a stored "
                "request with its load in flight"
            ),
        ),
        Break(
            name="multi-report-early",
            patch="4.4",
            protection=(
                "MultiConnector lets the scheduler see a connector's report of a "
                "finished request only once every connector that saves it "
                "asynchronously reported it (broken: at any connector's report, "
                "which ends the delayed free while another connector saves)"
            ),
            path="vllm/distributed/kv_transfer/kv_connector/v1/multi_connector.py",
            old=(
                "        sending = saved | {r for r in reported "
                "if r not in self._saving}\n"
            ),
            new="        sending = saved | reported\n",
            caught_by=("random",),
            not_by_replay=(
                "the model has one connector: no replayed behaviour runs a "
                "MultiConnector"
            ),
            stage=4,
        ),
    )
}
