"""Each module of ``checks/`` on its own, on the synthetic checkpoint (no vLLM).

``test_validate.py`` runs them together through ``validate_checkpoint`` and the loader's ``open_checked``
over the catalogue of damaged checkpoints; these pin what each one answers for one case of its own.
"""

from __future__ import annotations

import msgspec
import pytest
from helpers.synthetic import write_synthetic_checkpoint

from tensorizer_manifest import errors
from tensorizer_manifest.checks.records import check_manifest
from tensorizer_manifest.checks.report import Problem, ValidationReport
from tensorizer_manifest.checks.seal import check_encryption, check_seal, unsealed_warning
from tensorizer_manifest.checks.tensor_files import check_hashes, check_tensor_file
from tensorizer_manifest.format import schema
from tensorizer_manifest.storage.checkpoint import load_manifest


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = write_synthetic_checkpoint(tmp_path_factory.mktemp("checks") / "ckpt")
    manifest, path = load_manifest(directory)
    return manifest, path


def test_a_report_raises_its_first_problem_naming_the_rest():
    problems = tuple(Problem(errors.IntegrityError, "f", f"problem {i}") for i in range(7))
    report = ValidationReport(None, None, problems=problems)
    assert not report.ok and report.to_dict()["problems"][0] == {"error": "IntegrityError", "where": "f",
                                                                   "message": "problem 0"}  # fmt: skip
    with pytest.raises(errors.IntegrityError, match=r"f: problem 0 \(and 6 more: f: problem 1; .*f: problem 5\)"):
        report.raise_for_problems()
    assert ValidationReport(None, None).ok


def test_the_seal_binds_the_manifest_and_a_key_accepts_only_its_own_seal(saved):
    manifest, _ = saved
    assert check_seal(manifest, None) is None and unsealed_warning(manifest) is None
    edited = msgspec.structs.replace(manifest, producer="someone else")
    kind, message = check_seal(edited, None)
    assert kind is errors.IntegrityError and "modified after it was saved" in message
    key = schema.SigningKey(b"0123456789abcdef")
    kind, message = check_seal(manifest, key)
    assert kind is errors.IntegrityError and "plain digest" in message
    unsealed = msgspec.structs.replace(manifest, seal=None)
    assert check_seal(unsealed, None) is None and "not sealed" in unsealed_warning(unsealed)
    kind, message = check_encryption(manifest, schema.EncryptionKey(b"0123456789abcdef"))
    assert kind is errors.IntegrityError and "not encrypted" in message


def test_records_are_checked_and_keyed_and_the_digest_binds_them(saved):
    manifest, path = saved
    problems, by_key = check_manifest(manifest, path)
    assert problems == [] and len(by_key) == manifest.tensor_file.tensor_count
    doubled = msgspec.structs.replace(manifest, modules=[*manifest.modules, manifest.modules[0]])
    messages = [p.message for p in check_manifest(doubled, path, check_the_seal=False)[0]]
    assert any("recorded twice" in m for m in messages)
    assert any("do not match the digest" in m for m in messages)


def test_a_tensor_file_is_checked_against_its_records_then_its_hashes(saved, tmp_path):
    manifest, path = saved
    _, by_key = check_manifest(manifest, path)
    tensors = path.parent / manifest.tensor_file.path
    assert check_tensor_file(manifest.tensor_file, tensors, by_key) == []
    assert check_hashes(tensors, by_key) == ([], len(by_key))
    short = tmp_path / tensors.name
    short.write_bytes(tensors.read_bytes()[:-1])
    (problem,) = check_tensor_file(manifest.tensor_file, short, by_key)
    assert problem.kind is errors.IntegrityError and "truncated" in problem.message
