"""The public API: what `tensorizer_manifest` exports, its errors, and what importing it costs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import tensorizer_manifest as tm

ROOT = Path(__file__).resolve().parent.parent


def test_public_api_is_what_was_meant():
    assert set(tm.__all__) == {
        "__version__", "FORMAT_VERSION", "LOAD_FORMAT", "CAPTURE_LOAD_FORMAT", "WORKER_EXTENSION",
        "save_checkpoint", "SaveOptions", "SaveResult",
        "Manifest", "read_manifest", "decode_manifest", "encode_manifest", "json_schema",
        "validate_checkpoint", "ValidationReport", "Problem",
        "Restorer", "register_restorer",
        "TensorizerManifestError", "ManifestError", "ManifestVersionError", "CheckpointNotFoundError",
        "NoManifestError", "ConfigurationError", "IntegrityError", "CompatibilityError", "UnsupportedModelError",
        "ReplayError", "NotReproducibleError", "UnsupportedVLLMError", "UnsupportedTensorizerError",
        "ConcurrentWriteError",
        "RemoteOptions", "fetch_model_files", "upload_checkpoint",
        "RemoteStorageError", "RemoteNotFoundError", "RemoteAccessError", "RemoteUnreachableError",
        "RemoteThrottledError", "RemoteChangedError", "RemoteStalledError", "UnsafeStorageError",
    }  # fmt: skip
    for name in tm.__all__:
        assert getattr(tm, name) is not None, name
    assert set(tm.__all__) <= set(dir(tm))


def test_lazy_names_are_the_real_objects():
    from tensorizer_manifest.checks.validate import validate_checkpoint
    from tensorizer_manifest.restorers import Restorer, register
    from tensorizer_manifest.save.from_source import save_checkpoint

    assert tm.Restorer is Restorer and tm.register_restorer is register
    assert tm.save_checkpoint is save_checkpoint and tm.validate_checkpoint is validate_checkpoint


def test_every_error_is_a_tensorizer_manifest_error_and_a_builtin():
    assert issubclass(tm.ManifestError, ValueError)
    assert issubclass(tm.ManifestVersionError, tm.ManifestError)
    assert issubclass(tm.CheckpointNotFoundError, FileNotFoundError)
    assert issubclass(tm.NoManifestError, tm.CheckpointNotFoundError)
    assert issubclass(tm.NotReproducibleError, tm.TensorizerManifestError)
    assert issubclass(tm.UnsupportedVLLMError, tm.UnsupportedModelError)
    assert issubclass(tm.UnsupportedTensorizerError, tm.UnsupportedModelError)
    assert issubclass(tm.ConfigurationError, ValueError)
    assert issubclass(tm.ReplayError, RuntimeError)
    assert issubclass(tm.RemoteStorageError, OSError)
    assert issubclass(tm.RemoteNotFoundError, tm.CheckpointNotFoundError)
    assert issubclass(tm.RemoteAccessError, PermissionError) and issubclass(tm.RemoteAccessError, tm.RemoteStorageError)
    assert issubclass(tm.RemoteUnreachableError, ConnectionError)
    assert issubclass(tm.RemoteThrottledError, tm.RemoteStorageError)
    assert issubclass(tm.RemoteChangedError, tm.RemoteStorageError)
    assert issubclass(tm.RemoteStalledError, tm.RemoteStorageError)
    assert issubclass(tm.UnsafeStorageError, tm.RemoteStorageError)
    assert issubclass(tm.ConcurrentWriteError, RuntimeError)
    for name in ("ManifestError", "CheckpointNotFoundError", "ConfigurationError", "IntegrityError",
                 "CompatibilityError", "UnsupportedModelError", "ReplayError", "RemoteStorageError",
                 "RemoteNotFoundError", "RemoteAccessError", "RemoteUnreachableError"):  # fmt: skip
        assert issubclass(getattr(tm, name), tm.TensorizerManifestError)


def test_importing_the_package_imports_neither_torch_nor_vllm():
    code = (
        "import sys, tensorizer_manifest as tm\n"
        "tm.read_manifest, tm.Manifest, tm.decode_manifest\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm', 'tensorizer'))\n"
        "assert not heavy, heavy\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_version_is_the_packaged_one():
    from importlib.metadata import version

    assert tm.__version__ == version("tensorizer-manifest")


def test_no_pickle_anywhere_in_the_package():
    for path in (ROOT / "tensorizer_manifest").rglob("*.py"):
        text = path.read_text()
        for needle in ("import pickle", "cloudpickle", "torch.load(", "pickle.load"):
            assert needle not in text, f"{path.name} uses {needle}"


def test_the_public_surface_is_the_one_before_the_folders():
    """When every module moved into folders: what a user names (``__all__`` and its signatures, the commands and
    their options, the entry points, the worker extension, the manifest schema) is unchanged."""
    import json

    from helpers.public_surface import FIXTURE, surface

    assert surface() == json.loads(FIXTURE.read_text())


def test_keywords_declared_once_are_shown_where_they_are_passed_on():
    """``takes_keywords_of``: a function that passes ``**options`` on shows its source's keyword-only parameters
    (a pydantic model's fields, or a callee's), after its own fixed ones, and still passes them on."""
    import inspect

    from pydantic import BaseModel

    from tensorizer_manifest._signatures import takes_keywords_of

    class Options(BaseModel):
        size: int = 1
        name: str | None = None

    def callee(a, b=2, *, flag: bool = False, level: int = 3) -> tuple:
        return a, b, flag, level

    @takes_keywords_of(Options)
    def from_model(src: str, **options) -> Options:
        return Options(**options)

    @takes_keywords_of(callee)
    def forwards(a, **options) -> tuple:
        return callee(a, **options)

    shown = inspect.signature(from_model)
    assert [(p.name, p.kind.name, p.default) for p in shown.parameters.values()] == [
        ("src", "POSITIONAL_OR_KEYWORD", inspect.Parameter.empty),
        ("size", "KEYWORD_ONLY", 1),
        ("name", "KEYWORD_ONLY", None),
    ]
    assert list(inspect.signature(forwards).parameters) == ["a", "flag", "level"]  # b is the callee's own
    assert forwards(1, level=5) == (1, 2, False, 5) and from_model("x", size=4).size == 4


def test_the_forwarding_writers_and_readers_show_their_callees_keywords():
    """``write_checkpoint`` and ``open_checked`` declare none of their own: their keywords are the functions'
    they pass them to, so the two cannot drift apart."""
    import inspect

    from tensorizer_manifest.checks.validate import open_checked, open_checked_forms
    from tensorizer_manifest.save.write import prepare_checkpoint, write_checkpoint

    for forwarding, callee in ((write_checkpoint, prepare_checkpoint), (open_checked, open_checked_forms)):
        shown, declared = inspect.signature(forwarding).parameters, inspect.signature(callee).parameters
        assert list(shown) == list(declared), forwarding.__name__
        assert [p.default for p in shown.values()] == [p.default for p in declared.values()]
