"""The checkpoint formats' registry: each format told from its marker files, a directory no format recognises
refused naming every format's markers, one format per name."""

import os

import pytest

from megatron_tawpipe import checkpoint
from megatron_tawpipe.arguments.choices import CKPT_FORMATS
from megatron_tawpipe.checkpoint import formats
from megatron_tawpipe.common.errors import CheckpointError, CheckpointSetupError


def _touch(path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    open(path, "wb").close()


MARKERS = {"torch_dist": [".metadata", "__0_0.distcp"], "torch": ["mp_rank_00/model_optim_rng.pt"],
           "tawpipe": ["common.pt", "params_rank00000.pt"]}


def test_the_registry_holds_the_formats_the_flag_names():
    assert sorted(fmt.name for fmt in formats.registered()) == sorted(CKPT_FORMATS)
    assert all(formats.named(name).name == name for name in CKPT_FORMATS)


@pytest.mark.parametrize("name", sorted(MARKERS))
def test_each_format_is_recognised_from_its_marker_files(tmp_path, name):
    for marker in MARKERS[name]:
        _touch(str(tmp_path / marker))
    assert checkpoint.checkpoint_format(str(tmp_path)) == name
    assert [fmt.name for fmt in formats.registered() if fmt.recognises(str(tmp_path))] == [name]


def test_torch_dist_comes_before_tawpipe(tmp_path):
    """megatron-core up to 0.18 writes a common.pt beside .metadata."""
    for marker in (".metadata", "common.pt"):
        _touch(str(tmp_path / marker))
    assert checkpoint.checkpoint_format(str(tmp_path)) == "torch_dist"


def test_a_legacy_rank_folder_without_its_file_is_not_a_checkpoint(tmp_path):
    os.makedirs(tmp_path / "mp_rank_00")
    with pytest.raises(CheckpointError):
        checkpoint.checkpoint_format(str(tmp_path))


def test_an_unknown_directory_names_every_format_and_its_markers(tmp_path):
    _touch(str(tmp_path / "weights.bin"))
    with pytest.raises(CheckpointError) as raised:
        checkpoint.checkpoint_format(str(tmp_path))
    message = str(raised.value)
    assert message == (f"{tmp_path}: neither a torch_dist checkpoint (.metadata), Megatron-LM's legacy torch format "
                       "(mp_rank_*/model_optim_rng.pt) nor this project's per-parameter format (common.pt)")
    with pytest.raises(CheckpointError, match="neither"):
        checkpoint.read_parameters(str(tmp_path))


def test_a_second_format_of_a_name_is_refused():
    before = formats.registered()
    with pytest.raises(ValueError, match="'tawpipe' is registered already"):
        formats.register(formats.PerParameterFormat())
    assert formats.registered() == before


def test_an_unknown_format_name_is_refused_naming_the_flag():
    with pytest.raises(CheckpointSetupError, match=r"--ckpt-format zarr: .*torch_dist, torch, tawpipe"):
        formats.named("zarr")
