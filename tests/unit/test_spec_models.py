"""TLC on every model of spec/manifest.toml: results and exact state counts.

Includes the mutation checks: each model under spec/models/mutations/ switches
off one protection of the Series policy (constant ``Mutation``) and TLC must
report the property that protection guards. Skipped only when Java is missing.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import pytest

from hmastack import spec
from hmastack.errors import HmastackError

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = spec.load_settings(ROOT)
MODELS = spec.load_manifest(SETTINGS)
HAVE_JAVA = shutil.which("java") is not None
needs_java = pytest.mark.skipif(
    not HAVE_JAVA, reason="Java is not installed (TLC needs it)"
)


@pytest.fixture(scope="module")
def tlc_env():
    java = spec.find_java()
    jar = spec.resolve_jar(ROOT, SETTINGS)
    return java, jar


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    return tmp_path_factory.mktemp("spec-build")


def test_manifest_covers_every_model_file():
    cfgs = {
        p.relative_to(SETTINGS.spec_dir / "models").with_suffix("").as_posix()
        for p in (SETTINGS.spec_dir / "models").rglob("*.cfg")
    }
    assert cfgs == set(MODELS)
    for model in MODELS.values():
        assert model.cfg.is_file()
        if model.expect == "pass" and model.mode == "exhaustive":
            assert model.distinct_states, f"{model.name} records its exact state count"


def test_series_small_is_big_enough_and_checks_every_safety_property():
    model = MODELS["series-small"]
    assert model.distinct_states >= 100_000
    text = model.cfg.read_text()
    for prop in (
        "TypeOK",
        "Conservation",
        "ExclusiveOwnership",
        "NoTransferRace",
        "RefCount",
        "NullPrefix",
        "WindowBound",
        "ExactAdmission",
        "NoPrematurePublish",
    ):
        assert f"    {prop}\n" in text
    assert 'Policy = "Series"' in text and 'Mutation = "none"' in text


def test_mutations_each_guard_a_property_and_change_only_the_mutation():
    mutations = {n: m for n, m in MODELS.items() if n.startswith("mutations/")}
    assert len(mutations) >= 8
    assert {m.prop for m in mutations.values()} >= {
        "NoPrematurePublish",
        "ExclusiveOwnership",
        "NoTransferRace",
        "WindowBound",
        "NullPrefix",
        "ExactAdmission",
        "RefCount",
        "Conservation",
    }
    for model in mutations.values():
        text = model.cfg.read_text()
        assert 'Policy = "Series"' in text and 'Mutation = "none"' not in text


def test_compare_reports_drift_and_wrong_property():
    model = spec.Model(
        name="m",
        cfg=Path("m.cfg"),
        mode="exhaustive",
        expect="pass",
        distinct_states=10,
    )
    ok = {"result": "pass", "violated": None, "distinct_states": 10, "errors": []}
    assert spec.compare(model, ok) == []
    drift = dict(ok, distinct_states=11)
    assert "drifted" in spec.compare(model, drift)[0]
    bad = spec.Model(
        name="l",
        cfg=Path("l.cfg"),
        mode="exhaustive",
        expect="violation",
        prop="WindowBound",
    )
    other = {
        "result": "violation",
        "violated": "NoTransferRace",
        "distinct_states": 5,
        "errors": [],
    }
    assert "NoTransferRace" in spec.compare(bad, other)[0]
    assert spec.compare(bad, dict(other, violated="WindowBound")) == []
    assert "expected WindowBound" in spec.compare(bad, ok)[0]


def test_register_adds_fetch_and_check():
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    spec.register(sub)
    args = parser.parse_args(["spec", "check", "legacy", "series-small"])
    assert args.func is spec.cmd_check and args.model == ["legacy", "series-small"]
    args = parser.parse_args(["spec", "check", "--all"])
    assert args.all
    assert parser.parse_args(["spec", "fetch"]).func is spec.cmd_fetch


def test_missing_java_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("JAVA_HOME", raising=False)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(HmastackError) as err:
        spec.find_java()
    assert "openjdk-17-jre-headless" in err.value.hint


@needs_java
def test_translation_is_current(tlc_env):
    java, jar = tlc_env
    spec.check_translation(java, jar, SETTINGS)


@needs_java
def test_stale_translation_is_detected(tlc_env, tmp_path):
    java, jar = tlc_env
    text = SETTINGS.tla_file.read_text().replace("Init == ", "Init == TRUE /\\ ", 1)
    (tmp_path / SETTINGS.tla_file.name).write_text(text)
    stale = spec.Settings(**{**SETTINGS.__dict__, "spec_dir": tmp_path})
    with pytest.raises(HmastackError, match="out of date"):
        spec.check_translation(java, jar, stale)


@needs_java
@pytest.mark.parametrize("name", sorted(MODELS))
def test_model_matches_manifest(name, tlc_env, build):
    java, jar = tlc_env
    model = MODELS[name]
    report = spec.run_model(java, jar, SETTINGS, model, build)
    path = spec.write_report(report, build / "reports")
    assert report["problems"] == [], f"{name}: see {path}"
    if model.expect == "violation":
        trace = report["trace"]
        assert trace, "a violation keeps its trace"
        assert trace[0]["event"]["act"] == "Init"
        assert all(state["event"]["act"] for state in trace)
    if name == "legacy":
        # 0.13.0: every external token gets a sliding-window block.
        alloc = report["trace"][-1]["event"]
        assert alloc["act"] == "AllocateSlots"
        assert len(alloc["blocks"]["swa"]) > 2
