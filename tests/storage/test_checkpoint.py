"""Finding a checkpoint's files: per-rank stems, manifests, the tensor file a manifest names."""

from __future__ import annotations

import pytest
from helpers.checkpoints import write_stock_tensor_file
from helpers.synthetic import write_synthetic_checkpoint

from tensorizer_manifest.errors import CheckpointNotFoundError, CompatibilityError, ManifestError
from tensorizer_manifest.storage import checkpoint


def test_stems_per_rank():
    assert checkpoint.checkpoint_stem() == "model"
    assert checkpoint.checkpoint_stem(1, 2) == "model-tp1-of-2"
    assert checkpoint.checkpoint_stem(0, 2, 1, 2) == "model-tp0-of-2-pp1-of-2"
    assert checkpoint.checkpoint_stem(0, 1, 1, 4) == "model-pp1-of-4"


def test_manifest_is_found_from_the_directory_or_the_file(tmp_path):
    d = write_synthetic_checkpoint(tmp_path / "ckpt")
    manifest, path = checkpoint.load_manifest(d)
    assert path == d / "model.manifest.json"
    assert checkpoint.read_manifest(path) == manifest == checkpoint.read_manifest(d, "model")


def test_a_rank_manifest_that_is_missing_names_the_layout(tmp_path):
    d = write_synthetic_checkpoint(tmp_path / "ckpt")
    with pytest.raises(CompatibilityError, match="saved with tensor_parallel_size=1, pipeline_parallel_size=1.*"
                       "tensor_parallel_size=2.*would need model-tp1-of-2.manifest.json"):  # fmt: skip
        checkpoint.find_manifest(d, "model-tp1-of-2")
    (d / "model.manifest.json").unlink()
    with pytest.raises(CheckpointNotFoundError, match="model-tp1-of-2.manifest.json.*tensor- and pipeline-parallel"):
        checkpoint.find_manifest(d, "model-tp1-of-2")


def test_no_manifest_and_no_directory(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="not a tensorizer-manifest checkpoint"):
        checkpoint.find_manifest(tmp_path)
    with pytest.raises(CheckpointNotFoundError, match="no such checkpoint"):
        checkpoint.find_manifest(tmp_path / "nope")


def test_oversized_manifest_is_refused_before_parsing(tmp_path, monkeypatch):
    d = write_synthetic_checkpoint(tmp_path / "ckpt")
    monkeypatch.setattr(checkpoint, "MAX_MANIFEST_BYTES", 100)
    with pytest.raises(ManifestError, match="over the 100 byte limit"):
        checkpoint.load_manifest(d)


@pytest.mark.parametrize("name", ["../x.tensors", "/etc/passwd", "", "..", "~x", "a\\b"])
def test_tensor_file_must_be_a_plain_name_inside_the_directory(tmp_path, name):
    d = write_synthetic_checkpoint(tmp_path / "ckpt")
    manifest, path = checkpoint.load_manifest(d)
    manifest.tensor_file.path = name
    with pytest.raises(ManifestError, match="plain file name"):
        checkpoint.resolve_tensor_file(manifest, path)


@pytest.mark.parametrize(
    ("key_from", "env", "letter", "bad_file", "bad_message"),
    [
        (
            "signing_key_from",
            "TENSORIZER_MANIFEST_SIGNING_KEY",
            b"a",
            b"x" * (checkpoint.MAX_SIGNING_KEY_BYTES + 1),
            "not a key file",
        ),
        ("encryption_key_from", "TENSORIZER_MANIFEST_ENCRYPTION_KEY", b"e", b"e" * 15, "encryption key has 15 bytes"),
    ],
)
def test_a_key_comes_from_the_option_else_the_environment(
    tmp_path, monkeypatch, key_from, env, letter, bad_file, bad_message
):
    from tensorizer_manifest.errors import ConfigurationError

    key_from = getattr(checkpoint, key_from)
    key = tmp_path / "key"
    key.write_bytes(letter * 32)
    monkeypatch.delenv(env, raising=False)
    assert key_from(None) is None
    assert key_from(key) is not None
    monkeypatch.setenv(env, str(key))
    assert key_from(None) is not None
    itself = letter.decode() * 64
    monkeypatch.setenv(env, itself)  # the key itself, not its path
    with pytest.raises(ConfigurationError, match=rf"\${env}.*not the key itself") as info:
        key_from(None)
    assert itself not in str(info.value)
    bad = tmp_path / "bad"
    bad.write_bytes(bad_file)
    with pytest.raises(ConfigurationError, match=bad_message):
        key_from(bad)


def test_a_remote_manifest_is_found_and_read(moto_s3, tmp_path):
    from helpers.servers import BUCKET, RangeHTTPServer

    from tensorizer_manifest.errors import RemoteNotFoundError
    from tensorizer_manifest.storage.remote import RemoteFile, RemoteOptions
    from tensorizer_manifest.storage.remote_checkpoint import upload_checkpoint

    local = write_synthetic_checkpoint(tmp_path / "ckpt")
    options = RemoteOptions(moto_s3.key_id, moto_s3.secret, moto_s3.endpoint)
    uri = f"s3://{BUCKET}/checkpoint-test"
    upload_checkpoint(local, uri, options)
    expected = checkpoint.read_manifest(local)
    for where in (uri, uri + "/", uri + "/model.manifest.json"):
        manifest, path = checkpoint.load_manifest(where, remote=options)
        assert manifest == expected and isinstance(path, RemoteFile) and str(path) == uri + "/model.manifest.json"
    tensor = checkpoint.resolve_tensor_file(manifest, path)
    assert str(tensor) == f"{uri}/{manifest.tensor_file.path}"
    assert checkpoint.file_size(tensor) == manifest.tensor_file.size
    with pytest.raises(CompatibilityError, match="saved with tensor_parallel_size=1, pipeline_parallel_size=1"):
        checkpoint.load_manifest(uri, "model-tp0-of-2", remote=options)
    with RangeHTTPServer(tmp_path) as server:
        assert checkpoint.read_manifest(f"{server.url}/ckpt") == expected
        (local / manifest.tensor_file.path).unlink()
        with pytest.raises(RemoteNotFoundError, match="tensor file named by the manifest is missing"):
            checkpoint.resolve_tensor_file(manifest, RemoteFile(f"{server.url}/ckpt/model.manifest.json"))


def test_a_rank_layout_other_than_the_saved_one_is_named_before_anything_is_read(tmp_path):
    from tensorizer_manifest.errors import CompatibilityError
    from tensorizer_manifest.storage.checkpoint import checkpoint_stem, find_manifest, parallel_layout

    for rank in range(2):
        (tmp_path / f"{checkpoint_stem(0, 1, rank, 2)}.manifest.json").write_text("{}")
    assert parallel_layout("model-tp1-of-2-pp0-of-4") == (2, 4) and parallel_layout("other") is None
    assert find_manifest(tmp_path, "model-pp1-of-2").name == "model-pp1-of-2.manifest.json"
    with pytest.raises(CompatibilityError) as info:
        find_manifest(tmp_path, checkpoint_stem(1, 2))  # an engine with TP=2, PP=1
    message = str(info.value)
    assert "saved with tensor_parallel_size=1, pipeline_parallel_size=2" in message
    assert "this engine runs tensor_parallel_size=2, pipeline_parallel_size=1" in message
    assert info.value.differences == [("parallel_layout", (1, 2), (2, 1))]


def test_a_tensor_file_given_finds_the_manifest_beside_it(tmp_path):
    d = write_synthetic_checkpoint(tmp_path / "ckpt")
    manifest, path = checkpoint.load_manifest(d)
    assert checkpoint.find_manifest(d / manifest.tensor_file.path) == path  # model.<digest>.tensors
    assert checkpoint.manifest_name_beside("model-tp1-of-2.0123456789abcdef.tensors") == (
        "model-tp1-of-2.manifest.json"
    )
    assert checkpoint.manifest_name_beside("model.tensors") == "model.manifest.json"  # stock vLLM's name
    with pytest.raises(CheckpointNotFoundError, match=r"no such tensor file, and no other.manifest.json beside it"):
        checkpoint.find_manifest(d / "other.tensors")


def test_a_stock_vllm_tensor_file_is_refused_with_the_command_that_resaves_it(tmp_path):
    from tensorizer_manifest.errors import NoManifestError

    stock = write_stock_tensor_file(tmp_path / "stock" / "model.tensors")
    for given in (stock, stock.parent):
        with pytest.raises(NoManifestError) as caught:
            checkpoint.find_manifest(given, "model")
        message = str(caught.value)
        assert "\n" not in message
        assert message.startswith(f"{stock}: a tensorizer file without a manifest beside it")
        assert f"`tensorizer-manifest save SOURCE_MODEL {stock.parent}`" in message
        assert caught.value.tensor_file == stock
    # a file that is not tensorizer's is not called one
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "model.tensors").write_bytes(b"not tensorizer")
    with pytest.raises(CheckpointNotFoundError) as caught:
        checkpoint.find_manifest(tmp_path / "junk", "model")
    assert not isinstance(caught.value, NoManifestError)


def test_a_stock_vllm_tensor_file_is_refused_over_s3_and_http(moto_s3, tmp_path):
    from helpers.servers import BUCKET, RangeHTTPServer

    from tensorizer_manifest.errors import NoManifestError
    from tensorizer_manifest.storage.remote import RemoteOptions

    stock = write_stock_tensor_file(tmp_path / "stock" / "model.tensors")
    options = RemoteOptions(moto_s3.key_id, moto_s3.secret, moto_s3.endpoint)
    moto_s3.client().upload_file(str(stock), BUCKET, "stock-test/model.tensors")
    uri = f"s3://{BUCKET}/stock-test"
    for given, stem in ((uri, "model"), (uri, None), (uri + "/model.tensors", None)):
        with pytest.raises(NoManifestError, match=f"{uri}/model.tensors: a tensorizer file without a manifest"):
            checkpoint.find_manifest(given, stem, options)
    with RangeHTTPServer(tmp_path) as server:
        for given in (f"{server.url}/stock", f"{server.url}/stock/model.tensors"):
            with pytest.raises(NoManifestError, match="tensorize_vllm_model write"):
                checkpoint.find_manifest(given, "model")


def test_a_checkpoint_whose_manifest_is_lost_is_not_called_a_stock_file(tmp_path):
    from tensorizer_manifest.errors import NoManifestError

    d = write_synthetic_checkpoint(tmp_path / "ckpt")
    tensor_file = d / checkpoint.read_manifest(d).tensor_file.path
    (d / "model.manifest.json").unlink()
    for given in (d, tensor_file):
        with pytest.raises(CheckpointNotFoundError) as caught:
            checkpoint.find_manifest(given, "model")
        assert not isinstance(caught.value, NoManifestError)
    with pytest.raises(CheckpointNotFoundError, match="its manifest model.manifest.json is missing beside it"):
        checkpoint.find_manifest(tensor_file)
