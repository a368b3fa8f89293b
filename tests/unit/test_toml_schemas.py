"""The TOML files' schemas (msgspec Structs, see hmastack.core.tomlfile): each
kind of mismatch is a HmastackError with msgspec's message, naming the file and
the offending key by the names of its tables."""

from __future__ import annotations

import shutil
from pathlib import Path

import msgspec
import pytest

from hmastack.bench import trees as bench_trees
from hmastack.core import config
from hmastack.core.errors import HmastackError
from hmastack.e2e import environment
from hmastack.matrix import pytest_runs
from hmastack.spec import manifest as spec_manifest
from hmastack.stack import series

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
    message = _config_error(tmp_path, 'base_date = "', 'base_date = 4\nx = "')
    assert "Expected `str`, got `int` - at `series.base_date`" in message


def test_hmastack_toml_missing_key_names_the_tree(tmp_path):
    message = _config_error(tmp_path, 'tag = "v0.3.11"\n', "")
    assert "trees.lmcache: a tree needs its tag" in message


def test_a_tree_is_named_by_its_table_only(tmp_path):
    message = _config_error(tmp_path, 'ruff = "0.14.0"', 'name = "x"\nruff = "0.14.0"')
    assert "trees.vllm: the name is the table's key" in message
    assert config.load(ROOT).trees["lmcache"].name == "lmcache"


def test_hmastack_toml_missing_key_of_a_nested_table(tmp_path):
    message = _config_error(tmp_path, 'member = "vllm/_C.abi3.so"\n', "")
    assert "missing required field `member` - at `e2e.kernels`" in message


def test_hmastack_toml_wrong_type_in_a_list_and_a_peer(tmp_path):
    message = _config_error(tmp_path, '"tests/v1/core",', '"tests/v1/core", 3,')
    assert "Expected `str`, got `int` - at `suite.vllm[1]`" in message
    message = _config_error(tmp_path, 'sha256 = "ed86', 'sha256 = 1\nx = "')
    assert "Expected `str`, got `int` - at `peers.vllm-0-14.sha256`" in message


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        # a misspelt key of a tree
        ('ruff = "0.14.0"', 'rufff = "0.14.0"', "`rufff` - at `trees.vllm`"),
        # a table the file does not have
        ("[env]\n", "[extra]\nx = 1\n\n[env]\n", "`extra`"),
        # the stages are the directories: a count of them is no key
        ("[series]\n", "[series]\nstages = 4\n", "`stages` - at `series`"),
        ("member_sha256", "member_sha", "`member_sha` - at `e2e.kernels`"),
    ],
)
def test_hmastack_toml_refuses_unknown_keys_and_tables(tmp_path, old, new, expected):
    message = _config_error(tmp_path, old, new)
    assert "Object contains unknown field " + expected in message


def test_a_stage_toml_names_the_key_that_does_not_match(project):
    """patches/*/stage.toml has one schema (hmastack.stack.series.StageFile):
    a wrong type, an unknown key or a value the schema does not allow names
    the file and the key."""
    toml = project.patches / "02-second" / "stage.toml"
    for text, expected in [
        ('tag = "T"\n[e2e]\nrun = "x"\n', "Expected `array`, got `str` - at `e2e.run`"),
        ('tag = "T"\n[e2e]\nrunn = []\n', "unknown field `runn` - at `e2e`"),
        (
            'tag = "T"\n[[conform.breaks]]\nname = "b"\n',
            "missing required field `patch` - at `conform.breaks[0]`",
        ),
        ('tag = "T"\n[bench]\nchecks = ["eagle"]\n', "at `bench.checks[0]`"),
    ]:
        toml.write_text(text)
        with pytest.raises(HmastackError) as err:
            series.discover(project)
        assert str(toml) in err.value.message and expected in err.value.message


def test_every_configuration_file_refuses_unknown_keys(tmp_path):
    tlc = (ROOT / "spec" / "tlc.toml").read_text()
    (tmp_path / "spec").mkdir()
    (tmp_path / "spec" / "tlc.toml").write_text(
        tlc.replace("[run]", "[run]\nworker = 2", 1)
    )
    with pytest.raises(HmastackError, match=r"unknown field `worker` - at `run`"):
        spec_manifest.load_settings(tmp_path)
    deselected = tmp_path / "deselected.toml"
    deselected.write_text(
        '[[deselect]]\nnode = "a"\nreason = "needs GPU"\nwhy = "b"\nwhy_not = "c"\n'
    )
    with pytest.raises(HmastackError, match=r"`why_not` - at `deselect\[0\]`"):
        pytest_runs.load_deselected(deselected)


def test_hmastack_toml_not_toml(tmp_path):
    (tmp_path / "hmastack.toml").write_text("[series\n")
    with pytest.raises(HmastackError, match="is not valid TOML"):
        config.load(tmp_path)


def test_hmastack_toml_is_read_once_for_the_peer_and_e2e(tmp_path, monkeypatch):
    cfg = config.load(ROOT)
    peer = cfg.peers[bench_trees.PEER_KEY]
    assert (peer.version, peer.tag, peer.ruff) == ("0.14.0", "v0.14.0", None)
    assert environment.section(cfg).kernels.member == "vllm/_C.abi3.so"
    no_e2e = msgspec.structs.replace(cfg, e2e=None)
    with pytest.raises(HmastackError, match=r"the \[e2e\] section is missing"):
        environment.section(no_e2e)
    path, why = bench_trees.peer_tree(msgspec.structs.replace(cfg, peers={}))
    assert path is None and "no [peers.vllm-0-14]" in why


def test_a_peer_tag_defaults_to_v_version(tmp_path):
    text = HMASTACK_TOML.replace('tag = "v0.14.0"\n', "", 1)
    (tmp_path / "hmastack.toml").write_text(text)
    assert config.load(tmp_path).peers["vllm-0-14"].tag == "v0.14.0"


def _settings(tmp_path: Path) -> spec_manifest.Settings:
    shutil.copy(ROOT / "spec" / "tlc.toml", tmp_path / "tlc.toml")
    return msgspec.structs.replace(spec_manifest.load_settings(ROOT), spec_dir=tmp_path)


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
        ('result = "success"\ndepth = 1.5', "Expected `int | null`, got `float`"),
        ('result = "success"\ndeadlock = "yes"', "`bool`, got `str` - at `deadlock`"),
        # an unknown key (the manifest refuses them)
        ('result = "success"\nexpect = "pass"', "unknown field `expect`"),
        # a missing required key
        ('mode = "simulate"', "Object missing required field `result`"),
        # a bad enum value
        ('result = "pass"', "Invalid enum value 'pass' - at `result`"),
        ('result = "success"\nsize = "huge"', "Invalid enum value 'huge' - at `size`"),
        # the rules across keys are kept
        ('result = "safety failure"', "a safety failure names its property"),
    ],
)
def test_manifest_errors_name_the_file_the_model_and_the_key(tmp_path, table, expected):
    assert expected in _manifest_error(tmp_path, table)


def test_manifest_without_models_table(tmp_path):
    settings = _settings(tmp_path)
    (tmp_path / "manifest.toml").write_text("[model.x]\n")
    with pytest.raises(HmastackError, match=r"manifest.toml: .* unknown field `model`"):
        spec_manifest.load_manifest(settings)
    (tmp_path / "manifest.toml").write_text("")
    with pytest.raises(
        HmastackError, match=r"manifest.toml: .* required field `models`"
    ):
        spec_manifest.load_manifest(settings)


def test_missing_manifest_says_restore_it(tmp_path):
    with pytest.raises(HmastackError, match="is missing") as err:
        spec_manifest.load_manifest(_settings(tmp_path))
    assert err.value.hint == "restore it from git"


@pytest.mark.parametrize(
    "old, new, expected",
    [
        ("workers = 1", 'workers = "1"', "`int`, got `str` - at `run.workers`"),
        ('module = "MCHybridKVAlloc"\n', "", "required field `module` - at `spec`"),
        (
            "java_opts = [",
            "java_opts = [1, ",
            "`str`, got `int` - at `run.java_opts[0]`",
        ),
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
        ('node = "t.py"\nreason = "needs ray"\nwhy = 3', "at `deselect[0].why`"),
        ('node = "t.py"\nreason = "needs ray"', "`why` - at `deselect[0]`"),
        (
            'node = "t.py"\nreason = "flaky"\nwhy = "w"',
            "'flaky' - at `deselect[0].reason`",
        ),
        ('node = ""\nreason = "needs ray"\nwhy = "w"', ">= 1 - at `deselect[0].node`"),
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
