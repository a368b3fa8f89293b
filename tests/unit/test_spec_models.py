"""The manifest and TLC on every ci model of spec/manifest.toml: results, exact
state counts, counterexample lengths and witnesses.

Includes the mutation checks: each model under spec/models/mutations/ is a model
that passes unmutated with one protection switched off (constant ``Mutation``
of the model-checking wrapper, with the wrapper's broken definition in place
of the spec's), and TLC must report the property that protection guards. TLC
runs are skipped only when Java is missing.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec
import pytest

from hmastack.core.errors import HmastackError
from hmastack.site import model as site_model
from hmastack.spec import cfg as spec_cfg
from hmastack.spec import install as spec_install
from hmastack.spec import manifest as spec_manifest
from hmastack.spec import models as spec

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = spec_manifest.load_settings(ROOT)
MODELS = spec_manifest.load_manifest(SETTINGS)
HAVE_JAVA = shutil.which("java") is not None
needs_java = pytest.mark.skipif(
    not HAVE_JAVA, reason="Java is not installed (TLC needs it)"
)
SAFETY = [
    "TypeOK", "Conservation", "ExclusiveOwnership", "NoTransferRace", "RefCount",
    "NullPrefix", "WindowCovered", "NoStaleRead", "NoPrematurePublish",
]  # fmt: skip


@pytest.fixture(scope="module")
def tlc_env():
    java = spec_install.find_java()
    jar = spec_install.resolve_jar(ROOT, SETTINGS)
    return java, jar


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    return tmp_path_factory.mktemp("spec-build")


def constants(model: spec_manifest.Model) -> dict[str, str]:
    return spec_cfg.read_cfg(model.path).constants


def module_text(module: str) -> str:
    """spec/<module>.tla and the spec/ modules it EXTENDS (a model-checking
    wrapper extends the spec)."""
    text = (SETTINGS.spec_dir / f"{module}.tla").read_text()
    extends = re.search(r"^EXTENDS\s+(.*)$", text, flags=re.M)
    for name in re.findall(r"\w+", extends[1]) if extends else []:
        if (SETTINGS.spec_dir / f"{name}.tla").is_file():
            text += module_text(name)
    return text


def definitions(text: str) -> set[str]:
    return set(re.findall(r"^(\w+)(?:\(.*?\))?\s*==", text, flags=re.M))


def test_manifest_covers_every_model_file_and_records_results():
    cfgs = {
        p.relative_to(SETTINGS.spec_dir / "models").with_suffix("").as_posix()
        for p in (SETTINGS.spec_dir / "models").rglob("*.cfg")
    }
    assert cfgs == set(MODELS)
    for model in MODELS.values():
        assert model.path.is_file()
        if model.size != "ci":
            continue
        if model.result == "success" and model.mode == "exhaustive":
            assert model.distinct_states and model.generated_states and model.depth, (
                f"{model.name} records its exact state counts"
            )
        # EagleHits is violated by an initial state (one lookup is one state):
        # TLC prints no numbered trace for it.
        one_state = spec_manifest.module_of(model, SETTINGS) == "MCEagleHits"
        if model.result == "liveness failure":
            # TLC checks temporal properties at intervals of wall-clock time:
            # the lasso it reports differs from run to run.
            assert model.trace_length is None, f"{model.name} pins no lasso length"
        elif model.result != "success":
            assert model.trace_length or one_state, f"{model.name} records its trace"
            assert model.workers == 1, "a failure's first trace is stable with 1 worker"
        assert one_state or all(n is not None for n in model.witnesses.values()), (
            model.name
        )


def test_each_mutation_is_a_passing_model_with_one_protection_off():
    """Every mutation (the skip rule off by one among them) is caught by an
    exhaustive model expected to pass unmutated."""
    mutations = {n: m for n, m in MODELS.items() if n.startswith("mutations/")}
    assert "mutations/skip-ceil" in mutations
    bases = {
        n: constants(m)
        for n, m in MODELS.items()
        if not n.startswith("mutations/")
        and m.result == "success"
        and m.mode == "exhaustive"
        and m.size == "ci"
    }
    for name, model in MODELS.items():
        # A model replaces a definition of the spec if and only if it names a
        # mutation (mutations/, and the findings that switch one off).
        cfg = spec_cfg.read_cfg(model.path)
        mutation = cfg.constants.get("Mutation", '"none"').strip('"')
        if mutation == "none":
            assert not cfg.overrides, f"{name}: replaces a definition unmutated"
            continue
        module = spec_manifest.module_of(model, SETTINGS)
        spec_module = site_model.extended_spec(SETTINGS.spec_dir, module)
        assert spec_module != module, f"{name}: a mutation outside a wrapper"
        # The wrapper's broken definition replaces the spec's: each named
        # after the mutation, each replacing a definition of the spec.
        spec_defs = definitions(module_text(spec_module))
        wrapper_defs = definitions(module_text(module)) - spec_defs
        assert cfg.overrides, f"{name}: no definition replaced"
        for old, new in cfg.overrides.items():
            assert old in spec_defs and new in wrapper_defs, (name, old, new)
            assert new.startswith(f"Mut{mutation}"), (name, new)
    for name, model in mutations.items():
        c = constants(model)
        assert c["Mutation"] != '"none"'
        unmutated = {**c, "Mutation": '"none"'}
        base = [b for b, bc in bases.items() if bc == unmutated]
        assert base, f"{name}: no passing ci model has its other constants"
        # An invariant or action property violated, (deadlock checking on) a
        # state with nothing enabled before every request is done, or a
        # behaviour in which a request never finishes.
        assert (
            (model.result == "safety failure" and model.prop)
            or (model.result == "deadlock failure" and model.deadlock)
            or (model.result == "liveness failure" and model.prop == "Liveness")
        ), name


def test_exhaustive_series_models_are_big_enough():
    """Sliding-window tables beyond two real blocks, a preemption of another
    request, a hold, each load-failure branch: some passing model reaches each
    (the witnesses prove it)."""
    reached = {w for m in MODELS.values() if m.result == "success" for w in m.witnesses}
    assert reached >= {
        "SwaBeyondTwo", "WindowAtBound", "PreemptOther", "Eviction", "NullPadExternal",
        "Held", "Draft", "LoadFailure", "AsyncFailKeep", "AsyncFailRestart",
        "SyncFailKeep", "SyncFailRestart", "SharedInvalid", "FailAfterAbort",
        "FreeWaiting", "EagleHit", "EagleSwaRun", "EagleChunkBack",
        "LatePreempt", "Discard", "FailRestart", "InPlace",
        "SlideInFlight", "MemoryPreempt", "Republish", "Marked", "RealPastWindow",
        "MambaShortened", "MambaStateShared",
    }  # fmt: skip


def test_passing_series_models_check_every_safety_property_they_claim():
    for name in ("series-wide", "series-decode", "series-saves"):
        cfg = spec_cfg.read_cfg(MODELS[name].path)
        assert set(cfg.invariants) == set(SAFETY), name
        assert set(cfg.properties) == {"WindowBound", "ExactAdmission"}, name


def test_mamba_properties_each_have_a_mutation():
    """A Mamba group (Kind = "mamba"): its passing models check every safety
    property with the recompute rule (ValidStateRead) and the table shape
    (MambaTableShape), reach a shortened load, a shared state block, a
    failure past block 0 that starts over and a sharer of a failed block, and
    a mutation of one of them breaks each property: ownership, the table
    shape and the recompute rule."""
    mamba = {n: m for n, m in MODELS.items() if constants(m).get("Kind") == '"mamba"'}
    passing = [n for n, m in mamba.items() if m.result == "success"]
    assert passing
    for name in passing:
        cfg = spec_cfg.read_cfg(MODELS[name].path)
        assert "ValidStateRead" in cfg.invariants, name
        assert "MambaTableShape" in cfg.properties, name
        if "Liveness" not in cfg.properties:
            assert set(cfg.invariants) == {*SAFETY, "ValidStateRead"}, name
            assert set(cfg.properties) == {
                "MambaTableShape",
                "FailureStartsOver",
                "ExactAdmission",
            }, name
    reached = {w for n in passing for w in MODELS[n].witnesses}
    assert reached >= {
        "MambaShortened", "MambaStateShared", "AsyncFailRestart",
        "SyncFailRestart", "SharedInvalid",
    }  # fmt: skip
    caught = {
        m.prop for n, m in mamba.items()
        if n.startswith("mutations/") and m.result == "safety failure"
    }  # fmt: skip
    assert caught >= {"ExclusiveOwnership", "MambaTableShape", "ValidStateRead"}


def test_each_fix_of_stage_03_bites():
    """A model of stage 03's allocation alone (SeriesAllocOnly) fails where the
    commits of stage 03 (SeriesAsCoded) pass with the same constants: the save
    race ([03.14 Hold blocks]), the stale read after an abort
    ([03.5 All sharers of a failed KV block]), the stall as a deadlock and as a
    liveness failure ([03.7 Fix a stall]), a connector whose loads all fail
    ([03.9 No new KV load]: without it the request loads again for ever).
    [03.8 Handle a failed sync KV load] is witnessed by its mutation
    (mutations/range-by-cached)."""
    MAIN, CODED = '"SeriesAllocOnly"', '"SeriesAsCoded"'
    pairs = [
        ("series-save-race", "series-saves", MAIN, CODED),
        ("series-stale-read-abort", "series-faults", MAIN, CODED),
        ("series-stall", "series-stall-fixed", MAIN, CODED),
        ("series-liveness-2-alloc-only", "series-liveness-2", MAIN, CODED),
        ("series-loads-fail-alloc-only", "series-loads-fail", MAIN, CODED),
    ]  # fmt: skip
    for before, after, policy_before, policy_after in pairs:
        a, b = constants(MODELS[before]), constants(MODELS[after])
        assert a.pop("Policy") == policy_before, before
        assert b.pop("Policy") == policy_after, after
        if before == "series-save-race":
            # The race needs a store outliving a step of a long prompt; the
            # passing model has aborts and async loads too (it is bigger).
            assert a["SaveMode"] == b["SaveMode"] == '"async"'
            continue
        assert a == b, (before, after)
        assert MODELS[after].result == "success", after
        if policy_before == MAIN:
            assert MODELS[before].result != "success", before


def test_async_sched_findings_pass_with_the_fix_rule():
    """spec/AsyncSched.tla: the code's rule fails where the fix's rule passes
    with the same constants: the load-failure mark (MarkRule) and the
    published-block count after a truncation in place (Uncache)."""
    pairs = [
        ("async-loads-fail", "async-loads-fail-any", "MarkRule",
         '"NoValidToken"', '"AnyFailure"'),
        ("sync-republish", "sync-republish-fixed", "Uncache", "FALSE", "TRUE"),
    ]  # fmt: skip
    for code, fix, key, rule_code, rule_fix in pairs:
        a, b = constants(MODELS[code]), constants(MODELS[fix])
        assert a.pop(key) == rule_code and b.pop(key) == rule_fix, (code, fix)
        assert a == b, (code, fix)
        assert MODELS[code].result != "success" and MODELS[fix].result == "success"
        for name in (code, fix):
            assert spec_manifest.module_of(MODELS[name], SETTINGS) == "MCAsyncSched"


def test_liveness_models_use_no_symmetry_nor_view():
    for model in MODELS.values():
        cfg = spec_cfg.read_cfg(model.path)
        if "Liveness" in cfg.properties:
            text = "\n".join(
                line
                for line in model.path.read_text().splitlines()
                if not line.lstrip().startswith("\\*")
            )
            assert "SYMMETRY" not in text and "VIEW" not in text, model.name
            assert "SPECIFICATION FairSpec" in text


def test_parse_model_rejects_bad_entries(tmp_path):
    def parse(**entry):
        return spec_manifest.parse_model("m", entry, tmp_path)

    assert parse(result="success").mode == "exhaustive"
    for entry, message in [
        ({}, "missing required field `result`"),
        ({"result": "pass"}, "Invalid enum value"),
        ({"result": "success", "mode": "bfs"}, "mode"),
        ({"result": "safety failure"}, "names its property"),
        ({"result": "deadlock failure"}, "deadlock = true"),
        (
            {"result": "safety failure", "property": "X", "mode": "simulate"},
            "simulation",
        ),
        ({"result": "success", "expect": "pass"}, "unknown field `expect`"),
        (
            {"result": "success", "distinct_states": "7"},
            "`int | null`, got `str` - at `distinct_states`",
        ),
        ({"result": "success", "size": "huge"}, "size"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse(**entry)
    assert parse(result="deadlock failure", deadlock=True).prop == "Deadlock"
    assert parse(result="success", witnesses=["A"]).witnesses == {"A": None}
    # a mutation names the patch it switches off, as an id
    with pytest.raises(ValueError, match="names the patch"):
        spec_manifest.parse_model("mutations/m", {"result": "success"}, tmp_path)
    with pytest.raises(ValueError, match="must be base or a reference"):
        parse(result="success", patch="patch 14")
    ref = "[lmcache 04.2 vLLM integration: describe]"
    assert parse(result="success", patch=ref).patch == ref
    assert parse(result="success", patch="base").patch == "base"


def test_malformed_manifest_names_the_model(tmp_path):
    (tmp_path / "manifest.toml").write_text('[models.x]\nresult = "pass"\n')
    settings = msgspec.structs.replace(SETTINGS, spec_dir=tmp_path)
    with pytest.raises(
        HmastackError, match="model x: Invalid enum value 'pass' - at `result`"
    ):
        spec_manifest.load_manifest(settings)


def _report(model: spec_manifest.Model, **fields) -> spec.ModelReport:
    """A report of ``model`` as TLC found it expected, with ``fields`` replaced."""
    found = {
        "model": model.name, "cfg": str(model.path), "mode": model.mode,
        "deadlock_checked": model.deadlock, "result": model.result,
        "violated": model.prop, "distinct_states": model.distinct_states,
        "generated_states": model.generated_states, "depth": model.depth,
        "trace_length": model.trace_length, "seconds": 1.0, "workers": 1,
        "exit_code": 0, "command": [], "errors": [], "trace": [],
        "expected": spec.expectation(model),
    }  # fmt: skip
    return spec.ModelReport(**(found | fields))


def test_compare_reports_drift_wrong_property_and_wrong_result():
    model = spec_manifest.Model(
        name="m", path=Path("m.cfg"), mode="exhaustive", result="success",
        distinct_states=10, generated_states=20, depth=3,
    )  # fmt: skip
    ok = _report(model)
    assert spec.compare(model, ok) == []
    assert (
        "distinct_states drifted"
        in spec.compare(model, _report(model, distinct_states=11))[0]
    )
    assert "depth drifted" in spec.compare(model, _report(model, depth=4))[0]
    bad = spec_manifest.Model(
        name="l", path=Path("l.cfg"), mode="exhaustive", result="safety failure",
        prop="WindowBound", trace_length=2,
    )  # fmt: skip
    other = _report(bad, violated="NoTransferRace")
    assert "NoTransferRace" in spec.compare(bad, other)[0]
    assert spec.compare(bad, _report(bad)) == []
    assert "trace_length drifted" in spec.compare(bad, _report(bad, trace_length=3))[0]
    assert "expected safety failure (WindowBound)" in spec.compare(bad, ok)[0]
    stall = spec_manifest.Model(
        name="s", path=Path("s.cfg"), mode="exhaustive", result="deadlock failure",
        prop="Deadlock", deadlock=True,
    )  # fmt: skip
    assert spec.compare(stall, _report(stall)) == []
    assert "TLC reports success" in spec.compare(stall, ok)[0]
    assert (
        "TLC failed"
        in spec.compare(model, _report(model, result="error", errors=["x"]))[0]
    )


def test_a_report_is_written_and_read_through_its_schema(tmp_path):
    model = MODELS["legacy"]
    report = _report(model, trace=[{"event": {"act": "Init"}, "_step": 1}])
    report.witnesses = {
        "Hold": spec.WitnessVerdict(
            ok=True, result="safety failure", trace_length=3, problems=[]
        )
    }
    path = spec.write_report(report, tmp_path)
    assert path == tmp_path / "spec" / "legacy.json"
    assert spec.read_report(tmp_path, "legacy") == report
    assert spec.read_report(tmp_path, "series-wide") is None  # not run


@pytest.mark.parametrize(
    "text",
    [
        '{"model": "legacy", "ok": true}',  # keys missing
        '{"model": "legacy", "ok": true',  # not JSON
    ],
)
def test_a_report_of_another_schema_names_the_file_and_the_command(tmp_path, text):
    """A corrupt report is an error, not a model that has not run."""
    path = spec.report_path(tmp_path, "legacy")
    path.parent.mkdir(parents=True)
    path.write_text(text)
    with pytest.raises(HmastackError) as err:
        spec.read_report(tmp_path, "legacy")
    assert str(path) in err.value.message
    assert "hmastack spec check legacy" in err.value.hint


def test_a_wrong_typed_report_field_names_the_field(tmp_path):
    report = msgspec.to_builtins(_report(MODELS["legacy"]))
    report["generated_states"] = "many"
    path = spec.report_path(tmp_path, "legacy")
    path.parent.mkdir(parents=True)
    path.write_bytes(msgspec.json.encode(report))
    with pytest.raises(HmastackError, match=r"Expected `int \| null`, got `str`"):
        spec.read_report(tmp_path, "legacy")


def test_deadlock_flag_follows_the_manifest(tmp_path):
    model = MODELS["series-stall"]
    cmd = spec.tlc_command("java", Path("t.jar"), SETTINGS, model, tmp_path)
    assert "-deadlock" not in cmd
    cmd = spec.tlc_command(
        "java", Path("t.jar"), SETTINGS, MODELS["series-wide"], tmp_path
    )
    assert "-deadlock" in cmd


def test_witness_run_keeps_the_constants_and_checks_only_the_witness():
    model = MODELS["series-wide"]
    run = spec_manifest.witness_model(model, "Eviction")
    text = spec.cfg_text(run)
    assert run.name == "series-wide@Eviction" and run.workers == 1
    assert run.result == "safety failure" and run.prop == "WitnessEviction"
    cfg = spec_cfg.read_cfg(model.path)
    for key, value in cfg.constants.items():
        assert f"    {key} = {value}\n" in text
    assert "SYMMETRY Symmetry" in text and "VIEW View" in text
    assert re.search(r"PROPERTY\n    WitnessEviction\n$", text)
    assert "INVARIANT" not in text and "WindowBound" not in text


def test_every_witness_and_property_is_defined_in_the_spec():
    for model in MODELS.values():
        module = spec_manifest.module_of(model, SETTINGS)
        text = module_text(module)
        cfg = spec_cfg.read_cfg(model.path)
        for name in [*cfg.invariants, *cfg.properties] + [
            f"Witness{w}" for w in model.witnesses
        ]:
            assert re.search(rf"^{name} ==", text, flags=re.M), (model.name, name)


def test_select_runs_ci_models_unless_nightly():
    ci = spec_manifest.select(MODELS, [], nightly=False)
    everything = spec_manifest.select(MODELS, [], nightly=True)
    assert "series-three" not in ci and "series-three" in everything
    assert spec_manifest.select(MODELS, ["legacy"], nightly=False) == ["legacy"]
    with pytest.raises(HmastackError, match="unknown model"):
        spec_manifest.select(MODELS, ["nope"], nightly=False)


def test_spec_commands_call_their_step_with_the_flags(monkeypatch):
    from hmastack import cli
    from hmastack.core.steps import StepResult

    calls = []

    def run_step(cfg, *a, **kw):
        calls.append((a, kw))
        return StepResult(False, "a model misses its manifest entry")

    monkeypatch.setattr(spec, "run_step", run_step)
    monkeypatch.setattr(spec, "cmd_fetch", lambda: calls.append("fetch") or 0)
    assert cli.main(["spec", "check", "legacy", "series-wide"]) == 1
    assert cli.main(["spec", "check", "--nightly", "--no-witnesses"]) == 1
    assert cli.main(["spec", "fetch"]) == 0
    assert calls == [
        ((["legacy", "series-wide"],), {"nightly": False, "witnesses": True}),
        (([],), {"nightly": True, "witnesses": False}),
        "fetch",
    ]
    # `hmastack spec` alone is a usage error, not a silent no-op.
    with pytest.raises(SystemExit) as exit_:
        cli.main(["spec"])
    assert exit_.value.code == 2


def test_a_model_may_name_its_module(tmp_path):
    eagle = MODELS["eagle-hits"]
    assert spec_manifest.module_of(eagle, SETTINGS) == "MCEagleHits"
    assert (
        spec_manifest.module_of(MODELS["series-wide"], SETTINGS) == SETTINGS.spec.module
    )
    cmd = spec.tlc_command("java", Path("t.jar"), SETTINGS, eagle, tmp_path)
    assert cmd[-1] == "MCEagleHits"
    assert spec_manifest.witness_model(eagle, "EagleHit").module == "MCEagleHits"
    with pytest.raises(ValueError, match="module"):
        spec_manifest.parse_model("m", {"result": "success", "module": "a/b"}, tmp_path)


def test_missing_java_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("JAVA_HOME", raising=False)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(HmastackError) as err:
        spec_install.find_java()
    assert "openjdk-17-jre-headless" in err.value.hint


def _recorded_seconds(run: spec_manifest.Model) -> float:
    # A witness run stops at its first violation: it goes after the models.
    return 0.0 if run.is_witness else (run.seconds or 0.0)


# The longest recorded run first, so that the two TLC runs at a time (one
# worker each, spec/tlc.toml's `parallel`) finish together.
CI_RUNS = sorted(
    (
        run
        for name in sorted(MODELS)
        if MODELS[name].size == "ci"
        for run in spec_manifest.runs_for(MODELS[name])
    ),
    key=_recorded_seconds,
    reverse=True,
)


@pytest.fixture(scope="module")
def tlc_runs(request, tlc_env, build):
    """TLC on every run that the collected ``test_model_matches_manifest`` items
    check, ``parallel`` at a time in their order: each test waits for its own."""
    java, jar = tlc_env
    wanted = [
        item.callspec.params["run"]
        for item in request.session.items
        if getattr(item, "originalname", None) == "test_model_matches_manifest"
    ]
    pool = ThreadPoolExecutor(max_workers=max(1, SETTINGS.run.parallel))
    futures = {
        run.name: pool.submit(spec.run_model, java, jar, SETTINGS, run, build)
        for run in wanted
    }
    yield futures
    pool.shutdown(wait=False, cancel_futures=True)


@pytest.mark.tlc
@needs_java
@pytest.mark.parametrize("run", CI_RUNS, ids=[r.name for r in CI_RUNS])
def test_model_matches_manifest(run, tlc_runs, build):
    report = tlc_runs[run.name].result()
    path = spec.write_report(report, build / "reports")
    assert report.problems == [], f"{run.name}: see {path}"
    if run.result == "safety failure" and not run.is_witness:
        trace = report.trace
        if spec_manifest.module_of(run, SETTINGS) == SETTINGS.spec.module:
            assert trace, "a violation keeps its trace"
            assert trace[0]["event"]["act"] == "Init"
        # EagleHits is violated by an initial state, which TLC reports
        # without a numbered trace (the report keeps none).
    if run.name == "legacy":
        # 0.13.0: every external token gets a sliding-window block.
        alloc = report.trace[-1]["event"]
        assert alloc["act"] == "AllocateSlots"
        assert len(alloc["blocks"]["swa"]) > 2


def _jar(path: Path, members: list[str]) -> Path:
    import zipfile

    with zipfile.ZipFile(path, "w") as zf:
        for name in members:
            zf.writestr(name, b"")
    return path


def test_a_jar_that_is_not_tlc_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("TLA2TOOLS_JAR", str(_jar(tmp_path / "x.jar", ["a.class"])))
    with pytest.raises(HmastackError, match="is not a TLC jar"):
        spec_install.resolve_jar(ROOT, SETTINGS)


def test_a_tlc_that_does_not_start_is_an_error_and_keeps_the_last_report(
    tmp_path, monkeypatch, capsys
):
    """No verdict (neither ok nor MISMATCH) and no report from a TLC run that
    never started; the model's previous report stays."""
    jar = _jar(tmp_path / "tla2tools.jar", ["tlc2/TLC.class"])
    monkeypatch.setenv("TLA2TOOLS_JAR", str(jar))
    java = tmp_path / "java"
    java.write_text(
        "#!/bin/sh\necho 'Error: Could not find or load main class tlc2.TLC'\nexit 1\n"
    )
    java.chmod(0o755)
    monkeypatch.setattr(spec, "find_java", lambda: str(java))
    reports = tmp_path / "reports"
    good = spec.report_path(reports, "legacy")
    good.parent.mkdir(parents=True)
    good.write_text('{"model": "legacy", "ok": true}\n')
    with pytest.raises(HmastackError, match="TLC did not start") as err:
        spec.check_models(
            ROOT, tmp_path, reports, SETTINGS, MODELS, ["legacy"], witnesses=False
        )
    assert "Could not find or load main class" in err.value.message
    assert good.read_text() == '{"model": "legacy", "ok": true}\n'
    out = capsys.readouterr()
    assert "MISMATCH" not in out.out + out.err and "✓" not in out.out + out.err


@pytest.mark.tlc
@needs_java
def test_each_tlc_run_reads_the_standard_modules_from_its_own_directory(
    tlc_env, tmp_path
):
    """TLC copies its standard modules out of the jar into java.io.tmpdir;
    two runs side by side that share it can find them gone. Each run parses
    them from its own work directory."""
    java, jar = tlc_env
    work = tmp_path / "run"
    work.mkdir()
    (work / "Tiny.tla").write_text(
        "---- MODULE Tiny ----\nEXTENDS Naturals, Sequences\nVARIABLE x\n"
        "Init == x = <<>>\nNext == Len(x) < 2 /\\ x' = Append(x, 1)\n====\n"
    )
    (work / "model.cfg").write_text("INIT Init\nNEXT Next\n")
    cmd = spec.tlc_base_command(java, jar, SETTINGS, 1, 1, work) + ["Tiny"]
    out = subprocess.run(cmd, cwd=work, capture_output=True, text=True, check=False)
    parsed = re.findall(r"Parsing file (\S*Sequences\.tla)", out.stdout)
    assert parsed, out.stdout[-2000:]
    assert all(Path(p).parent == work / "tmp" for p in parsed), parsed


def test_each_model_belongs_to_one_stage():
    """Every model of the manifest is one stage's: named in its [spec] models
    (the base's for 0.13.0), or a mutation of the commit its patch names;
    every model and counterexample a stage names exists."""
    from hmastack.core import config
    from hmastack.site.docs import mutation_stages
    from hmastack.stack import series

    cfg = config.load(ROOT)
    models = spec_manifest.load_manifest(spec_manifest.load_settings(ROOT))
    stages = series.everything(cfg)
    named = [(m, s.key) for s in stages for m in s.info.spec.models]
    owner = dict(named) | mutation_stages(cfg)
    assert len(dict(named)) == len(named), "a model named by two stages"
    assert sorted(owner) == sorted(models)
    shown = [c.model for s in stages for c in s.info.spec.counterexamples]
    assert shown and set(shown) <= set(models)
