"""The TOML files' schemas (msgspec Structs, see hmastack.core.tomlfile): each
kind of mismatch is a HmastackError naming the file and the offending key."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest

from hmastack.bench import trees as bench_trees
from hmastack.core import config
from hmastack.core.errors import HmastackError
from hmastack.e2e import environment
from hmastack.matrix import pytest_runs
from hmastack.spec import manifest as spec_manifest

ROOT = Path(__file__).resolve().parents[2]
HMASTACK_TOML = (ROOT / "hmastack.toml").read_text()


def _config_error(tmp_path: Path, old: str, new: str) -> str:
    assert old in HMASTACK_TOML
    (tmp_path / "hmastack.toml").write_text(HMASTACK_TOML.replace(old, new, 1))
    with pytest.raises(HmastackError) as err:
        config.load(tmp_path)
    assert str(tmp_path / "hmastack.toml") in err.value.message
    return err.value.message


def test_hmastack_toml_wrong_type_names_the_key_and_the_value(tmp_path):
    message = _config_error(tmp_path, "stages = 4", 'stages = "4"')
    assert "series.stages must be an integer, not '4'" in message


def test_hmastack_toml_missing_key_names_the_tree(tmp_path):
    message = _config_error(tmp_path, 'tag = "v0.3.11"\n', "")
    assert "no trees.lmcache.tag (a required key)" in message


def test_hmastack_toml_missing_key_of_a_nested_table(tmp_path):
    message = _config_error(tmp_path, 'member = "vllm/_C.abi3.so"\n', "")
    assert "no e2e.kernels.member" in message


def test_hmastack_toml_wrong_type_in_a_list_and_a_peer(tmp_path):
    message = _config_error(tmp_path, '"tests/v1/core",', '"tests/v1/core", 3,')
    assert "suite.vllm[1] must be a string, not 3" in message
    message = _config_error(tmp_path, 'sha256 = "ed86', 'sha256 = 1\nx = "')
    assert "peers.vllm-0-14.sha256 must be a string, not 1" in message


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        # a misspelt key of a tree
        ('ruff = "0.14.0"', 'rufff = "0.14.0"', "unknown key trees.vllm.rufff"),
        # a table the file does not have
        ("[env]\n", "[extra]\nx = 1\n\n[env]\n", "unknown key extra"),
        # a typo of followups is named as such, not as a wrong stage count
        ("followups = 2", "followup = 2", "unknown key series.followup"),
        ("member_sha256", "member_sha", "unknown key e2e.kernels.member_sha"),
    ],
)
def test_hmastack_toml_refuses_unknown_keys_and_tables(tmp_path, old, new, expected):
    message = _config_error(tmp_path, old, new)
    assert expected in message
    assert "(known keys: " in message


def test_every_configuration_file_refuses_unknown_keys(tmp_path):
    tlc = (ROOT / "spec" / "tlc.toml").read_text()
    (tmp_path / "spec").mkdir()
    (tmp_path / "spec" / "tlc.toml").write_text(
        tlc.replace("[run]", "[run]\nworker = 2", 1)
    )
    with pytest.raises(HmastackError, match=r"unknown key run\.worker \(known"):
        spec_manifest.load_settings(tmp_path)
    deselected = tmp_path / "deselected.toml"
    deselected.write_text(
        '[[deselect]]\nnode = "a"\nreason = "needs GPU"\nwhy = "b"\nwhy_not = "c"\n'
    )
    with pytest.raises(HmastackError, match=r"unknown key deselect\[0\]\.why_not"):
        pytest_runs.load_deselected(deselected)


def test_hmastack_toml_not_toml(tmp_path):
    (tmp_path / "hmastack.toml").write_text("[series\n")
    with pytest.raises(HmastackError, match="is not valid TOML"):
        config.load(tmp_path)


def test_hmastack_toml_is_read_once_for_the_peer_and_e2e(tmp_path, monkeypatch):
    cfg = config.load(ROOT)
    peer = cfg.peers[bench_trees.PEER_KEY]
    assert (peer.version, peer.tag, peer.ruff) == ("0.14.0", "v0.14.0", None)
    assert environment.load_config(cfg).kernels.member == "vllm/_C.abi3.so"
    no_e2e = dataclasses.replace(cfg, e2e=None)
    with pytest.raises(HmastackError, match=r"the \[e2e\] section is missing"):
        environment.load_config(no_e2e)
    path, why = bench_trees.peer_tree(dataclasses.replace(cfg, peers={}))
    assert path is None and "no [peers.vllm-0-14]" in why


def test_a_peer_tag_defaults_to_v_version(tmp_path):
    text = HMASTACK_TOML.replace('tag = "v0.14.0"\n', "", 1)
    (tmp_path / "hmastack.toml").write_text(text)
    assert config.load(tmp_path).peers["vllm-0-14"].tag == "v0.14.0"


def _settings(tmp_path: Path) -> spec_manifest.Settings:
    shutil.copy(ROOT / "spec" / "tlc.toml", tmp_path / "tlc.toml")
    return dataclasses.replace(spec_manifest.load_settings(ROOT), spec_dir=tmp_path)


def _manifest_error(tmp_path: Path, table: str) -> str:
    settings = _settings(tmp_path)
    (tmp_path / "manifest.toml").write_text(f"[models.m1]\n{table}\n")
    with pytest.raises(HmastackError) as err:
        spec_manifest.load_manifest(settings)
    assert str(tmp_path / "manifest.toml") in err.value.message
    assert "model m1: " in err.value.message
    return err.value.message


@pytest.mark.parametrize(
    "table, expected",
    [
        # a wrong type
        ('result = "success"\ndepth = 1.5', "depth must be an integer, not 1.5"),
        ('result = "success"\ndeadlock = "yes"', "deadlock must be true or false"),
        # an unknown key (the manifest refuses them)
        ('result = "success"\nexpect = "pass"', "unknown key expect (known keys: cfg"),
        # a missing required key, with its allowed values
        ('mode = "simulate"', "no result (a required key, one of success, safety"),
        # a bad enum value
        ('result = "pass"', "result 'pass' is not one of success, safety failure"),
        ('result = "success"\nsize = "huge"', "size 'huge' is not one of ci, nightly"),
        # the rules across keys are kept
        ('result = "safety failure"', "a safety failure names its property"),
    ],
)
def test_manifest_errors_name_the_file_the_model_and_the_key(tmp_path, table, expected):
    assert expected in _manifest_error(tmp_path, table)


def test_manifest_without_models_table(tmp_path):
    settings = _settings(tmp_path)
    (tmp_path / "manifest.toml").write_text("[model.x]\n")
    with pytest.raises(HmastackError, match=r"manifest.toml: unknown key model \("):
        spec_manifest.load_manifest(settings)
    (tmp_path / "manifest.toml").write_text("")
    with pytest.raises(HmastackError, match=r"manifest.toml: no models \(a required"):
        spec_manifest.load_manifest(settings)


def test_missing_manifest_says_restore_it(tmp_path):
    with pytest.raises(HmastackError, match="is missing") as err:
        spec_manifest.load_manifest(_settings(tmp_path))
    assert err.value.hint == "restore it from git"


@pytest.mark.parametrize(
    "old, new, expected",
    [
        ("workers = 1", 'workers = "1"', "run.workers must be an integer, not '1'"),
        ('module = "HybridKVAlloc"\n', "", "no spec.module (a required key)"),
        ("java_opts = [", "java_opts = [1, ", "run.java_opts[0] must be a string"),
    ],
)
def test_tlc_toml_errors_name_the_file_and_the_key(tmp_path, old, new, expected):
    text = (ROOT / "spec" / "tlc.toml").read_text()
    assert old in text
    (tmp_path / "spec").mkdir()
    (tmp_path / "spec" / "tlc.toml").write_text(text.replace(old, new, 1))
    with pytest.raises(HmastackError) as err:
        spec_manifest.load_settings(tmp_path)
    assert str(tmp_path / "spec" / "tlc.toml") in err.value.message
    assert expected in err.value.message


@pytest.mark.parametrize(
    "entry, expected",
    [
        ('node = "t.py"\nreason = "needs ray"\nwhy = 3', "deselect[0].why must be a"),
        ('node = "t.py"\nreason = "needs ray"', "no deselect[0].why (a required key)"),
        ('node = "t.py"\nreason = "flaky"\nwhy = "w"', "deselect[0].reason 'flaky'"),
        ('node = ""\nreason = "needs ray"\nwhy = "w"', "deselect[0].node must not be"),
    ],
)
def test_deselected_errors_name_the_file_and_the_entry(tmp_path, entry, expected):
    path = tmp_path / "d.toml"
    path.write_text(f"[[deselect]]\n{entry}\n")
    with pytest.raises(HmastackError) as err:
        pytest_runs.load_deselected(path)
    assert err.value.message.startswith(f"{path}: ")
    assert expected in err.value.message
    assert "needs a node, a reason among" in err.value.hint
